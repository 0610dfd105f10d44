"""The run loop: arrivals -> conductor -> per-worker schedulers -> engine -> conductor.

In: a plan, an engine (the `mstar.runtime.step.Engine` interface: caps, launch, wait), a
workload. Out: the conductor's request records and per-step metrics. The parts, one job each:
clock.py (run clock), routing.py (ranks of a (node, walk) per request), steps.py (batch -> step),
speculation_cover.py, lockstep.py (TP), outcome.py (allocation failures), this module (the loop).

Event loop (one process drives every worker of the plan):
- every idle worker takes its pending speculative batch, else `next_batch()`; the batch becomes
  a Step (steps.py: each row's inputs from the conductor; rows that went stale are left out),
  the engine launches it (`engine.launch(step)`), and its completion is queued at the run
  clock's finish time (clock.py: simulated engines jump the clock to start + elapsed; real
  engines: elapsed is wall time, so workers effectively take turns);
- between `launch` and `wait`, while step N runs, the worker asks its scheduler to speculate
  step N+1 of an on-device loop (speculation_cover.py: the rows whose loop has iterations left
  continue, and so do prompt rows cut in N with chunks left: each with its next chunk); those
  rows are not added back when N's results arrive, and rows of N+1 whose request stopped in N are
  left out of it. An engine that can (`caps.can_launch_ahead`, the GPU
  fast path) is told N+1's continuing rows at once (`launch_ahead`, with the next chunks of its
  cut prompt rows and the step's capture, token bucket and attention route when it has any) and
  starts N+1 on the device behind N, so N's post-processing and N+1's composition run while the
  device works;
- a completion is post-processed in one pass: each row result goes to the conductor, then the
  rows that became ready go to the schedulers of the ranks running them (routing.py);
- allocation_failed (outcome.py): with an engine that runs partial steps the rows that got
  memory are post-processed and only the failed rows are held; with an all-or-nothing engine
  the whole batch goes back. A step with failed rows is neither speculated on (its speculation
  is cancelled) nor followed by TP followers for its failed rows;
- TP groups (lockstep.py): the leader's batch is registered on its followers; the leader's
  results are post-processed only once every follower ran its copy;
- a step whose engine call raises fails the requests of that step alone, except `EngineLost`
  (a rank process is gone): it leaves `run`, and the caller fails what is left (`fail_active`).
  On a node of `EngineCaps.rerun_nodes` (outside TP groups) a failed step of several rows fails
  nothing yet: each row runs again in a step of its own, and only those whose own step raises
  fail (`_isolate`; docs/runtime.md "Failures and cancellation").
When nothing runs and nothing can, the clock jumps to the next arrival or hold deadline; if
requests remain with no way forward they fail with "error: stalled" (never a hang). Held rows
that keep failing to get memory while no row of any step runs for NO_PROGRESS_LIMIT_S (run
clock) fail the same way: a pool that never frees (a leak) cannot turn into an endless retry loop.

`decode` (token ids -> text, the run's tokenizer) lets the conductor end requests on stop strings.
`on_finish(request_ids)` is called with the ids of the requests that just ended (their records
are final), in the order they ended. `on_step(launch)` is called after each step's results were
applied (its requests' records hold the step's emissions): the per-step delivery path of an
online server. `log` takes one record per step (`StepLog` by default; a server passes a sink that
keeps counts instead of a list that grows). `stop()` (safe to call from a signal handler: it only
sets a flag) makes `run` return at the top of its next iteration, after the step being
post-processed: nothing more is admitted or launched, and requests not yet ended stay unfinished.

Where requests come from is a `Source` (`run(workload)` wraps a `Workload`; `run_source(source)`
takes any, such as the online server's inbox, serve/online.py): it submits what is due and
applies cancellations (`admit`), names the run-clock times it will have something
(`wake_times`), says whether more may come (`is_done`) or is scheduled for later
(`is_waiting`), and idles the loop (`idle(timeout)`: block until something arrives or the
timeout passes; None: no timeout). The loop idles in the source, never spinning, when nothing
runs and nothing can.
"""
from __future__ import annotations

import atexit
import dataclasses
import gc

import heapq
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Protocol, cast

