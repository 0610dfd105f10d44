"""One memory admission policy over a KV page pool, shared by the simulated and the torch engines,
so simulated out-of-memory behaviour is the real one.

In: per step, each row's `PageNeed` (request id, pages the row adds this step, the pages the request
may need on this node in all, whether it needs a recurrent state slot), and the pool's free pages
and slots. Out: `shortfall(...)` -> ids of the rows that cannot get their memory this step (nothing
changes; the engine reports them in `allocation_failed` and the run loop holds and retries them);
then `grant(need)` for each row that runs, and `release(id)` when a request ends.

The rule (budgets): a request starts on a node only when its whole budget fits beside what the
started requests may still claim (each one's budget minus the pages it holds); a started request
grows into its budget before anyone else's claims. So a request that started can always finish and
a full pool never deadlocks. A request that outgrows its budget (it feeds more tokens than it
declared) takes only pages nobody else may claim. Rows are considered in step order. The policy
keeps its own count of what each started request holds, so a step costs O(rows), not O(requests).

First come, first started (no starvation): a request that has not started waits in the order of
its first contact with the policy (its prefix claim, `join`, or its first `shortfall`), and its
budget is reserved: a request may start only when its budget fits beside the started requests'
claims and the budgets of the requests that waited before it, and a prefix claim takes no free page
those need (`room_to_start`). Without that, small newcomers took each page a finishing request
freed, and a large request waited until the workload drained (a 63-page request behind 1,600 small
ones in a 64-page pool started after all of them). A request stops waiting when it starts or ends;
one whose pages moved to a host pool (kv/offload.py) starts again later and waits, once more, where
its first contact put it, before the requests that came after it.

Pages that requests not yet started hold (their prefix claims: a claim of pages another request
holds needs no free page, and keeps them when that one ends) are not freed by any started request
ending. So a waiting request reserves its budget only while it could start once every started
request ended, its budget within the pool less the distinct pages the waiting requests' claims
hold (`is_reachable`, given the pool's size); one that could not waits without a reservation, so the
claimers before which it cannot start do start, end, and free their claims. Without that rule a
waiting request whose budget wanted a younger one's claimed pages and the younger one, behind its
reservation, waited for each other forever.

And every waiting request stays startable once the requests that waited before it have started:
its budget fits the pool beside the pages its own claim and the claims of the requests after it
hold (its room, the claims before it ending as they start). A new claim takes only pages that keep
every waiting request's room (`claim_cap`): a page counts against the rooms of the requests whose
claims and younger ones' do not hold it already. Counting only pages no waiting request held let
a newcomer claim, free of charge, the cached pages of an older waiter's claim and keep them after
that one started and ended: two waiting requests then each wanted pages the other's claim held,
with nothing started to free any, and waited forever. Joining without a claim, starting and
ending only shrink the claims after a request, so the oldest waiting request can always start
once the started ones end: no request waits forever.

A row of a request not started may add more pages than its budget (an encoder feeding more than
its declared media tokens). The request then waits with the larger figure only while that keeps
its room (`outgrows_room`: the pool beside the pages its own claim and the later waiters' claims
hold, claims that were capped for the smaller figure); past it `shortfall` refuses the row without
letting the request wait with it, and the torch engine ends the request with an error naming the
pages (runners/decoder.py `_room_problem`; the simulated engine's rows never pass their budget).
Before, the request joined with the larger figure: with a younger claim capped for its budget,
each could then wait on the other's claimed pages with nothing started to free any, forever.
"""
from __future__ import annotations

from dataclasses import dataclass
from operator import ge
from typing import Callable, Optional, Sequence


@dataclass(frozen=True)
class PageNeed:
    request_id: str
    num_pages: int  # pages the row adds this step
    budget_pages: int  # pages the request may need on this node in all (read when it starts)
    needs_slot: bool = False  # the request has no recurrent state slot yet


