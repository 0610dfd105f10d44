"""KV offload bookkeeping: a host pool of pages, which requests' pages are on the host, and which
started request to move there when a step is short of device pages. Holds no tensors (an engine
copies the pages' contents; the simulated engine copies nothing) and is shared by both engines.

In: the device `PagePool`, the node's `Admission`, the ids of the rows of the step being built.
Out:
- `victims(pool, admission, step_ids, num_short, num_starts)`: started requests to move to the host
  so that `num_short` more pages fit beside what started requests may still claim, for the
  `num_starts` requests those pages would start: least recently run first (ties: most pages
  first), never one with a row in this step, only while the host pool has room for all of a
  victim's pages, and only fewer victims than starts (a move must raise the number of started
  requests) but for parked ones, which go first;
- `park(request_id)`: the request runs no more on this node (its KV was sent to another rank and
  waits there to be dropped): moving it out stops no request that would run;
- `take(request_id, sequences)`: record a victim's sequences (label, tokens, device pages) and give
  host pages for them, in order; the engine copies device -> host and then frees the device pages
  and the victim's admission (it is no longer started: it starts again when it runs, in the
  admission's order where its first contact put it, `Admission.release(keep_place=True)`);
- `restore(request_id)`: the host pages of an offloaded request's sequences, released; the engine
  reserves device pages through the admission policy first (a request that cannot get them is
  held, as any row short of memory), copies host -> device, and commits the tokens.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

from mstar.runtime.engine.kv.admission import Admission, PageNeed
from mstar.runtime.engine.kv.free_ids import FreeIds
from mstar.runtime.engine.kv.pages import PagePool


@dataclass
class HostSequence:
    label: str
    num_tokens: int
    host_pages: list[int]


class Offload:
    def __init__(self, num_host_pages: int):
        self.num_host_pages = num_host_pages
        self._free = FreeIds(0, num_host_pages)
        self.offloaded: dict[str, list[HostSequence]] = {}
        self.last_run: dict[str, int] = {}  # request -> step number it last ran in
        self.parked: set[str] = set()  # requests that run no more here (`park`)
        self.num_steps = 0
        self.num_offloaded_pages = 0  # pages moved to the host so far (for the report)
        self.num_restored_pages = 0

    @property
    def num_free_host_pages(self) -> int:
        return len(self._free)

    def _take(self) -> int:
        page = self._free.take()
        assert page is not None, "victims() chose only what the host pool has room for"
        return page

    def note_step(self, request_ids: list[str]) -> None:
        self.num_steps += 1
        for request_id in request_ids:
            self.last_run[request_id] = self.num_steps

    def figures(self) -> dict[str, int]:
        """The pages moved to the host and back so far, as the run report's `kv_offload` gives them."""
        return {"offloaded_pages": self.num_offloaded_pages, "restored_pages": self.num_restored_pages}

    def is_offloaded(self, request_id: str) -> bool:
        return request_id in self.offloaded

    def park(self, request_id: str) -> None:
        """The request will not run on this node again (its KV went to another rank, which drops
        it here once it runs there): a victim that stops nothing, so one started request may take
        its pages (the count rule of `victims` leaves it out). Without it, a prefill rank's pool
        full of requests waiting for their transfer started no new prompt."""
        self.parked.add(request_id)

    def victims(self, pool: PagePool, admission: Admission, step_ids: set[str], num_short: int,
                num_starts: int) -> list[str]:
        """Started requests whose pages, moved to the host, leave `num_short` more pages for the
        `num_starts` requests they would start; none unless fewer of them would run again here than
        that (parked requests go first and do not count). A move of as many running requests as it
        starts only swaps who runs and pays the copies both ways: under a steady overload the
        victims had run a step or two before (they missed only a prompt-only step), each came
        straight back, and the run took 1.27-1.40x as long as with no host pool; 1.15-1.17x with
        this rule, 0.91-0.92x once moved requests kept their place in the admission's order
        (`mstar bench offload`, docs/runtime.md "KV offload")."""
        candidates = [rid for rid in admission.budgets if rid not in step_ids and pool.num_pages_held(rid)]
        parked = self.parked
        candidates.sort(key=lambda rid: (rid not in parked, self.last_run.get(rid, 0), -pool.num_pages_held(rid)))
        chosen, room, freed = [], self.num_free_host_pages, 0
        for rid in candidates:
            if freed >= num_short:
                break
            held = pool.num_pages_held(rid)
            if held > room:
                continue
            # Moving it frees its pages but those another sequence shares (a prefix a waiting
            # request claimed: counted, a request moved out for nothing), and what its budget may
            # still claim.
            freed += pool.num_pages_freed_by(rid) + max(0, admission.budgets[rid] - admission.held[rid])
            room -= held
            chosen.append(rid)
        num_running = sum(rid not in parked for rid in chosen)
        return chosen if freed >= num_short and num_running < num_starts else []

    def move_out(self, pool: PagePool, admission: Admission, claimed: dict, step_ids: set[str],
                 needs: list[PageNeed], short: list[str],
                 copy_out: Optional[Callable[[list[int], list[int]], None]] = None) -> int:
        """Both engines' move of a step whose `short` rows lack pages: each of the `victims`' sequences
        recorded on host pages (`copy_out(device pages, host pages)` copies their contents where the
        engine holds any), its device pages freed, its admission released and its prefix claim
        dropped from `claimed`. The pages moved (0: nobody moved)."""
        num_short = admission.pages_short(needs, set(short), pool.num_free_pages)
        num_moved = 0
        for request_id in self.victims(pool, admission, step_ids, num_short, len(short)):
            sequences = pool.sequences_of(request_id)
            moved = self.take(request_id, [(label, num, len(table)) for label, num, table in sequences])
            if copy_out is not None:
                for (_, _, table), host in zip(sequences, moved):
                    copy_out(table, host.host_pages)
            num_moved += sum(len(table) for _, _, table in sequences)
            pool.free_request(request_id)
            admission.release(request_id, keep_place=True)
            claimed.pop(request_id, None)
        return num_moved

    def take(self, request_id: str, sequences: list[tuple[str, int, int]]) -> list[HostSequence]:
        """Host pages for each (label, tokens, device pages) of a victim, recorded as offloaded."""
        moved = []
        for label, num_tokens, num_pages in sequences:
            pages = [self._take() for _ in range(num_pages)]
            moved.append(HostSequence(label, num_tokens, pages))
            self.num_offloaded_pages += num_pages
        self.offloaded[request_id] = moved
        return moved

    def restore(self, request_id: str) -> list[HostSequence]:
        """The offloaded sequences of a request, its host pages given back (after the copy)."""
        moved = self.offloaded.pop(request_id)
        for seq in moved:
            self._free.give_back(reversed(seq.host_pages))
            self.num_restored_pages += len(seq.host_pages)
        return moved

    def forget(self, request_id: str) -> None:
        """The request ended: its host pages (if any) go back to the host pool."""
        if request_id in self.offloaded:
            for seq in self.offloaded.pop(request_id):
                self._free.give_back(reversed(seq.host_pages))
        self.last_run.pop(request_id, None)
        self.parked.discard(request_id)