from mstar.plan.schema import Plan
from mstar.runtime.conductor.conductor import Conductor
from mstar.runtime.conductor.request import Request
from mstar.runtime.conductor.batch_class import batch_classes
from mstar.runtime.scheduler.batch import Batch
from mstar.runtime.scheduler.scheduler import WorkerScheduler
from mstar.runtime.serve.clock import RunClock
from mstar.runtime.serve.collector import AutomaticPasses, PassesWhenBusy
from mstar.runtime.serve.lockstep import Lockstep
from mstar.runtime.serve.metrics import StepLog
from mstar.runtime.serve.outcome import ran_part, settle
from mstar.runtime.serve.routing import Routing, RoutingError
from mstar.runtime.serve.speculation_cover import SpeculationCover
from mstar.runtime.serve.steps import Launch, follower_step, recompose, sub_batch, to_step
from mstar.runtime.step import AheadChunks, Engine, EngineLost, LaunchesAhead, Step, StepResult, StepRow

# Held rows retried this long (run clock) while no row of any step ran: the memory they wait for
# is never coming back (an engine that leaks pages). Fail them rather than retry forever.
NO_PROGRESS_LIMIT_S = 30.0

DriverError = RoutingError  # the plan cannot be driven (a (node, walk) that no worker runs)


@dataclass
class Workload:
    """Requests with arrival times (open loop), or a closed loop of `concurrency` clients that
    each send their next request when the previous one finishes (arrival times ignored)."""

    requests: list[Request]
    closed_concurrency: Optional[int] = None
    cancellations: list[tuple[float, str]] = field(default_factory=list)  # (time, request id)


class Source(Protocol):
    """Where the run loop's requests come from (module docstring)."""

    def admit(self, conductor: Conductor, now: float) -> None:
        """Submit the requests due by `now` and apply the cancellations due."""

    def wake_times(self) -> list[float]:
        """Run-clock times at which a request or cancellation is due."""

    def is_done(self) -> bool:
        """Nothing more will arrive."""

    def is_waiting(self) -> bool:
        """Arrivals or cancellations are scheduled for later (a stalled run may yet move)."""

    def idle(self, timeout: Optional[float]) -> None:
        """Wait until something arrives or `timeout` seconds pass (None: no limit)."""


class _Arrivals:
    """A workload as a Source: what it has still to send, and how far it got."""

    def __init__(self, workload: Workload, origin: float):
        self.origin = origin
        self.pending = deque(sorted(workload.requests, key=lambda r: r.arrival_s))
        self.cancels = deque(sorted((origin + t, rid) for t, rid in workload.cancellations))
        self.closed = workload.closed_concurrency
        self.total = len(self.pending)
        self.num_sent = 0

    def admit(self, conductor: Conductor, now: float) -> None:
        """Submit the requests due by `now` (closed loop: up to the concurrency) and apply the
        cancellations due."""
        pending = self.pending
        if self.closed is not None:
            while pending and self.num_sent - conductor.num_finished < self.closed:
                conductor.submit(pending.popleft())
                self.num_sent += 1
        else:
            while pending and self.origin + pending[0].arrival_s <= now:
                request = pending.popleft()
                conductor.submit(request, self.origin + request.arrival_s)
                self.num_sent += 1
        while self.cancels and self.cancels[0][0] <= now:
            conductor.cancel(self.cancels.popleft()[1])

    def wake_times(self) -> list[float]:
        wake = []
        if self.closed is None and self.pending:
            wake.append(self.origin + self.pending[0].arrival_s)
        if self.cancels:
            wake.append(self.cancels[0][0])
        return wake

    def is_done(self) -> bool:
        return self.num_sent == self.total

    def is_waiting(self) -> bool:
        return bool((self.closed is None and self.pending) or self.cancels)

    def idle(self, timeout: Optional[float]) -> None:
        time.sleep(timeout or 0.0)


_is_start_up_frozen = False


