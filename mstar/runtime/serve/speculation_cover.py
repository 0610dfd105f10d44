"""Speculation bookkeeping of the run loop: step N+1 built while step N runs, and the rows it covers.

In: the plan's speculation switches and the per-rank schedulers. Out: `SpeculationCover`:

    speculate(rank, batch, continuing, cut)  after step N (`batch`) launched: ask the scheduler for
                                        step N+1 of the rows whose loop goes on and of the prompt
                                        rows cut in N with chunks left (`cut`: request id, tokens
                                        left after N); its rows are covered (they do not come back
                                        ready after N: a cut row's rest is skipped once, as a
                                        continuing decode row is)
    take(rank) -> (batch, continuing)   the pending step N+1 once N was post-processed; covered rows
                                        that did not come back (they stopped in N) are uncovered
    cancel(rank)                        step N had rows that got no memory: drop N+1 (its fresh rows
                                        go back to their queues; its continuing rows come back
                                        through the conductor or the hold)
    uncovered(rank, node, walk, request_ids, num_tokens)  ready rows less those N+1 already holds
                                        (each covered row is skipped once, then uncovered)
"""
from __future__ import annotations

from itertools import compress
from operator import not_
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
        self.nodes = {(rank, node) for rank, node, _ in self.walks}  # (rank, node) pairs that chain at all
        self.pending: dict[int, tuple[Batch, set[str]]] = {}  # worker -> (speculative batch, continuing rows)
        # rank -> (node, walk) -> rows the pending step N+1 of that rank already runs
        self.covered: dict[int, dict[tuple[str, str], set[str]]] = {w.rank: {} for w in plan.workers}

    def speculate(self, rank: int, batch: Batch, continuing: list[str],
                  cut: Optional[list[tuple[str, int]]] = None) -> None:
        """continuing: rows of the batch whose loop has iterations left after this step; cut: its
        prompt rows with chunks left after it (request id, tokens left)."""
        # a chain of a looping walk, or of prompts cut with chunks left alone (speculation.py), on
        # a node that chains steps at all
        if cut and not continuing:
            if (rank, batch.node) not in self.nodes:
                return
        elif not continuing or not any((rank, batch.node, walk) in self.walks for walk in set(batch.walks)):
            return
        spec = self.schedulers[rank].speculate(batch, continuing, cut=cut or ())
        if spec is None:
            return
        covered = set(spec.request_ids).intersection(continuing)
        if cut:
            covered.update(request_id for request_id, _ in cut if request_id in spec.request_ids)
        rank_covered = self.covered[rank]
        walks = set(spec.walks)
        if len(walks) == 1:  # a chain of one walk (the common case): one set operation
            rank_covered.setdefault((batch.node, walks.pop()), set()).update(covered)
        else:
            walk_of = dict(zip(spec.request_ids, spec.walks))
            for request_id in covered:
                rank_covered.setdefault((batch.node, walk_of[request_id]), set()).add(request_id)
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

    def uncovered(self, rank: int, node: str, walk: str, request_ids: list[str],
                  num_tokens: list[int]) -> tuple[list[str], list[int]]:
        """The ready rows of (node, walk) for `rank` that N+1 does not already hold; the ones it
        holds are uncovered (a row is covered once)."""
        covered = self.covered[rank].get((node, walk))
        if not covered:
            return request_ids, num_tokens
        if covered.issuperset(request_ids):  # N+1 holds them all (a decode chain's rows)
            covered.difference_update(request_ids)
            return [], []
        hits = covered.intersection(request_ids)
        if not hits:
            return request_ids, num_tokens
        covered -= hits
        if len(hits) == len(request_ids):
            return [], []  # N+1 holds them all (a decode chain's rows)
        is_kept = list(map(not_, map(hits.__contains__, request_ids)))
        return list(compress(request_ids, is_kept)), list(compress(num_tokens, is_kept))

    def _uncover(self, rank: int, batch: Batch, request_ids: set[str]) -> None:
        covered = self.covered[rank]
        walks = set(batch.walks)
        if len(walks) == 1:
            # One walk (a decode chain, the common case): one set operation, no per-row Python.
            rows = covered.get((batch.node, walks.pop()))
            if rows is not None:
                rows.difference_update(request_ids)
            return
        for request_id, walk in zip(batch.request_ids, batch.walks):
            if request_id in request_ids:
                rows = covered.get((batch.node, walk))
                if rows is not None:
                    rows.discard(request_id)
