"""The run loop: arrivals -> conductor -> per-worker schedulers -> engine -> conductor.

In: a plan, an engine, a workload. Out: the conductor's request records and per-step metrics.

Event loop (one process drives every worker of the plan):
- every idle worker takes its pending speculative batch, else `next_batch()`; the batch becomes
  a Step (each row's inputs from the conductor; rows that went stale are left out), the engine
  runs it, and its completion is queued at start + elapsed (simulated engines: the SimClock
  then jumps to it; real engines: elapsed is wall time, so workers effectively take turns);
- right after a step of an on-device loop starts, the worker asks its scheduler to speculate
  step N+1 (the rows whose loop has iterations left continue); those rows are not added back
  when N's results arrive, and rows of N+1 whose request stopped in N are left out of it;
- a completion is post-processed in one pass: each row result goes to the conductor, then the
  rows that became ready go to the schedulers of the ranks running them (a TP group: all its
  ranks; data-parallel replicas: one per request by a hash of its id);
- allocation_failed, with an engine that runs partial steps (`runs_partial_steps`, the
  default of the torch and simulated engines): the rows that got memory ran and are
  post-processed as usual; only the failed rows are held (scheduler.hold on a batch of just
  those rows: 50 ms backoff, then back to their queue) and retried. With an all-or-nothing
  engine nothing of the step ran: the whole batch goes back, the failed rows held. Either way
  nothing is lost or run twice; rows the engine failed alone still fail; a step with failed
  rows is neither speculated on nor followed by TP followers for its failed rows;
- TP groups: the leader's batch is registered on its followers; the leader's results are
  post-processed only once every follower ran its copy (lockstep);
- a step whose engine call raises fails the requests of that step alone.
When nothing runs and nothing can, the clock jumps to the next arrival or hold deadline; if
requests remain with no way forward they fail with "error: stalled" (never a hang). Held rows
that keep failing to get memory while no row of any step runs for NO_PROGRESS_LIMIT_S (run
clock) fail the same way: a pool that never frees (a leak) cannot turn into an endless retry loop.
"""
from __future__ import annotations

import dataclasses
import heapq
import time
import zlib
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Optional

from mstar.plan.schema import Plan
from mstar.runtime.scheduler.batch import Batch
from mstar.runtime.conductor.conductor import Conductor
from mstar.runtime.serve.metrics import StepLog
from mstar.runtime.conductor.request import Request
from mstar.runtime.scheduler.scheduler import WorkerScheduler
from mstar.runtime.step import Engine, Step, StepResult, StepRow


MIN_WAIT_S = 1e-4  # shortest idle wait when nothing can run yet
# Held rows retried this long (run clock) while no row of any step ran: the memory they wait for
# is never coming back (an engine that leaks pages). Fail them rather than retry forever.
NO_PROGRESS_LIMIT_S = 30.0


class DriverError(Exception):
    """The plan cannot be driven (a (node, walk) that no worker runs)."""


@dataclass
class Workload:
    """Requests with arrival times (open loop), or a closed loop of `concurrency` clients that
    each send their next request when the previous one finishes (arrival times ignored)."""

    requests: list[Request]
    closed_concurrency: Optional[int] = None
    cancellations: list[tuple[float, str]] = field(default_factory=list)  # (time, request id)


@dataclass
class _Launch:
    worker: int
    batch: Batch
    step: Optional[Step]
    result: StepResult
    start_s: float
    sched_s: float
    continuing: set[str] = field(default_factory=set)  # rows a speculation already covers
    ran_rows: list[StepRow] = field(default_factory=list)  # rows of the step the engine ran