def freeze_start_up() -> None:
    """Once a process: what exists when the first run starts (plan tables, models, the engine's
    buffers) lives for the whole run, so it is moved out of the collector's reach (`gc.freeze`) and
    its full passes stop scanning it. Measured with the sim engine at 64 rows (docs/runtime.md,
    "Decode lanes"): post-process mean 184 -> 104 us a step. Once, not per run: a process running
    many short runs (the tests) would pay a full collection each time. Unfrozen at exit: the
    interpreter's last collection skips frozen objects, and Triton's bindings (nanobind) then
    report every object of theirs still alive as a leak on stderr."""
    global _is_start_up_frozen
    if not _is_start_up_frozen:
        _is_start_up_frozen = True
        gc.collect()
        gc.freeze()
        atexit.register(gc.unfreeze)


def _said(error: BaseException) -> str:
    """An exception as a failed request's reason says it: its message, with its kind (a bare
    `RuntimeError()` said nothing after "engine failed the step: ")."""
    return f"{type(error).__name__}: {error}" if str(error) else type(error).__name__


class Driver:
    def __init__(self, plan: Plan, engine: Engine, *, clock: Optional[Callable[[], float]] = None,
                 on_finish: Optional[Callable[[list[str]], None]] = None,
                 decode: Optional[Callable[[list[int]], str]] = None,
                 on_step: Optional[Callable[[Launch], None]] = None, log: Any = None):
        self.plan = plan
        self.engine = engine
        self.caps = engine.caps
        self.clock = RunClock(self.caps, clock)
        # The conductor and schedulers read the underlying clock: one call less per read.
        # decode: the tokenizer's (token ids -> text), for requests with stop strings
        self.conductor = Conductor(plan, engine, self.clock.now, decode)
        self.schedulers = {w.rank: WorkerScheduler(w, plan.deployment, clock=self.clock.now) for w in plan.workers}
        self.on_finish = on_finish
        self.on_step = on_step
        self.is_stopped = False
        self.log = StepLog() if log is None else log
        self.origin_s = self._last_progress_s = self.clock()  # run clock at the start of `run`
        self.routing = Routing(plan)
        self.lockstep = Lockstep(plan, self.schedulers)
        self.cover = SpeculationCover(plan, self.schedulers)
        self._keys = {(w.rank, key.name): key for w in plan.workers for key in w.keys}
        # (node, walk) -> its batching rules (KeyPlan.batch_rules), for the pairs that have any
        self._rules = {(key.node, walk): tuple(rules) for w in plan.workers for key in w.keys
                       for walk, rules in key.batch_rules.items()}
        # (node, walk) pairs of keys whose captures are keyed by guidance mode: their rows come with
        # whether their requests require guidance (the scheduler's capture pick reads it)
        self._guidance_keyed = {(key.node, walk) for w in plan.workers for key in w.keys
                                if any(f.guidance != "any" for f in key.captures) for walk in key.walks}
        # (node, walk) pairs whose prompt rows a scheduler may cut into chunks
        self._cut_walks = {(key.node, walk) for w in plan.workers for key in w.keys for walk in key.chunk_sizes}
        # those whose key's budget counts a chunk's depth: their rows come with it (token_budget.py)
        self._depth_walks = {(key.node, walk) for w in plan.workers for key in w.keys if key.chunk_context_scale
                             for walk in key.chunk_sizes}
        self._busy: set[int] = set()
        self._inflight: list[tuple[float, int, Launch]] = []
        # Python's collector runs where the device is busy (AutomaticPasses: where it falls)
        self.collector: PassesWhenBusy | AutomaticPasses = PassesWhenBusy()
        self._collected_s = 0.0  # the collector's passes since the log's last step
        # on_finish's time inside a step's post-process (mstar run's outputs.jsonl and media
        # writes): the caller's, not the post-process's (`--out` doubled its p90)
        self._callback_s = 0.0
        self._seq = 0
        # rank -> the rows of its failed steps still to run again, one a step (`_isolate`)
        self._alone: dict[int, deque[Batch]] = {}

    # ------------------------------------------------------------ conductor outputs

    def _drain(self) -> None:
        """Rows the conductor made ready go to the schedulers of their ranks, one add_ready_many
        per (rank, node, walk) in the order they became ready; ended requests leave every
        scheduler; where memory came back (a request ended, or freed a node before its end) held
        rows try again."""
        conductor = self.conductor
        if conductor.ready_out:
            ready, conductor.ready_out = conductor.ready_out, []
            routing, cover = self.routing, self.cover
            groups: dict[tuple[int, str, str], tuple[list[str], list[int]]] = {}
            for node, walk, request_ids, num_tokens in ready:
                ranks = routing.single.get((node, walk))
                if ranks is not None:  # one instance runs it (the plan decided): the group as is
                    for rank in ranks:
                        _add(groups, (rank, node, walk), *cover.uncovered(rank, node, walk, request_ids, num_tokens))
                    continue
                for request_id, num in zip(request_ids, num_tokens):
                    for rank in routing.ranks(request_id, node, walk):
                        _add(groups, (rank, node, walk), *cover.uncovered(rank, node, walk, [request_id], [num]))
            for (rank, node, walk), (request_ids, num_tokens) in groups.items():
                rules = self._rules.get((node, walk))
                classes = None if rules is None else batch_classes(conductor, node, walk, request_ids,
                                                                   num_tokens, rules)
                guided = ([conductor.requires_guidance(rid, node) for rid in request_ids]
                          if (node, walk) in self._guidance_keyed else None)
                contexts = ([conductor.kv_context(rid, node) for rid in request_ids]
                            if (node, walk) in self._depth_walks else None)
                self.schedulers[rank].add_ready_many(request_ids, node, walk, num_tokens, classes, guided, contexts)
        ended: list[str] = []
        if conductor.ended_out:
            ended, conductor.ended_out = conductor.ended_out, []
            for request_id in ended:
                self.routing.forget(request_id)
                for scheduler in self.schedulers.values():
                    scheduler.remove(request_id)
        if ended or conductor.nodes_freed_out:  # pages came back: held rows try again
            conductor.nodes_freed_out = False
            for scheduler in self.schedulers.values():
                scheduler.wake_holds()
        if ended and self.on_finish is not None:
            began = time.perf_counter()
            self.on_finish(ended)
            self._callback_s += time.perf_counter() - began

    # ------------------------------------------------------------ steps

    def _next_batch(self, rank: int) -> tuple[Optional[Batch], set[str], bool]:
        """The worker's next batch, the rows a speculation already covers, and whether it is a row of
        a failed step run alone (`_isolate`): those first, then the speculated batch, else the
        scheduler's next."""
        alone = self._alone.get(rank)
        if alone:
            return alone.popleft(), set(), True
        spec = self.cover.take(rank)
        batch, continuing = spec if spec is not None else (self.schedulers[rank].next_batch(), set())
        return batch, continuing, False

    def _launch(self, rank: int) -> bool:
        """Start the worker's next step; False when it has none to run now."""
        started = time.perf_counter()
        batch, continuing, is_alone = self._next_batch(rank)
        sched_s = time.perf_counter() - started
        if batch is None:
            return False
        now = self.clock()
        if batch.is_follower:
            return self._launch_follower(rank, batch, now, sched_s)
        step, loop_rows, lane_rows = to_step(self.conductor, self._keys, rank, batch)
        if step is None:
            return True  # every row went stale; the worker looks again
        if is_alone:
            recompose(self._keys[(rank, step.key)], step, self.conductor.requires_guidance)
        try:
            launched = time.perf_counter()
            handle = self.engine.launch(step)
            # The host composes step N+1 while N runs (not after a row run alone: its step is its own).
            if not is_alone:
                self.cover.speculate(rank, batch, loop_rows, self._cut_rows(batch, step) if self._cut_walks else None)
            if self.caps.can_launch_ahead:
                self._launch_ahead(rank)
            waited = time.perf_counter()
            result = self.engine.wait(handle)
            done = time.perf_counter()
        except EngineLost:  # no step can run any more: the caller stops the run (fail_active)
            raise
        except Exception as error:  # the engine failed this step: its requests fail alone
            self._step_failed(rank, batch, step, error, is_alone)
            return True
        if result.allocation_failed:
            # Its rows come back through the conductor (ran) or the hold (failed), never a chain.
            self.cover.cancel(rank)
        ran_rows, followed = ran_part(batch, step, result, self.caps.runs_partial_steps)
        launch = Launch(rank, batch, step, result, now, sched_s, continuing, ran_rows, lane_rows,
                        waited - launched, done - waited)
        if followed is not None:
            # Every rank of a TP group fails the same allocation, so failed rows are not
            # followed: the followers keep them ready for the retry.
            self.lockstep.follow(launch, followed)
        self._start(launch)
        return True

    def _cut_rows(self, batch: Batch, step: Step) -> Optional[list[tuple[str, int]]]:
        """The step's prompt rows cut with chunks left after it: (request id, tokens left); None
        when the step has no row of a walk that is cut."""
        node, cut_walks = step.node, self._cut_walks
        if not any((node, walk) in cut_walks for walk in set(batch.walks)):
            return None
        # handle: the row's ActiveCall (conductor), whose num_tokens is the whole prompt's
        return [(row.request_id, row.handle.num_tokens - row.chunk_start - row.num_tokens)
                for row in step.rows if row.is_partial]

    def _launch_ahead(self, rank: int) -> None:
        """The engine may start the speculated step N+1 now, on the device behind step N: its
        continuing rows (the ones whose inputs step N makes on the device) and its cut prompt rows
        (their next chunks' tokens are known on the host), with the step's shape."""
        found = self.cover.pending.get(rank)
        if found is None:
            return
        spec, continuing = found
        rows = [(request_id, walk) for request_id, walk in zip(spec.request_ids, spec.walks)
                if request_id in continuing]
        if not rows:
            return
        chunks = None
        if spec.walks and any((spec.node, walk) in self._cut_walks for walk in set(spec.walks)):
            cut = {request_id: num for request_id, walk, num in zip(spec.request_ids, spec.walks, spec.num_tokens)
                   if request_id in continuing and (spec.node, walk) in self._cut_walks}
            fresh = self._fresh_prompt_rows(spec, continuing)
            if cut or fresh:
                chunks = AheadChunks(spec.key, spec.capture, spec.token_bucket, spec.attention, cut, fresh)
                rows.extend((row.request_id, row.walk) for row in fresh)
        cast(LaunchesAhead, self.engine).launch_ahead(rank, spec.node, rows, chunks)

    def _fresh_prompt_rows(self, spec: Batch, continuing: set[str]) -> list[StepRow]:
        """The speculated step's rows new to it (not rows of the step launched last) of walks the
        plan cuts, outside loops: a prompt that arrived while that step ran. Launched ahead with
        the continuing rows, its first chunk shares their step; left to the real launch, it ran in
        a launch of its own after theirs, a whole extra step between two of the decode rows' tokens
        (docs/runtime.md, "A prompt arriving beside a decode chain")."""
        is_new = [request_id not in continuing and (spec.node, walk) in self._cut_walks
                  for request_id, walk in zip(spec.request_ids, spec.walks)]
        if not any(is_new):
            return []
        new = sub_batch(spec, is_new)
        rows, _, _ = self.conductor.build_step(new.node, new.request_ids, new.walks, new.num_tokens)
        return [row for row in rows if not row.loop_count]

    def _launch_follower(self, rank: int, batch: Batch, now: float, sched_s: float) -> bool:
        result = StepResult(rows=[])
        if self.caps.can_run_followers:
            try:
                result = self.engine.wait(self.engine.launch(follower_step(rank, batch)))
            except EngineLost:
                raise
            except Exception as error:  # the group's step failed on this rank: its requests fail alone
                self._fail_step(rank, batch.request_ids, f"engine failed the step on rank {rank}: {_said(error)}")
        # started either way: the leader waits for every follower's copy (lockstep), and its rows
        # of requests failed here are left out when it settles
        self._start(Launch(rank, batch, None, result, now, sched_s))
        return True

    def _step_failed(self, rank: int, batch: Batch, step: Step, error: Exception, is_alone: bool) -> None:
        """The engine raised in `step`: on a node whose failed steps may run again
        (`EngineCaps.rerun_nodes`), a step of several rows outside a TP group fails no request yet
        (`_isolate`); else, or for a row that ran alone, its requests fail."""
        if (not is_alone and len(step.rows) > 1 and step.node in self.caps.rerun_nodes
                and (rank, step.node) not in self.lockstep.followers):
            self._isolate(rank, batch, step)
            return
        self._fail_step(rank, [row.request_id for row in step.rows], f"engine failed the step: {_said(error)}")

    def _isolate(self, rank: int, batch: Batch, step: Step) -> None:
        """A failed step of several rows: each row runs again in a step of its own, eagerly, before
        the worker's next batch (`_next_batch`), and only a row whose own step raises fails its
        request; the others go on as if the step had not failed (the engine left them as before it).
        The step speculated after it is dropped, as when its requests fail."""
        self.cover.cancel(rank)
        alone = self._alone.setdefault(rank, deque())
        ids = batch.request_ids
        for row in step.rows:
            one = sub_batch(batch, [request_id == row.request_id for request_id in ids])
            alone.append(dataclasses.replace(one, capture=None, padded_batch=0, token_bucket=0, is_speculative=False))

    def _fail_step(self, rank: int, request_ids: list[str], reason: str) -> None:
        """A step the engine failed, or whose results could not be applied: its requests end with
        `reason` (the others go on), and the step speculated after it is dropped."""
        self.cover.cancel(rank)
        for request_id in dict.fromkeys(request_ids):
            self.conductor.fail(request_id, f"error: {reason}")
        self._drain()

    def _start(self, launch: Launch) -> None:
        self._busy.add(launch.worker)
        self._seq += 1
        finish = self.clock.finish_time(launch.start_s, launch.result.elapsed_s)
        heapq.heappush(self._inflight, (finish, self._seq, launch))

    # ------------------------------------------------------------ completions

    def _complete(self, launch: Launch) -> None:
        if launch.step is None:  # a TP follower ran its leader's batch
            self._busy.discard(launch.worker)
            self.log.add(launch, 0.0, self.clock())
            leader = self.lockstep.follower_ran(launch.worker, launch.batch.node)
            if leader is not None:
                self._postprocess(leader)
        elif self.lockstep.leader_ran(launch):
            self._postprocess(launch)
        # else lockstep: the leader stays busy until every follower ran its copy.

    def _postprocess(self, launch: Launch) -> None:
        started = time.perf_counter()
        self._callback_s = 0.0
        self._busy.discard(launch.worker)
        assert launch.step is not None
        if len(launch.result.allocation_failed) < len(launch.step.rows):
            self._last_progress_s = self.clock()
        try:
            settle(self.schedulers[launch.worker], self.conductor, launch, self.caps.runs_partial_steps)
        except EngineLost:
            raise
        except Exception as error:  # an answer the conductor cannot apply (a bad stop row): the run went down with it
            self._fail_step(launch.worker, [row.request_id for row in launch.step.rows],
                            f"the step's results could not be applied: {_said(error)}")
        self._drain()
        self.log.add(launch, time.perf_counter() - started - self._callback_s, self.clock(), self._collected_s)
        self._collected_s = 0.0
        if self.on_step is not None:
            self.conductor.sync_lanes()  # the records hold the step's tokens for the callback
            self.on_step(launch)

    # ------------------------------------------------------------ main loop

    def stop(self) -> None:
        """Make `run` return soon (see the module docstring); only sets a flag."""
        self.is_stopped = True

    def fail_active(self, reason: str) -> None:
        """The engine was lost (`EngineLost`): every request still in the run fails with
        `reason`, so none is lost from the records."""
        for request_id in list(self.conductor.active):
            self.conductor.fail(request_id, f"error: {reason}")
        self._drain()

    def run(self, workload: Workload) -> None:
        """Run every request of the workload to completion (or failure). Arrival and
        cancellation times are seconds from the start of the run (`origin_s` on the run clock)."""
        # Before the origin: the first run's collection would otherwise delay every arrival of
        # the workload against its schedule (by 0.1-0.2 s with a spec-size model).
        freeze_start_up()
        origin = self.origin_s = self._last_progress_s = self.clock()
        self.run_source(_Arrivals(workload, origin))

    def run_source(self, source: Source) -> None:
        """Run until the source is done and every request it sent has ended (or `stop()`)."""
        freeze_start_up()
        try:
            with self.collector:
                self._loop(source)
        finally:
            self.conductor.sync_lanes()  # the records of requests not ended hold their tokens so far

    def _loop(self, source: Source) -> None:
        while not self.is_stopped:
            now = self.clock()
            source.admit(self.conductor, now)
            self._drain()
            for rank in self.schedulers:
                if rank not in self._busy:
                    while self._launch(rank) and rank not in self._busy:
                        pass
            wake = self._wake_times(source)
            if self._inflight:
                # before waiting for the step in flight: the device is busy, a collection costs it nothing
                self._collect()
                self._complete_next(source, wake, now)
                continue
            if self.conductor.is_idle():
                if source.is_done():
                    return
                if not wake:  # nothing in flight and nothing due: wait for an arrival
                    self._collect()
                    source.idle(None)
                    continue
            if not wake:
                if not self._release_or_fail_stalled(source):
                    return
                continue
            if self._fail_if_no_progress(source, now):
                continue
            self._collect()
            self.clock.sleep_until(min(wake), now, source.idle)

    def _collect(self) -> None:
        """The collector's due pass (`collector.py`), its host seconds added to the next step the
        log records (`StepLog.gc_s`): a pass longer than the work queued on the device shows as
        that step's gap."""
        started = time.perf_counter()
        if self.collector.collect_if_due() >= 0:
            self._collected_s += time.perf_counter() - started

    def _wake_times(self, source: Source) -> list[float]:
        """Run-clock times at which something may become runnable: hold expiries, the next
        arrival (open loop) and the next cancellation."""
        wake = [t for t in (s.next_hold_deadline() for s in self.schedulers.values()) if t is not None]
        wake.extend(source.wake_times())
        return wake

    def _complete_next(self, source: Source, wake: list[float], now: float) -> None:
        """Complete the earliest step in flight; an arrival or cancellation before its finish
        happens first. On a simulated clock the clock jumps to it (idle workers may start then);
        on a wall clock the engine already waited for the step, so what arrived meanwhile is
        admitted now, before the step's results are applied: the schedulers then see those
        requests' rows ahead of the rows the step makes ready, as they would on a simulated
        clock (else an online server's first steps differ from `mstar run`'s on the same
        arrivals: docs/serve.md)."""
        finish = self._inflight[0][0]
        early = [t for t in wake if now < t < finish]
        if self.clock.can_jump_ahead and early:
            self.clock.advance_to(min(early))
            return
        _, _, launch = heapq.heappop(self._inflight)
        self.clock.advance_to(finish)
        if not self.clock.can_jump_ahead:
            source.admit(self.conductor, self.clock())
            self._drain()
        self._complete(launch)

    def _release_or_fail_stalled(self, source: Source) -> bool:
        """Nothing runs and nothing will wake: release leaders whose followers will never run,
        else fail the requests left (never a hang). False when the run is over."""
        leaders = self.lockstep.release_all()
        if leaders:
            for leader in leaders:
                self._postprocess(leader)
            return True
        if not self.conductor.active and source.is_done():
            return False
        for request_id in list(self.conductor.active):
            self.conductor.fail(request_id, "error: stalled: no row of the request can run")
        self._drain()
        return True

    def _fail_if_no_progress(self, source: Source, now: float) -> bool:
        """Held rows retried for NO_PROGRESS_LIMIT_S while no row of any step ran: the memory
        they wait for is never freed. Fail the requests left; True when it did."""
        if (source.is_waiting() or now - self._last_progress_s <= NO_PROGRESS_LIMIT_S
                or not self.conductor.active):
            return False
        for request_id in list(self.conductor.active):
            self.conductor.fail(request_id, f"error: stalled: its rows were held for memory and "
                                            f"retried for {NO_PROGRESS_LIMIT_S:.0f} s while no step "
                                            "made progress (the memory is never freed)")
        self._drain()
        return True


def _add(groups: dict, key: tuple[int, str, str], request_ids: list[str], num_tokens: list[int]) -> None:
    """Append ready rows to the (rank, node, walk) group."""
    if not request_ids:
        return
    group = groups.get(key)
    if group is None:
        groups[key] = (list(request_ids), list(num_tokens))
    else:
        group[0].extend(request_ids)
        group[1].extend(num_tokens)