class Admission:
    def __init__(self, num_pages: Optional[int] = None) -> None:
        """num_pages: the pool's pages (None: every waiting request counts as reachable)."""
        self.num_pages = num_pages
        self.budgets: dict[str, int] = {}  # started request -> pages it may need
        self.held: dict[str, int] = {}  # started request -> pages it holds
        self.num_outstanding = 0  # sum over started requests of max(0, budget - held)
        self.waiting: dict[str, int] = {}  # not started -> its budget, in the order of first contact
        self.claims: dict[str, Sequence[int]] = {}  # waiting request -> the pages its prefix claim holds
        # live request -> the number of its first contact (the waiting order), kept while its pages
        # are on a host pool (`release(keep_place=True)`) so it waits again where it first came
        self._contact: dict[str, int] = {}
        self._num_contacts = 0
        # the distinct pages of the claims, and each waiting request's room, built when asked (a lone
        # cached request's 64 claimed pages would otherwise be counted in and out on its admission's path)
        self._claimed: Optional[frozenset[int]] = frozenset()
        self._rooms: Optional[_Rooms] = None

    @property
    def num_reserved(self) -> int:
        """The waiting requests' budgets."""
        return sum(self.waiting.values())

    def is_started(self, request_id: str) -> bool:
        return request_id in self.budgets

    def shortfall(self, needs: list[PageNeed], num_free_pages: int, num_free_slots: int = 0) -> list[str]:
        """Ids of rows that cannot get their pages (or a slot) this step. Nothing else changes, but
        a request not started joins the waiting ones, in step order, until `grant` starts it
        (module docstring)."""
        num_free, outstanding = num_free_pages, self.num_outstanding
        failed = []
        starting: set[str] = set()  # waiting requests this pass lets start: no longer reserved
        for need in needs:
            budget = self.budgets.get(need.request_id)
            if budget is not None:
                remaining = max(0, budget - self.held[need.request_id])
                is_granted = need.num_pages <= num_free - (outstanding - remaining)
                claimed = -min(need.num_pages, remaining)
            else:
                if self.outgrows_room(need):  # refused for good: it never waits with that figure
                    failed.append(need.request_id)
                    continue
                reserved = self.reserved_before(need.request_id, starting)
                is_granted = max(need.budget_pages, need.num_pages) <= num_free - outstanding - reserved
                claimed = max(0, need.budget_pages - need.num_pages)
            if budget is None:  # first contact, or its budget now (a step may grant no row)
                self.join(need.request_id, max(need.budget_pages, need.num_pages))
            if not is_granted or (need.needs_slot and num_free_slots == 0):
                failed.append(need.request_id)
                continue
            if budget is None:
                starting.add(need.request_id)
            num_free -= need.num_pages
            outstanding += claimed
            num_free_slots -= need.needs_slot
        return failed

    @staticmethod
    def startable_by_pages(needs: list[PageNeed], failed: list[str], num_free_slots: int) -> list[str]:
        """The refused requests of `needs` that pages moved to a host pool could start: those that
        need no recurrent state slot, or would get one of the `num_free_slots` (in `failed`'s
        order). Moving out frees pages, never a slot (a slot stays its request's), so moving for a
        row short of a slot only took the moved request out of the started ones, behind waiters
        that could never start (Qwen3.5 with a host pool and fewer slots than requests: every
        request ended `stalled`). Both engines ask this before they move anything out."""
        by_id = {need.request_id: need for need in needs}
        startable = []
        for request_id in failed:
            need = by_id.get(request_id)
            if need is not None and need.needs_slot:
                if num_free_slots <= 0:
                    continue
                num_free_slots -= 1
            startable.append(request_id)
        return startable

    def grant(self, need: PageNeed) -> None:
        """The row runs: its request starts (when new) and holds `num_pages` more pages."""
        request_id = need.request_id
        if request_id not in self.budgets:
            self._stop_waiting(request_id)
            self.budgets[request_id] = need.budget_pages
            self.held[request_id] = 0
            self.num_outstanding += need.budget_pages
        budget, held = self.budgets[request_id], self.held[request_id]
        self.held[request_id] = held + need.num_pages
        self.num_outstanding += max(0, budget - held - need.num_pages) - max(0, budget - held)

    def grant_one_page_each(self, request_ids: list[str], num_free_pages: int) -> bool:
        """`shortfall` then `grant` of one page for each of these rows, in one pass, when every row
        would pass: each request started and holds fewer pages than its budget, and the free pages
        cover what the started requests may still claim. A row's check then passes and its grant
        takes one free page and one page of outstanding claim, which leaves that margin as it was
        for the rows after it, so the end state is the row-by-row one. False, with nothing
        changed, otherwise (ask row by row)."""
        budgets, held = self.budgets, self.held
        if (num_free_pages < self.num_outstanding or not budgets.keys() >= set(request_ids)
                or any(map(ge, map(held.__getitem__, request_ids), map(budgets.__getitem__, request_ids)))):
            return False
        for request_id in request_ids:
            held[request_id] += 1
        self.num_outstanding -= len(request_ids)
        return True

    def release(self, request_id: str, keep_place: bool = False) -> int:
        """The request ended, or with `keep_place` its pages moved to a host pool (it starts again
        when it comes back, waiting where its first contact put it); returns the pages it held (the
        engine frees them in its pool)."""
        self._stop_waiting(request_id)
        if not keep_place:
            self._contact.pop(request_id, None)
        budget = self.budgets.pop(request_id, None)
        if budget is None:
            return 0
        held = self.held.pop(request_id)
        self.num_outstanding -= max(0, budget - held)
        return held

    def room_to_start(self, request_id: str, num_free_pages: int) -> int:
        """Free pages a start of this request may take now (a prefix claim takes no more): the free
        pages less what the started requests may still claim and the budgets reserved before it."""
        return num_free_pages - self.num_outstanding - self.reserved_before(request_id)

    def pages_short(self, needs: list[PageNeed], failed: set[str], num_free_pages: int) -> int:
        """Free pages the refused rows of `needs` want beyond what is free to them, which moving
        other requests' pages to the host would have to give (kv/offload.py): their pages, less the
        room the oldest refused start has (a started row's growth is not behind any reservation).
        That room may be below zero (older waiting requests reserve more than is free): then the
        rows want that much more. Clamped at zero it was left out, so the pages moved out went to
        those reservations, the rows were refused anyway and every request could end up held with
        the whole pool free, the device idle until the holds' backoff (a sim run of 300 requests on
        64 pages: 0.41 s idle of 1.82)."""
        wanted = sum(max(n.budget_pages, n.num_pages) for n in needs if n.request_id in failed)
        starts = [n.request_id for n in needs if n.request_id in failed and n.request_id not in self.budgets]
        reserved = min(map(self.reserved_before, starts), default=0)
        return wanted - (num_free_pages - self.num_outstanding - reserved)

    def reserved_before(self, request_id: str, starting: frozenset[str] | set[str] = frozenset()) -> int:
        """The budgets of the reachable requests that waited before this one (every waiting one
        when it does not wait), less those in `starting`; what a start of it must leave free."""
        if not self.waiting:
            return 0
        reserved = 0
        for waiting_id, budget in self.waiting.items():
            if waiting_id == request_id:
                break
            if waiting_id not in starting and self.is_reachable(waiting_id):
                reserved += budget
        return reserved

    def claim_cap(self, request_id: str, chain: Callable[[], list[int]]) -> Optional[int]:
        """The most pages of `chain()` (the cached pages this request's claim would walk, in order)
        the claim may take so that every waiting request keeps its room (module docstring): a page
        counts against the room of each request that waited before this one and whose claim, and the
        claims after it, do not hold the page. None: no cap (nobody waits, or the pool's size is not
        known), and `chain` is not called."""
        if self.num_pages is None or not self.waiting:
            return None
        rooms = self._waiting_rooms()
        position = rooms.positions.get(request_id, len(rooms.rooms))
        least = rooms.least_before(position)  # least[t]: the least room of the requests t..position-1
        counts: dict[int, int] = {}  # first position charged -> pages of the claim so far
        for index, page in enumerate(chain()):
            first = rooms.youngest.get(page, -1) + 1  # the requests from here on lack the page
            if first >= position:
                continue  # held by this request's or a younger one's claim: charged to nobody
            counts[first] = counts.get(first, 0) + 1
            # the requests from each charged position on: the pages charged to them within their room
            charged = 0
            for start in sorted(counts):
                charged += counts[start]
                if start >= first and charged > least[start]:
                    return index
        return None

    def outgrows_room(self, need: PageNeed) -> bool:
        """Whether this row of a request not started would leave it no room (module docstring): it
        adds more pages than the request waits with, and the larger figure does not fit the pool
        beside the pages its claim and the later waiters' claims hold (those claims were capped for
        the smaller figure). Such a row can never start its request, so `shortfall` refuses it
        without letting the request wait with it, and the torch and GPU engines end the request with an
        error (runners/decoder.py `_room_problem`; the simulated engine's rows never pass their budget)."""
        request_id = need.request_id
        if self.num_pages is None or request_id in self.budgets:
            return False  # no claims to keep rooms for; a started request's growth takes free pages only
        figure = max(need.budget_pages, need.num_pages)
        waited = self.waiting.get(request_id)
        if waited is None:  # a first contact holds no claim (a claim joins) and waits last
            return figure > self.num_pages
        if figure <= waited:
            return False  # the claims after it were capped for this figure or a larger one
        rooms = self._waiting_rooms()
        return rooms.rooms[rooms.positions[request_id]] + waited < figure

    def is_reachable(self, request_id: str) -> bool:
        """Whether the waiting request could start once every started request ended: its budget
        (beyond its own claim) within the pool less the pages the waiting requests' claims hold, its
        own among them (module docstring)."""
        return self.num_pages is None or self.waiting[request_id] <= self.num_pages - len(self.claimed_pages())

    def join(self, request_id: str, budget: int, claimed_pages: Optional[Sequence[int]] = None) -> None:
        """The request waits to start from its first contact on (a prefix claim, a refused start),
        with its latest budget and, from a claim, the pages the claim holds (counted once however
        many waiting requests share them); a started request does not wait."""
        if request_id in self.budgets:
            return
        if request_id not in self.waiting:
            self._wait_in_contact_order(request_id, budget)
        elif self.waiting[request_id] != budget:  # `shortfall` joins every waiting row each step, mostly unchanged
            self.waiting[request_id] = budget
            self._rooms = None
        if claimed_pages:
            self._drop_claim(request_id)
            self.claims[request_id] = claimed_pages
            self._claimed = None

    def _wait_in_contact_order(self, request_id: str, budget: int) -> None:
        """The request waits from now, in the order of first contact: last, unless it came before
        (a request whose pages moved to a host pool, back for its turn). It went last before, behind
        every request that arrived while it ran, so under a steady overload a moved request waited
        for the queue to drain and the host pool made runs slower than none (`mstar bench
        offload`: 1.15-1.17x the span, now 0.91-0.92x; docs/runtime.md "KV offload")."""
        order = self._contact
        if request_id not in order:  # a first contact; a moved request keeps its number
            order[request_id] = self._num_contacts
            self._num_contacts += 1
        contact, waiting = order[request_id], self.waiting
        if waiting and order[next(reversed(waiting))] > contact:
            ordered = sorted([*waiting.items(), (request_id, budget)], key=lambda item: order[item[0]])
            waiting.clear()
            waiting.update(ordered)
        else:
            waiting[request_id] = budget
        self._rooms = None

    def _stop_waiting(self, request_id: str) -> None:
        if self.waiting.pop(request_id, None) is not None:
            self._rooms = None
        self._drop_claim(request_id)

    def _drop_claim(self, request_id: str) -> None:
        if self.claims.pop(request_id, None) is not None:
            self._claimed = self._rooms = None

    def claimed_pages(self) -> frozenset[int]:
        """The distinct pages the waiting requests' claims hold."""
        if self._claimed is None:
            self._claimed = frozenset().union(*self.claims.values())
        return self._claimed

    def _waiting_rooms(self) -> _Rooms:
        if self._rooms is None:
            assert self.num_pages is not None
            self._rooms = _Rooms.of(self.waiting, self.claims, self.num_pages)
        return self._rooms