class Driver:
    def __init__(
        self,
        plan: Plan,
        engine: Engine,
        *,
        clock: Optional[Callable[[], float]] = None,
        on_finish: Optional[Callable[[int], None]] = None,
    ):
        self.plan = plan
        self.engine = engine
        self.is_simulated = bool(getattr(engine, "is_simulated", False))
        # An engine that runs the rows that got memory beside allocation_failed ones.
        self.runs_partial_steps = bool(getattr(engine, "runs_partial_steps", False))
        if clock is None:
            clock = getattr(engine, "clock", None) or time.monotonic
        self.clock = clock
        self.conductor = Conductor(plan, engine, clock)
        self.schedulers = {w.rank: WorkerScheduler(w, plan.deployment, clock=clock) for w in plan.workers}
        self.on_finish = on_finish
        self.log = StepLog()
        self.origin_s = self.clock()  # run clock at the start of `run`: times are relative to it
        self._instances = self._placement_instances()
        # (node, walk) -> ranks, for pairs one instance runs (most of them): no per-row choice.
        self._single_instance = {pair: found[0] for pair, found in self._instances.items() if len(found) == 1}
        self._followers: dict[tuple[int, str], list[int]] = {}  # (leader rank, node) -> follower ranks
        for worker in plan.workers:
            for group in worker.tp_groups:
                if group.leader == worker.rank:
                    self._followers[(worker.rank, group.node)] = [r for r in group.ranks if r != worker.rank]
        self._spec_walks = {
            (w.rank, s.node, s.walk) for w in plan.workers for s in w.speculation if s.can_speculate
        }
        self._keys = {(w.rank, key.name): key for w in plan.workers for key in w.keys}
        self._busy: set[int] = set()
        self._spec: dict[int, tuple[Batch, set[str]]] = {}  # worker -> (speculative batch, continuing rows)
        self._covered: dict[int, set[tuple[str, str, str]]] = {w.rank: set() for w in plan.workers}
        self._inflight: list[tuple[float, int, _Launch]] = []
        self._seq = 0
        self._pending_tp: dict[tuple[int, str], deque] = {}  # (follower, node) -> leader launches
        self._tp_waiting: dict[int, set[int]] = {}  # id(leader launch) -> followers still to run
        self._tp_done_leaders: dict[int, _Launch] = {}

    # ------------------------------------------------------------ placement

    def _placement_instances(self) -> dict[tuple[str, str], list[tuple[int, ...]]]:
        """(node, walk) -> instances that run it: a TP group's ranks (leader first) or one rank."""
        instances: dict[tuple[str, str], list[tuple[int, ...]]] = {}
        for worker in self.plan.workers:
            for placement in worker.placements:
                node, walk = placement.split("/", 1)
                group = next((g for g in worker.tp_groups if g.node == node and walk in g.walks), None)
                if group is None:
                    instance: tuple[int, ...] = (worker.rank,)
                else:
                    instance = (group.leader,) + tuple(r for r in group.ranks if r != group.leader)
                found = instances.setdefault((node, walk), [])
                if instance not in found:
                    found.append(instance)
        return instances

    def _ranks_for(self, request_id: str, node: str, walk: str) -> tuple[int, ...]:
        instances = self._instances.get((node, walk))
        if not instances:
            raise DriverError(f"the plan places no worker for {node}/{walk}; recompile the plan")
        if len(instances) == 1:
            return instances[0]
        return instances[zlib.crc32(request_id.encode()) % len(instances)]

    # ------------------------------------------------------------ conductor outputs

    def _drain(self) -> None:
        conductor = self.conductor
        if conductor.ready_out:
            ready, conductor.ready_out = conductor.ready_out, []
            # One add_ready_many per (rank, node, walk), rows in the order they became ready.
            # A (node, walk) run by one instance (the plan decided it) needs no per-row hash.
            single = self._single_instance
            is_any_covered = any(self._covered.values())
            groups: dict[tuple[int, str, str], tuple[list[str], list[int]]] = {}
            for request_id, node, walk, num_tokens in ready:
                ranks = single.get((node, walk)) or self._ranks_for(request_id, node, walk)
                for rank in ranks:
                    if is_any_covered:
                        covered = self._covered[rank]
                        if (request_id, node, walk) in covered:
                            covered.discard((request_id, node, walk))
                            continue
                    group = groups.get((rank, node, walk))
                    if group is None:
                        group = groups[(rank, node, walk)] = ([], [])
                    group[0].append(request_id)
                    group[1].append(num_tokens)
            for (rank, node, walk), (request_ids, num_tokens) in groups.items():
                self.schedulers[rank].add_ready_many(request_ids, node, walk, num_tokens)
        if conductor.ended_out:
            ended, conductor.ended_out = conductor.ended_out, []
            for request_id in ended:
                for scheduler in self.schedulers.values():
                    scheduler.remove(request_id)
            if self.on_finish is not None:
                self.on_finish(len(ended))

    # ------------------------------------------------------------ steps

    def _to_step(self, rank: int, batch: Batch) -> tuple[Optional[Step], list[str]]:
        """The batch as a Step (stale rows left out; None when none is left), and the rows
        whose loop goes on after this step."""
        rows, continuing = self.conductor.step_rows(batch.node, batch.request_ids, batch.walks)
        if not rows:
            return None, continuing
        step = Step(
            worker=rank, key=batch.key, node=batch.node, mask=batch.mask, label=batch.label, rows=rows,
            attention=batch.attention, capture=batch.capture, padded_batch=batch.padded_batch,
            token_bucket=batch.token_bucket, is_speculative=batch.is_speculative,
        )
        if len(rows) != batch.num_rows:
            self._recompose(rank, step)
        return step, continuing

    def _recompose(self, rank: int, step: Step) -> None:
        """Stale rows were left out: when that removed a walk from the step, take the mixture
        entry of the walks left and run eagerly (the batch's capture no longer applies)."""
        key = self._keys[(rank, step.key)]
        mask = 0
        for row in step.rows:
            mask |= 1 << key.walks.index(row.walk)
        if mask == step.mask:
            return  # same walks, fewer rows: the padded bucket still holds them
        entry = next(e for e in key.mixtures if e.mask == mask)
        step.mask, step.label, step.attention = mask, entry.label, entry.attention
        step.capture, step.padded_batch, step.token_bucket = None, 0, 0

    def _launch(self, rank: int) -> bool:
        scheduler = self.schedulers[rank]
        started = time.perf_counter()
        spec = self._spec.pop(rank, None)
        continuing: set[str] = set()
        if spec is not None:
            batch, continuing = spec
            # N was post-processed: covered rows that did not come back stopped in N.
            self._uncover(rank, batch, continuing)
        else:
            batch = scheduler.next_batch()
        sched_s = time.perf_counter() - started
        if batch is None:
            return False
        now = self.clock()
        if batch.is_follower:
            return self._launch_follower(rank, batch, now, sched_s)
        step, loop_rows = self._to_step(rank, batch)
        if step is None:
            return True  # every row went stale; the worker looks again
        try:
            result = self.engine.run_step(step)
        except Exception as error:  # the engine failed this step: its requests fail alone
            for row in step.rows:
                self.conductor.fail(row.request_id, f"error: engine failed the step: {error}")
            self._drain()
            return True
        failed = result.allocation_failed
        if not failed:
            ran_rows, followed = step.rows, batch
        elif self.runs_partial_steps:
            failed_set = set(failed)
            ran_rows = [row for row in step.rows if row.request_id not in failed_set]
            followed = _sub_batch(batch, [rid not in failed_set for rid in batch.request_ids]) if ran_rows else None
        else:
            ran_rows, followed = [], None
        launch = _Launch(rank, batch, step, result, now, sched_s, continuing, ran_rows)
        if followed is not None:
            # Every rank of a TP group fails the same allocation, so failed rows are not
            # followed: the followers keep them ready for the retry.
            for follower in self._followers.get((rank, batch.node), ()):
                self.schedulers[follower].register_follow(followed)
                self._pending_tp.setdefault((follower, batch.node), deque()).append(launch)
                self._tp_waiting.setdefault(id(launch), set()).add(follower)
        if not failed:
            # A step with failed rows is not speculated on: its rows come back through the
            # conductor (ran) or the hold (failed), never through a chain.
            self._maybe_speculate(rank, batch, loop_rows)
        self._busy.add(rank)
        self._seq += 1
        finish = now + result.elapsed_s if self.is_simulated else self.clock()
        heapq.heappush(self._inflight, (finish, self._seq, launch))
        return True

    def _launch_follower(self, rank: int, batch: Batch, now: float, sched_s: float) -> bool:
        result = StepResult(rows=[])
        if getattr(self.engine, "can_run_followers", False):
            step = Step(
                worker=rank, key=batch.key, node=batch.node, mask=batch.mask, label=batch.label,
                rows=[], attention=batch.attention, capture=batch.capture,
                padded_batch=batch.padded_batch, token_bucket=batch.token_bucket,
            )
            result = StepResult(rows=[], elapsed_s=self.engine.step_time(step))
        launch = _Launch(rank, batch, None, result, now, sched_s)
        self._busy.add(rank)
        self._seq += 1
        finish = now + result.elapsed_s if self.is_simulated else self.clock()
        heapq.heappush(self._inflight, (finish, self._seq, launch))
        return True

    def _maybe_speculate(self, rank: int, batch: Batch, continuing: list[str]) -> None:
        """continuing: rows of the batch whose loop has iterations left after this step."""
        if not continuing:
            return
        if not any((rank, batch.node, walk) in self._spec_walks for walk in set(batch.walks)):
            return
        spec = self.schedulers[rank].speculate(batch, continuing)
        if spec is None:
            return
        in_spec = set(spec.request_ids)
        covered = {rid for rid in continuing if rid in in_spec}
        walk_of = dict(zip(spec.request_ids, spec.walks))
        for request_id in covered:
            self._covered[rank].add((request_id, batch.node, walk_of[request_id]))
        self._spec[rank] = (spec, covered)

    # ------------------------------------------------------------ completions

    def _complete(self, launch: _Launch) -> None:
        rank = launch.worker
        if launch.step is None:  # a TP follower ran its leader's batch
            self._busy.discard(rank)
            self.log.add(launch, 0.0, self.clock())
            queue = self._pending_tp.get((rank, launch.batch.node))
            leader = queue.popleft() if queue else None
            if leader is not None:
                waiting = self._tp_waiting[id(leader)]
                waiting.discard(rank)
                if not waiting and id(leader) in self._tp_done_leaders:
                    del self._tp_waiting[id(leader)]
                    self._postprocess(self._tp_done_leaders.pop(id(leader)))
            return
        if self._tp_waiting.get(id(launch)):
            # Lockstep: the leader stays busy until every follower ran its copy.
            self._tp_done_leaders[id(launch)] = launch
            return
        self._tp_waiting.pop(id(launch), None)
        self._postprocess(launch)

    def _uncover(self, rank: int, batch: Batch, request_ids: set[str]) -> None:
        covered = self._covered[rank]
        for request_id, walk in zip(batch.request_ids, batch.walks):
            if request_id in request_ids:
                covered.discard((request_id, batch.node, walk))

    def _postprocess(self, launch: _Launch) -> None:
        started = time.perf_counter()
        rank, batch, step, result = launch.worker, launch.batch, launch.step, launch.result
        self._busy.discard(rank)
        scheduler = self.schedulers[rank]
        failed = result.allocation_failed
        if len(failed) < len(step.rows):
            self._last_progress_s = self.clock()
        if not failed:
            self.conductor.on_step(step.node, step.rows, result.rows)
        elif self.runs_partial_steps:
            # Only the failed rows are held; the rows that ran come back through the conductor.
            failed_set = set(failed)
            scheduler.hold(_sub_batch(batch, [rid in failed_set for rid in batch.request_ids]))
            self.conductor.on_step(step.node, launch.ran_rows, result.rows)
        else:
            scheduler.hold(batch, failed)  # nothing ran: every row goes back, the failed ones held
            for row_result in result.rows:  # rows that failed alone still fail (nothing else ran)
                if row_result.error is not None:
                    self.conductor.fail(row_result.request_id, f"error: {row_result.error}")
        self._drain()
        end = self.clock()
        self.log.add(launch, time.perf_counter() - started, end)

    # ------------------------------------------------------------ main loop

    def run(self, workload: Workload) -> None:
        """Run every request of the workload to completion (or failure). Arrival and
        cancellation times are seconds from the start of the run (`origin_s` on the run clock)."""
        origin = self.origin_s = self._last_progress_s = self.clock()
        pending = deque(sorted(workload.requests, key=lambda r: r.arrival_s))
        cancels = deque(sorted((origin + t, rid) for t, rid in workload.cancellations))
        closed = workload.closed_concurrency
        num_sent = 0
        total = len(pending)
        while True:
            now = self.clock()
            if closed is not None:
                while pending and num_sent - self.conductor.num_finished < closed:
                    self.conductor.submit(pending.popleft())
                    num_sent += 1
            else:
                while pending and origin + pending[0].arrival_s <= now:
                    self.conductor.submit(pending.popleft())
                    num_sent += 1
            while cancels and cancels[0][0] <= now:
                self.conductor.cancel(cancels.popleft()[1])
            self._drain()
            for rank in self.schedulers:
                if rank not in self._busy:
                    while self._launch(rank) and rank not in self._busy:
                        pass
            wake = [t for t in (s.next_hold_deadline() for s in self.schedulers.values()) if t is not None]
            if closed is None and pending:
                wake.append(origin + pending[0].arrival_s)
            if cancels:
                wake.append(cancels[0][0])
            if self._inflight:
                finish = self._inflight[0][0]
                # Simulated time: an arrival, cancellation or hold expiry before the next
                # completion happens first (idle workers may start then).
                early = [t for t in wake if now < t < finish]
                if self.is_simulated and early:
                    self.clock.advance_to(min(early))
                    continue
                _, _, launch = heapq.heappop(self._inflight)
                if self.is_simulated:
                    self.clock.advance_to(finish)
                self._complete(launch)
                continue
            if num_sent == total and self.conductor.is_idle():
                return
            if not wake:
                if self._tp_done_leaders:  # followers that will never run: release the leaders
                    self._tp_waiting.clear()
                    self._pending_tp.clear()
                    for leader in list(self._tp_done_leaders.values()):
                        self._postprocess(leader)
                    self._tp_done_leaders.clear()
                    continue
                if not self.conductor.active and not pending:
                    return
                for request_id in list(self.conductor.active):
                    self.conductor.fail(request_id, "error: stalled: no row of the request can run")
                self._drain()
                continue
            if ((closed is not None or not pending) and not cancels
                    and now - self._last_progress_s > NO_PROGRESS_LIMIT_S
                    and self.conductor.active):
                for request_id in list(self.conductor.active):
                    self.conductor.fail(request_id, f"error: stalled: its rows were held for memory and "
                                                    f"retried for {NO_PROGRESS_LIMIT_S:.0f} s while no step "
                                                    "made progress (the memory is never freed)")
                self._drain()
                continue
            self._sleep_until(min(wake), now)

    def _sleep_until(self, when: float, now: float) -> None:
        # A deadline already past that released nothing: move on a little rather than spin.
        when = max(when, now + MIN_WAIT_S)
        if self.is_simulated:
            self.clock.advance_to(when)
        else:
            time.sleep(max(0.0, when - self.clock()))


def _sub_batch(batch: Batch, is_kept: list[bool]) -> Batch:
    """The rows of `batch` flagged in `is_kept` (per row, in order), as a batch of the same step."""
    return dataclasses.replace(
        batch,
        request_ids=[rid for rid, keep in zip(batch.request_ids, is_kept) if keep],
        walks=[walk for walk, keep in zip(batch.walks, is_kept) if keep],
        num_tokens=[num for num, keep in zip(batch.num_tokens, is_kept) if keep],
    )
