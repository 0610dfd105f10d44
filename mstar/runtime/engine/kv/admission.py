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
"""
from __future__ import annotations

from dataclasses import dataclass
from operator import ge


@dataclass(frozen=True)
class PageNeed:
    request_id: str
    num_pages: int  # pages the row adds this step
    budget_pages: int  # pages the request may need on this node in all (read when it starts)
    needs_slot: bool = False  # the request has no recurrent state slot yet


class Admission:
    def __init__(self) -> None:
        self.budgets: dict[str, int] = {}  # started request -> pages it may need
        self.held: dict[str, int] = {}  # started request -> pages it holds
        self.num_outstanding = 0  # sum over started requests of max(0, budget - held)

    def is_started(self, request_id: str) -> bool:
        return request_id in self.budgets

    def shortfall(self, needs: list[PageNeed], num_free_pages: int, num_free_slots: int = 0) -> list[str]:
        """Ids of rows that cannot get their pages (or a slot) this step; nothing is changed."""
        num_free, outstanding = num_free_pages, self.num_outstanding
        failed = []
        for need in needs:
            budget = self.budgets.get(need.request_id)
            if budget is not None:
                remaining = max(0, budget - self.held[need.request_id])
                is_granted = need.num_pages <= num_free - (outstanding - remaining)
                claimed = -min(need.num_pages, remaining)
            else:
                is_granted = max(need.budget_pages, need.num_pages) <= num_free - outstanding
                claimed = max(0, need.budget_pages - need.num_pages)
            if not is_granted or (need.needs_slot and num_free_slots == 0):
                failed.append(need.request_id)
                continue
            num_free -= need.num_pages
            outstanding += claimed
            num_free_slots -= need.needs_slot
        return failed

    def grant(self, need: PageNeed) -> None:
        """The row runs: its request starts (when new) and holds `num_pages` more pages."""
        request_id = need.request_id
        if request_id not in self.budgets:
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

    def release(self, request_id: str) -> int:
        """The request ended; returns the pages it held (the engine frees them in its pool)."""
        budget = self.budgets.pop(request_id, None)
        if budget is None:
            return 0
        held = self.held.pop(request_id)
        self.num_outstanding -= max(0, budget - held)
        return held