@dataclass
class _Rooms:
    """Each waiting request's room: the pool's pages less its budget and the distinct pages its
    claim and the claims of the requests after it hold (what stays claimed once the requests before
    it have started)."""
    positions: dict[str, int]  # waiting request -> its place in the waiting order
    youngest: dict[int, int]  # claimed page -> the place of the latest waiting request claiming it
    rooms: list[int]  # by place

    @classmethod
    def of(cls, waiting: dict[str, int], claims: dict[str, Sequence[int]], num_pages: int) -> _Rooms:
        positions = {request_id: place for place, request_id in enumerate(waiting)}
        youngest: dict[int, int] = {}
        for request_id, pages in claims.items():
            place = positions[request_id]
            for page in pages:
                if youngest.get(page, -1) < place:
                    youngest[page] = place
        last_claimed = [0] * len(positions)  # pages whose latest claimer is at this place
        for place in youngest.values():
            last_claimed[place] += 1
        rooms, held = [0] * len(positions), 0
        for request_id, place in reversed(positions.items()):
            held += last_claimed[place]
            rooms[place] = num_pages - waiting[request_id] - held
        return cls(positions, youngest, rooms)

    def least_before(self, position: int) -> list[int]:
        """least[t]: the least room among the places t .. position - 1."""
        least = [0] * position
        lowest = None
        for place in reversed(range(position)):
            lowest = self.rooms[place] if lowest is None else min(lowest, self.rooms[place])
            least[place] = lowest
        return least
