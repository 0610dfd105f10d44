"""Speculation bookkeeping of the run loop: step N+1 built while step N runs, and the rows it covers.

In: the plan's speculation switches and the per-rank schedulers. Out: `SpeculationCover`:

    speculate(rank, batch, continuing)  after step N (`batch`) launched: ask the scheduler for step
                                        N+1 of the rows whose loop goes on; its rows are covered
                                        (they do not come back ready after N)
    take(rank) -> (batch, continuing)   the pending step N+1 once N was post-processed; covered rows
                                        that did not come back (they stopped in N) are uncovered
    cancel(rank)                        step N had rows that got no memory: drop N+1 (its fresh rows
                                        go back to their queues; its continuing rows come back
                                        through the conductor or the hold)
    is_covered(rank, request_id, node, walk)  a ready row that N+1 already holds (uncovers it)
"""
from __future__ import annotations

from typing import Optional

from mstar.plan.schema import Plan
from mstar.runtime.scheduler.batch import Batch
from mstar.runtime.scheduler.scheduler import WorkerScheduler
from mstar.runtime.serve.steps import sub_batch


class SpeculationCover:
    def __init__(self, plan: Plan, schedulers: dict[int, WorkerScheduler]):
        self.schedulers = schedulers
        # A node the spec marks no_speculation (not is_async) never speculates, whatever a
        # speculation row says.
        is_async = {node.name: node.is_async for node in plan.nodes}
        self.walks = {(w.rank, s.node, s.walk) for w in plan.workers for s in w.speculation
                      if s.can_speculate and is_async.get(s.node, False)}
        self.pending: dict[int, tuple[Batch, set[str]]] = {}  # worker -> (speculative batch, continuing rows)
        self.covered: dict[int, set[tuple[str, str, str]]] = {w.rank: set() for w in plan.workers}

    @property
    def is_any_covered(self) -> bool:
        return any(self.covered.values())

    def speculate(self, rank: int, batch: Batch, continuing: list[str]) -> None:
        """continuing: rows of the batch whose loop has iterations left after this step."""
        if not continuing or not any((rank, batch.node, walk) in self.walks for walk in set(batch.walks)):
            return
        spec = self.schedulers[rank].speculate(batch, continuing)
        if spec is None:
            return
        in_spec = set(spec.request_ids)
        covered = {rid for rid in continuing if rid in in_spec}
        walk_of = dict(zip(spec.request_ids, spec.walks))
        for request_id in covered:
            self.covered[rank].add((request_id, batch.node, walk_of[request_id]))
        self.pending[rank] = (spec, covered)

    def take(self, rank: int) -> Optional[tuple[Batch, set[str]]]:
        found = self.pending.pop(rank, None)
        if found is not None:
            self._uncover(rank, *found)
        return found

    def cancel(self, rank: int) -> None:
        found = self.pending.pop(rank, None)
        if found is None:
            return
        spec, continuing = found
        self._uncover(rank, spec, continuing)
        fresh = sub_batch(spec, [rid not in continuing for rid in spec.request_ids])
        if fresh.num_rows:
            self.schedulers[rank].discard(fresh)

    def is_covered(self, rank: int, request_id: str, node: str, walk: str) -> bool:
        covered = self.covered[rank]
        if (request_id, node, walk) in covered:
            covered.discard((request_id, node, walk))
            return True
        return False

    def _uncover(self, rank: int, batch: Batch, request_ids: set[str]) -> None:
        covered = self.covered[rank]
        for request_id, walk in zip(batch.request_ids, batch.walks):
            if request_id in request_ids:
                covered.discard((request_id, batch.node, walk))
