"""The conductor: requests through their partitions' walks (reference notes 0.4).

In: requests (`submit`), step results (`on_step`), failures and cancellations. Out, drained by the
driver after each call: `ready_out` rows (request id, node, walk, num_tokens) to put on the
schedulers of the ranks that run them, `ended_out` request ids whose engine resources and
scheduler rows must be freed, and `nodes_freed_out` (a request's memory on a node was freed before
its end, `_end_nodes`: rows held for memory may try again). It never touches workers, schedulers
or tensors itself.

- Admission: at most deployment.max_concurrent_requests at once, the rest wait FIFO. The engine
  may refuse a request (`add_request` returns a reason, e.g. it can never fit): it fails alone.
- Each partition runs its route's walks stage by stage (`PartitionState`); a stream-consumer
  partition (no initial walk) starts a run whenever a chunk is ready, and is done once its
  streams are exhausted; a partition whose walk waits on a stream that will never deliver ends.
- Token counting: every value a row produced under one of its call's `counted` outputs (the
  partition's count_tokens edges, or without any its text edges to the client: the compiler
  decides) adds its element count; at max_tokens the partition ends ("length") where anything
  after could count more (`PartitionState.may_count_more`: not after a walk's one counting call,
  nor after a stop token ending the one loop around its one counting call, when the route's later stages
  count nothing: BAGEL's prefill_text before image_gen; a stop token as the max_tokens-th ends "stop";
  not on a repeating partition, Whisper's). A stop token a counting call samples outside loops (the
  prefill's first token) ends the partition ("stop") where anything after could count
  (`PartitionState.stops_outside_loops`).
- Prefix cache: when a call of a walk the plan lists in its kv pool's `prefix_walks` becomes ready
  before anything of the request ran on that node, the engine's `claim_prefix` starts the
  request's KV on the cached pages of its prompt's longest cached prefix; the row then feeds only
  the rest, like a chunk after the KV present.
- Chunked prompts: a row outside loops feeds the chunk the scheduler gave it (`step_rows`); after
  a chunk that is not the last (`StepRow.is_partial`) its KV context grows, nothing is sampled and
  the rest of the row is ready again; the call completes on its last chunk.
- Post-process (`on_step`) advances the rows of a step together: rows at a loop step (a decode
  iteration) in one pass over the step's rows (conductor/loop_pass.py), touching a request's
  partitions only when a row leaves that shape (its loop ends or stops, max_tokens, an error);
  every other row through its walk run's tables (conductor/walk_run.py).
- Stop strings: a request with `stop_strings` ends the partition whose counted tokens' decoded
  text (`decode`, given by the run: the tokenizer's, special tokens skipped) holds one, with
  finish reason "stop". Only the tail of the output is decoded per token (`STOP_TAIL_TOKENS`
  per character of the longest stop string, at least `MIN_STOP_TAIL_TOKENS`), so a long output
  costs the same per token as a short one.
- When a partition ends, the streams it produces are marked producer-done (final chunks flow).
- A request ends when every partition is done; a row error fails the request alone. Its finish
  reason is "length" when max_tokens ended a partition, a loop with a stop condition ran out of
  iterations before a stop, or the engine stopped one at a limit (`RowResult.is_length`: a node
  that counts no tokens sampled max_tokens; WalkRun.is_cut: the output was cut), else "stop".
"""
from __future__ import annotations

import logging
from collections import deque
from itertools import compress, repeat
from operator import attrgetter
from typing import Any, Callable, Optional, cast

import numpy as np

from mstar.plan.guidance_mode import GuidanceRule
from mstar.plan.prefix_walks import prefix_walk_pairs
from mstar.plan.schema import PartitionPlan, Plan
from mstar.plan.stages import alternatives, default_walks
from mstar.runtime.conductor.lane_pass import advance_step
from mstar.runtime.conductor.lanes import LaneRows, Lanes
from mstar.runtime.conductor.loop_counts import LoopCounts
from mstar.runtime.conductor.loop_pass import advance_loop_rows, steady_refs
from mstar.runtime.conductor.partition_state import PartitionState
from mstar.runtime.conductor.request import Request, RequestRecord, count_elements
from mstar.runtime.conductor.streams import StreamBuffer, stream_keeps
from mstar.runtime.conductor.tables import OUTSIDE_LOOPS, RunWalk, model_stop_loop
from mstar.runtime.conductor.text_context import (
    INCOMPLETE, MAX_CHARACTER_BYTES, character_start, context_before, text_after,
)
from mstar.runtime.conductor.walk_run import ActiveCall, WalkRun, WalkStateError
from mstar.runtime.step import Engine, EngineLost, RowResult, StepRow

log = logging.getLogger(__name__)


# A stop string of N characters is looked for in the text of the last max(MIN, N * PER_CHAR)
# tokens: a token decodes to at least one character except special tokens (skipped) and byte
# pieces of one character, so the window holds any stop string just completed; one whose tokens
# decode to fewer characters than that (many special tokens) is doubled until it does
# (`has_stop_string`).
STOP_TAIL_TOKENS = 4
MIN_STOP_TAIL_TOKENS = 16
STOP_TAIL_SLACK = 2  # characters a token's text alone may differ from its text in context (a leading space)


_lane_of = attrgetter("lane")
_num_tokens_of = attrgetter("num_tokens")
_inputs_of = attrgetter("inputs")


class RouteError(Exception):
    """A request's route does not match its partitions' stages (or its id was used before)."""


class _RequestState:
    """One admitted request: its partitions, their stream buffers, and KV context per node."""

    __slots__ = ("record", "partitions", "by_walk", "context", "buffers", "signalled", "ready_keys", "guided",
                 "lanes")

    def __init__(self, record: RequestRecord):
        self.record = record
        self.partitions: list[PartitionState] = []
        self.by_walk: dict[str, PartitionState] = {}  # walk name -> its partition
        self.context: dict[str, int] = {}  # kv node -> tokens in its KV sequence
        self.buffers: dict[tuple[str, str], StreamBuffer] = {}  # (consumer partition, edge)
        self.signalled: set[str] = set()  # partitions whose end was sent to their streams
        self.ready_keys: set[tuple[str, str]] = set()  # (node, walk) tables of Conductor.ready_calls it is in
        self.guided: dict[str, bool] = {}  # node -> whether it requires guidance there (asked once)
        self.lanes: list[ActiveCall] = []  # its calls that hold a decode lane (conductor/lanes.py)


def partition_kv_nodes(plan: Plan, kv_nodes: set[str]) -> dict[str, frozenset[str]]:
    """Partition -> the kv nodes its walks (every alternative of every stage) call."""
    walk_nodes = {walk.name: {call.node for call in walk.calls if call.node in kv_nodes} for walk in plan.walks}
    return {part.name: frozenset().union(*(walk_nodes[walk] for stage in part.stages for walk in stage.walks))
            for part in plan.partitions}


def follow_stages(part: PartitionPlan, wanted: list[str]) -> list[str]:
    """The walks a route takes through a partition's stages: per stage, the alternative whose
    sequence of walks comes next in the route (none for an optional stage, or when the route is
    empty: the partition is left out)."""
    index = 0
    for stage in part.stages:
        sequence = next((seq for seq in alternatives(stage) if wanted[index:index + len(seq)] == seq), None)
        if sequence is not None:
            index += len(sequence)
        elif not (stage.is_optional or not wanted):
            raise RouteError(f"partition {part.name}: stage {stage.walks} is not optional and the route "
                             f"{wanted} does not take it")
    if index != len(wanted):
        raise RouteError(f"partition {part.name}: route {wanted} does not follow the stages")
    return wanted


def _is_last_token(partition: PartitionState) -> bool:
    """One more counted output ends the partition (its max_tokens)."""
    return partition.num_tokens + 1 >= partition.max_tokens


def _chunk_row(request_id: str, walk: str, active_call: ActiveCall, chunk: int, context: int) -> StepRow:
    """The row of a call outside loops feeding `chunk` of its tokens not yet fed (all when 0 or
    more than are left): the next chunk of a prompt the scheduler cut (token_budget.py)."""
    fed, total = active_call.num_fed, active_call.num_tokens
    left = total - fed
    num = left if chunk <= 0 or chunk > left else chunk
    return StepRow(request_id, walk, num, context, active_call.inputs, 0, active_call,
                   chunk_start=fed, is_partial=num < left)


class Conductor:
    """Requests through partitions and walks (module docstring). `engine` is only asked to
    add and end requests; `clock` stamps arrivals, tokens and endings (the run clock)."""

    def __init__(self, plan: Plan, engine: Engine, clock: Callable[[], float],
                 decode: Optional[Callable[[list[int]], str]] = None):
        self.plan = plan
        self.decode = decode  # token ids -> text (for stop strings); None: no tokenizer
        self.engine = engine
        self.clock = clock
        self.walks = {walk.name: RunWalk(walk) for walk in plan.walks}
        self.counts = LoopCounts(plan)
        self.kv_nodes = {node.name for node in plan.nodes if node.engine == "kv"}
        self.guidance_rules = {node.name: GuidanceRule.of(node) for node in plan.nodes if node.guidance}
        self.max_concurrent = plan.deployment.max_concurrent_requests
        # Streams a partition produces: the (consumer partition, edge) buffers it ends.
        self.produced: dict[str, list[tuple[str, str]]] = {}
        for part in plan.partitions:
            for stream in part.streams:
                self.produced.setdefault(stream.producer_partition, []).append((part.name, stream.edge))
        self._keeps = stream_keeps(plan, engine.caps.vocab_sizes)
        # The kv nodes each partition's walks call: a request's memory on a node goes once every
        # partition of it that calls the node has ended (Qwen3-Omni's Thinker pages while its
        # Talker and Code2Wav still run), not at the request's end (`_end_nodes`).
        self.partition_kv_nodes = partition_kv_nodes(plan, self.kv_nodes)
        self.end_node = getattr(engine, "end_node", None)  # an engine object of the caller's may lack it
        # (node, walk) pairs whose rows a scheduler may cut into chunks (KeyPlan.chunk_sizes)
        self.cut_walks = {(key.node, walk) for worker in plan.workers for key in worker.keys
                          for walk in key.chunk_sizes}
        # (node, walk) pairs whose first row may start after a cached prefix (KvPoolPlan.prefix_walks)
        self.prefix_walks = prefix_walk_pairs(plan)
        self.is_columnar = True  # False: every row through its walk run (the reference path)
        # False: the loop pass's fast rows all take its general kernel, never the steady case
        # (loop_pass.py; `mstar bench postprocess` compares the two in one process)
        self.is_steady = True
        # Decode lanes (conductor/lanes.py): calls in the steady decode shape keep their state in
        # arrays, advanced a step at a time when the engine answers in columns. False: never
        # (`mstar bench postprocess` compares the two in one process).
        self.is_laned = True
        self.lanes = Lanes()
        # (node, walk) pairs with batching rules: a row's batch class reads its loop iteration
        # when it becomes ready (batch_class.py), so their calls never take a lane.
        self.ruled = {(key.node, walk) for worker in plan.workers for key in worker.keys
                      for walk, rules in key.batch_rules.items() if rules}
        self.records: dict[str, RequestRecord] = {}
        self.active: dict[str, _RequestState] = {}
        self.waiting: deque[RequestRecord] = deque()
        self.num_finished = 0
        # Rows that became ready, grouped: (node, walk, request ids, tokens per row).
        self.ready_out: list[tuple[str, str, list[str], list[int]]] = []
        self.ended_out: list[str] = []
        self.nodes_freed_out = False
        # (node, walk) -> request id -> the call of that request made ready last (step_rows finds a
        # scheduled row's call here; it is live while its is_ready holds: walk_run.ActiveCall).
        self.ready_calls: dict[tuple[str, str], dict[str, ActiveCall]] = {}

    # ------------------------------------------------------------ requests in

    def submit(self, request: Request, arrival_s: Optional[float] = None) -> RequestRecord:
        """A request is handed over now; it is admitted at once or waits (FIFO). arrival_s: when it
        arrived on the run clock, if before now (an arrival due while a step ran is handed over
        after it: its TTFT counts that wait); None: now."""
        if request.id in self.records:
            raise RouteError(f"request id {request.id!r} was submitted twice")
        now = self.clock()
        record = RequestRecord(request=request, arrival_s=now if arrival_s is None else min(arrival_s, now))
        self.records[request.id] = record
        self.waiting.append(record)
        self._admit()
        return record

    def _admit(self) -> None:
        while self.waiting and (self.max_concurrent is None or len(self.active) < self.max_concurrent):
            record = self.waiting.popleft()
            self._start(record)

    def _route_of(self, request: Request) -> dict[str, list[RunWalk]]:
        unknown = set(request.route) - {p.name for p in self.plan.partitions}
        if unknown:
            raise RouteError(f"route names unknown partitions {sorted(unknown)}")
        routes = {}
        for part in self.plan.partitions:
            if part.name not in request.route:
                routes[part.name] = [self.walks[w] for w in default_walks(part)]
                continue
            routes[part.name] = [self.walks[w] for w in follow_stages(part, request.route[part.name])]
        return routes

    def _start(self, record: RequestRecord) -> None:
        request = record.request
        record.admit_s = self.clock()
        try:
            routes = self._route_of(request)
        except RouteError as error:
            record.is_refused = True
            self._finish_unadmitted(record, f"error: {error}")
            return
        except Exception as error:  # a route of the wrong kind (`None`): it failed the run loop, every request
            record.is_refused = True
            self._finish_unadmitted(record, f"error: the request's route cannot be read ({type(error).__name__}: "
                                            f"{error})")
            return
        problem = self.counts.problem(request.loop_counts)
        if problem is not None:
            self._finish_unadmitted(record, f"error: {problem}")
            return
        try:
            reason = self.engine.add_request(request.id, request)
        except EngineLost as lost:
            # Neither waiting nor active any more: fail it here, or the run's end (which fails
            # the active requests) would leave it unfinished.
            self._finish_unadmitted(record, f"error: {lost}")
            raise
        except Exception as error:  # the engine could not take this request: it fails alone, the run goes on
            reason = f"the engine could not take the request ({type(error).__name__}: {error})"
        if reason is not None:
            record.is_refused = True
            self._finish_unadmitted(record, f"error: {reason}")
            return
        if record.is_finished:  # failed or cancelled while the engine took it (`fail` above)
            self.engine.end_request(request.id)
            return
        state = _RequestState(record)
        self.active[request.id] = state
        buffers = state.buffers
        for part in self.plan.partitions:
            for stream in part.streams:
                key = (part.name, stream.edge)
                buffers[key] = StreamBuffer(stream.policy, keep=self._keeps.get(key))
        for part in self.plan.partitions:
            ps = PartitionState(part, routes[part.name], record, buffers, self.clock)
            ps.owner = state
            state.partitions.append(ps)
            for walk in ps.walks:
                state.by_walk[walk.name] = ps
        for ps in state.partitions:
            ps.other_stores = [other.store for other in state.partitions if other is not ps]
        self.pump(state)

    def _finish_unadmitted(self, record: RequestRecord, reason: str) -> None:
        """End a request that never ran (refused at admission, or failed while waiting): it ends
        like any other, through `ended_out`, so the driver's on_finish writes its result."""
        self.num_finished += 1
        record.finish_reason = reason
        record.finish_s = self.clock()
        self.ended_out.append(record.request.id)

    # ------------------------------------------------------------ rows

    def step_rows(self, node: str, request_ids: list[str], walks: list[str],
                  num_tokens: Optional[list[int]] = None) -> tuple[list[StepRow], list[str]]:
        """The rows of a scheduled batch that are still live, and the ids of those whose loop
        has iterations left after this one (what a speculative next step may continue): the
        first two parts of `build_step`."""
        rows, continuing, _ = self.build_step(node, request_ids, walks, num_tokens)
        return rows, continuing

    def build_step(self, node: str, request_ids: list[str], walks: list[str],
                   num_tokens: Optional[list[int]] = None
                   ) -> tuple[list[StepRow], list[str], Optional[LaneRows]]:
        """The rows of a scheduled batch that are still live, the ids of those whose loop has
        iterations left after this one (what a speculative next step may continue), and the
        step's laned rows (None when it has none; hand them back to `on_step`). A row is stale
        (left out) when its request or partition ended, its walk is no longer the partition's
        current run, or its call is no longer ready: then the call that row was scheduled for
        is no longer ready (its run was cancelled or finished, or it completed).
        num_tokens: the batch's tokens per row; a row outside loops feeds that many of its tokens
        not yet fed (a chunk of a prompt the scheduler cut, `_chunk_row`), all of them when None."""
        rows: list[Any] = []
        continuing = []
        tables = self.ready_calls
        table: dict[str, ActiveCall] = {}
        table_walk = None
        laned_ids: list[str] = []  # the laned rows: built below, from their lanes' positions
        laned_walks: list[str] = []
        laned_calls: list[ActiveCall] = []
        # A kv node's looped row counts at least one output a step: when that reaches the request's
        # max_tokens its loop does not go on, and a speculated step N+1 holding it would be launched
        # ahead for nothing (a one-request workload then waited a whole wasted step per request).
        is_kv = node in self.kv_nodes
        for request_id, walk, chunk in zip(request_ids, walks, num_tokens or repeat(0)):
            if walk != table_walk:  # one lookup per run of rows of one walk
                table_walk = walk
                table = tables.get((node, walk), {})
            call = table.get(request_id)
            if call is None or not call.is_ready:
                continue
            if call.lane is not None:
                laned_ids.append(request_id)
                laned_walks.append(walk)
                laned_calls.append(call)
                rows.append(None)
                continue
            run = call.run
            owner = cast(PartitionState, run.source).owner
            if owner.lanes:  # another call of the request holds a lane: its state, written back
                self.lanes.detach_all(owner)
            loop = call.call.loop
            if loop is None:
                is_cut = chunk and (node, walk) in self.cut_walks
                rows.append(_chunk_row(request_id, walk, call, chunk if is_cut else 0, run.context.get(node, 0)))
                continue
            loop_state = run.loops[loop]
            if loop_state is None:
                raise WalkStateError(f"walk {walk}: a ready call of node {node} is in a loop that is not running")
            iteration = loop_state.iteration
            rows.append(StepRow(request_id, walk, call.num_tokens, run.context.get(node, 0), call.inputs,
                                iteration, call, loop_state.limit))
            if iteration + 1 < loop_state.limit and not (is_kv and call.call.counted
                                                         and _is_last_token(cast(PartitionState, run.source))):
                continuing.append(request_id)
        if not laned_calls:
            return rows, continuing, None
        return self._laned_rows(node, rows, continuing, laned_ids, laned_walks, laned_calls)

    def _laned_rows(self, node: str, rows: list[Any], continuing: list[str], ids: list[str], walks: list[str],
                    calls: list[ActiveCall]) -> tuple[list[StepRow], list[str], LaneRows]:
        """build_step's laned rows (their places in `rows` hold None): each one's loop iteration
        and KV context are its lane's base values plus its steady iterations since (Lanes.rows_of,
        a few array operations for the step), then one StepRow each."""
        lanes = np.fromiter(map(_lane_of, calls), dtype=np.intp, count=len(calls))
        iterations, contexts, limits, is_continuing = self.lanes.rows_of(lanes, node in self.kv_nodes)
        built = list(map(StepRow, ids, walks, map(_num_tokens_of, calls), contexts, map(_inputs_of, calls),
                         iterations, calls, limits))
        walk: Optional[str] = walks[0] if walks.count(walks[0]) == len(walks) else None
        if len(built) == len(rows):
            return built, list(compress(ids, is_continuing)), LaneRows(
                lanes, self.lanes.serial[lanes], self.lanes.num_frees, None, ids, walk)
        at = [index for index, row in enumerate(rows) if row is None]
        for index, row in zip(at, built):
            rows[index] = row
        # in row order, as the rows not laned were appended (each kind's own test: loop limit and max_tokens)
        going_on = set(continuing).union(compress(ids, is_continuing))
        continuing = [row.request_id for row in rows if row.request_id in going_on]
        return rows, continuing, LaneRows(lanes, self.lanes.serial[lanes], self.lanes.num_frees, at,
                                          [row.request_id for row in rows], walk)

    def on_step(self, node: str, rows: list[StepRow], results: list[RowResult],
                token_ids: Any = None, stop_rows: Optional[list[int]] = None,
                lane_rows: Optional[LaneRows] = None) -> None:
        """A step of `node` ran: advance its rows. With the engine's columns (`token_ids`, one per
        row, and `stop_rows`: StepResult) and the step's `lane_rows` (build_step), laned rows move
        at once (conductor/lane_pass.py); rows at a loop step go through one columnar pass
        (while the engine answered each row in order); the rest row by row."""
        if (token_ids is not None and self.is_laned and self.is_steady and self.is_columnar
                and len(token_ids) == len(rows) == len(results)):
            advance_step(self, node, rows, results, token_ids, stop_rows or [], lane_rows)
            return
        self.advance_rows(node, rows, results)

    def advance_rows(self, node: str, rows: list[StepRow], results: list[RowResult]) -> None:
        """Rows at a loop step through the loop pass, the rest row by row (on_step without the
        engine's columns)."""
        if self.is_columnar:
            rows, results = advance_loop_rows(self, node, rows, results)
            if not rows and not results:
                return
        self.on_rows(node, rows, results)

    def on_rows(self, node: str, rows: list[StepRow], results: list[RowResult]) -> None:
        """Row by row: each result goes to its walk run. A row without a result fails that
        request; results of stale rows (their request or partition ended meanwhile) are ignored,
        and so are results that match no row left to apply (for a request the step did not hold,
        or a second answer for a row), logged: failing such a request failed it for the engine's
        mistake, and one in no step was not even involved."""
        by_id = {row.request_id: row for row in rows}
        is_kv = node in self.kv_nodes
        active = self.active
        now = self.clock()  # one time stamp for the step's token events
        for result in results:
            request_id = result.request_id
            row = by_id.pop(request_id, None)
            state = active.get(request_id)
            if state is None:
                continue
            if row is None:
                log.error("node %s: the engine returned a result for request %s that matches no row of the step "
                          "left to apply (not in the step, or answered twice); ignored", node, request_id)
                continue
            if state.lanes:  # its state, written back before the walk run takes the row
                self.lanes.detach_all(state)
            if result.error is not None:
                state.record.is_input_fault = result.is_input_fault
                self.fail(request_id, f"error: {result.error}")
                continue
            ps = state.by_walk.get(row.walk)
            if ps is None:
                continue
            run = ps.run
            if run is None or run.name != row.walk:
                continue
            active_call = run.active.get(node)
            if active_call is None:
                continue
            if is_kv:
                context = state.context
                context[node] = context.get(node, 0) + row.num_tokens
            if result.prompt_logprobs is not None:  # its prompt's chunks come in order, one row a step
                state.record.prompt_logprobs += result.prompt_logprobs
            if row.is_partial:  # a chunk of a cut prompt: the rest is ready again, nothing sampled
                active_call.num_fed += row.num_tokens
                self.ready_out.append((node, row.walk, [request_id], [active_call.num_tokens - active_call.num_fed]))
                continue
            outputs = result.outputs
            counted = active_call.call.counted
            logprobs = result.logprobs
            since = len(state.record.emission_values) if logprobs is not None else 0
            run.complete(node, outputs, result.is_stop, result.is_length)
            if result.is_stop and not counted and active_call.call.loop is None:
                ps.stop_before_later_loops(node, result.is_length)
            if logprobs is not None:
                state.record.attach_logprobs(logprobs, since)
            if counted:
                self.count(state, ps, counted, outputs, now, model_stop_loop(active_call.call, result))
            self.after_row(state, ps, run)
        for request_id in by_id:
            self.fail(request_id, "error: the engine returned no result for the row")

    def after_row(self, state: _RequestState, ps: PartitionState, run) -> None:
        """A row of `run` (ps's walk run) was applied: end the run if it is done, then pump."""
        if state.lanes:
            self.lanes.detach_all(state)
        if run.is_done and ps.run is run:
            ps.finish_run()
        self.pump(state, is_any_done=ps.is_done)

    def count(self, state: _RequestState, ps: PartitionState, counted: tuple, outputs: dict[str, Any],
              now: float, stop_loop: Optional[int] = None) -> None:
        """Count the values under the call's counted outputs (tokens at time `now`); stop_loop: the
        loop the row's model stop ends (`model_stop_loop`), or None."""
        record = state.record
        num = 0
        for name in counted:
            if name in outputs:
                value = outputs[name]
                if isinstance(value, list):
                    num += len(value)
                    record.output_tokens.extend(value)
                else:
                    num += count_elements(value)
                    record.output_tokens.append(value)
        if num:
            self.note_tokens(record, ps, num, now, stop_loop)

    def note_tokens(self, record: RequestRecord, ps: PartitionState, num: int, now: float,
                    stop_loop: Optional[int] = None) -> None:
        """`num` tokens (already in record.output_tokens) arrived at `now`: time stamps, counts,
        and the partition's end at a stop string or max_tokens. The one place both the row-by-row
        count and the loop pass take it from."""
        if record.first_token_s is None:
            record.first_token_s = now
        record.token_times_s.append(now)
        record.num_output_tokens += num
        ps.num_tokens += num
        if ps.num_tokens >= ps.max_tokens or record.request.stop_strings or stop_loop == OUTSIDE_LOOPS:
            self.end_at_tokens(record, ps, stop_loop)

    def end_at_tokens(self, record: RequestRecord, ps: PartitionState, stop_loop: Optional[int] = None) -> None:
        """After a count: the partition ends at a stop string in its decoded tail, at a model's stop
        outside loops (`stop_loop` OUTSIDE_LOOPS: PartitionState.stops_outside_loops), or at
        max_tokens where more could be counted (a model's stop in `stop_loop` as the max_tokens-th
        token may leave nothing to count: the partition then ends `stop`, by that stop). (The loop
        pass's fast kernel inlines note_tokens' bookkeeping above and calls this under the same
        condition.)"""
        if record.request.stop_strings and not ps.is_done and self.has_stop_string(record):
            ps.end()
        if stop_loop == OUTSIDE_LOOPS and ps.stops_outside_loops():
            ps.end()
        if ps.num_tokens >= ps.max_tokens and not ps.is_done and ps.may_count_more(stop_loop):
            ps.end(is_length=True)

    def has_stop_string(self, record: RequestRecord) -> bool:
        """The decoded tail of the request's output holds one of its stop strings (with min_tokens,
        one that ends past the text of the first min_tokens tokens)."""
        if self.decode is None:
            return False
        request = record.request
        stops, min_tokens = request.stop_strings, request.min_tokens
        output = record.output_tokens
        if len(output) <= min_tokens:  # (vLLM's: no stop string before min_tokens tokens)
            return False
        longest = max(map(len, stops))
        tail = max(MIN_STOP_TAIL_TOKENS, STOP_TAIL_TOKENS * longest)
        while True:
            start = max(0, len(output) - tail)
            if not all(isinstance(t, int) for t in output[max(0, start - MAX_CHARACTER_BYTES):]):
                return False  # frames of codes, not text
            # read after the tokens before the window, as the text shown is (text_context.py)
            tokens = output[start:]
            context = context_before(request.prompt_tokens, output, start)
            text = text_after(self.decode, context, tokens)
            if INCOMPLETE in text:  # a window or a context starting inside a character (a byte-fallback
                # emoji read as U+FFFD throughout), or a character not yet whole: from a character's start
                start = character_start(self.decode, output, start) if start else 0
                tokens = output[start:]
                context = context_before(request.prompt_tokens, output, start, self.decode)
                text = text_after(self.decode, context, tokens)
            # A stop string just completed ends in the newest token's text and starts at most
            # `longest - 1` characters before it: the window holds that unless its tokens decode to
            # little (special tokens skipped: 19 of them inside "a on" hid it, and the request ran
            # to max_tokens with its text cut at the stop). Then the window doubles.
            if start == 0 or len(text) - len(self.decode([output[-1]])) - STOP_TAIL_SLACK >= longest - 1:
                break
            tail *= 2
        if not min_tokens:
            return any(stop in text for stop in stops)
        # a stop string counts where it ends past the first min_tokens tokens' text (in the tail)
        head = output[start:min_tokens]
        after = len(text_after(self.decode, context, head)) if head else 0
        return any(text.find(stop, max(0, after - len(stop) + 1)) >= 0 for stop in stops)

    # ------------------------------------------------------------ progress

    def pump(self, state: _RequestState, is_any_done: bool = True) -> None:
        """Start walks, re-check waiting calls, end partitions, propagate producer-done, and
        collect ready rows, until nothing changes. is_any_done: a partition may have ended
        before this call (max tokens, routes) without its end sent to its streams; False only
        when the caller knows none did (a row result that ended no partition)."""
        if state.lanes:
            self.lanes.detach_all(state)
        is_changed = True
        while is_changed:
            is_changed = False
            for ps in state.partitions:
                if ps.is_done:
                    continue
                run = ps.run
                if run is None:
                    run = ps.start_next()
                    if run is None:
                        if ps.is_drained():
                            ps.end()
                            is_any_done = True
                        continue
                    is_changed = True
                elif run.waiting:
                    run.retry_waiting()
                if run.new_ready:
                    self._send_ready(state, run)
                if run.is_done:
                    ps.finish_run()
                    is_changed = True
                    is_any_done = is_any_done or ps.is_done
                elif run.waiting and ps.is_starved():
                    ps.end()
                    is_changed = is_any_done = True
            if is_any_done:
                is_any_done = False
                for ps in state.partitions:
                    if ps.is_done and ps.name not in state.signalled:
                        self._signal_done(state, ps)
                        is_changed = True
        for ps in state.partitions:
            if not ps.is_done:
                return
        reason = "length" if any(ps.is_length for ps in state.partitions) else "stop"
        self._end(state, reason)

    def _send_ready(self, state: _RequestState, run: WalkRun) -> None:
        """The run's calls that became ready leave as rows, and step_rows will find them."""
        request_id = state.record.request.id
        for call in run.new_ready:
            key = (call.node, run.name)
            if self.prefix_walks and key in self.prefix_walks:
                self._claim_prefix(state, call)
            self.ready_out.append((call.node, run.name, [request_id], [call.num_tokens - call.num_fed]))
            table = self.ready_calls.get(key)
            if table is None:
                table = self.ready_calls[key] = {}
            table[request_id] = call
            state.ready_keys.add(key)
        run.new_ready.clear()

    def _claim_prefix(self, state: _RequestState, call: ActiveCall) -> None:
        """A call that takes the prompt became ready on a node with a prefix cache: when nothing of
        the request ran there yet, the engine starts its KV on the cached prefix, and the row feeds
        only the rest (as a chunk after the KV present). A request asking for its prompt's
        log-probabilities claims nothing: cached tokens are fed again, as their logits are needed.
        Nor does one guided there: its row writes the guidance sequences too, which no cached page
        holds (the claim started the first alone, and the others got the uncached tail at position
        0: a second identical guided image came out different)."""
        node, record = call.node, state.record
        tokens = next((v for v in call.inputs.values() if isinstance(v, list) and v), None)
        if state.context.get(node, 0) or call.num_fed or tokens is None or not isinstance(tokens[0], int):
            return
        if record.request.prompt_logprobs is not None or self.requires_guidance(record.request.id, node):
            return
        num_cached = self.engine.claim_prefix(record.request.id, node, tokens)
        record.num_prefix_lookups += 1
        if 0 < num_cached < len(tokens):
            record.num_cached_tokens += num_cached
            call.num_fed = num_cached
            state.context[node] = num_cached

    def _signal_done(self, state: _RequestState, ps: PartitionState) -> None:
        state.signalled.add(ps.name)
        for key in self.produced.get(ps.name, ()):
            state.buffers[key].mark_producer_done()
        if self.partition_kv_nodes.get(ps.name):
            self._end_nodes(state, ps)

    def _end_nodes(self, state: _RequestState, ps: PartitionState) -> None:
        """The kv nodes no partition of the request still running calls free its memory now (when
        every partition has ended, `_end` frees it all; a partition its route skips ran nothing;
        an engine without `end_node` keeps the memory to the request's end)."""
        running = [p for p in state.partitions if not p.is_done]
        if not running or not ps.walks or self.end_node is None:
            return
        nodes = self.partition_kv_nodes[ps.name].difference(*(self.partition_kv_nodes[p.name] for p in running))
        for node in sorted(nodes):
            try:
                self.end_node(state.record.request.id, node)
                self.nodes_freed_out = True
            except EngineLost:
                raise
            except Exception as error:  # as in `_end`: the request goes on, the pages may stay held
                log.error("request %s: the engine failed to release its memory on %s (%s: %s)",
                          state.record.request.id, node, type(error).__name__, error)

    # ------------------------------------------------------------ endings

    def fail(self, request_id: str, reason: str) -> None:
        """End one request now with `reason` (an error, or a cancellation); the others go on."""
        state = self.active.get(request_id)
        if state is not None:
            if state.lanes:
                self.lanes.detach_all(state)
            for ps in state.partitions:
                ps.end()
            self._end(state, reason)
            return
        record = self.records.get(request_id)
        if record is not None and not record.is_finished:
            # Usually waiting; a request being admitted is neither waiting nor active yet, and
            # still ends here rather than raising (by identity: records compare by value).
            for index, waiting in enumerate(self.waiting):
                if waiting is record:
                    del self.waiting[index]
                    break
            self._finish_unadmitted(record, reason)

    def cancel(self, request_id: str) -> None:
        self.fail(request_id, "cancelled")

    def _end(self, state: _RequestState, reason: str) -> None:
        record = state.record
        self.num_finished += 1
        record.finish_reason = reason
        record.finish_s = self.clock()
        del self.active[record.request.id]
        for key in state.ready_keys:
            self.ready_calls[key].pop(record.request.id, None)
        self.ended_out.append(record.request.id)
        try:
            self.engine.end_request(record.request.id)
        except EngineLost:  # a rank is gone: the run stops (the driver fails what is active)
            raise
        except Exception as error:  # the request has ended: the others go on, the engine may keep its pages
            log.error("request %s: the engine failed to release it (%s: %s); its memory may stay held",
                      record.request.id, type(error).__name__, error)
        self._admit()

    # ------------------------------------------------------------ lanes

    def try_lane(self, call: ActiveCall, node: str, is_kv: bool) -> None:
        """Give a lane to a ready call of a fast loop step that is in the steady decode shape
        (loop_pass.py: it emits and counts one edge, its inputs stay on the device, no stop
        strings, its first token and KV context recorded) and whose next row is a common one."""
        step = call.step
        if step is None:
            return
        client_name, client_kind, counted, _, device_inputs = step.fast
        if client_name is None or counted is not client_name or call.inputs is not device_inputs:
            return
        if (node, call.run.name) in self.ruled:
            return
        refs = call.refs
        if refs is None:
            refs = call.refs = steady_refs(call, node, is_kv)
        if not refs:
            return
        ps, loop_state = refs[1], refs[3]
        if ps.is_done or loop_state.is_stop:
            return
        self.lanes.attach(call, ps.owner, node if is_kv else None, client_kind)

    def sync_lanes(self) -> None:
        """Write every lane back: the records, partitions and walk runs hold every token so far
        (for a reader outside the conductor: the run loop calls it before `on_step` callbacks
        and when a run returns)."""
        self.lanes.sync_all()

    # ------------------------------------------------------------ state

    def kv_context(self, request_id: str, node: str) -> int:
        """Tokens of the active request's KV on a kv node (what its next row attends over: the
        cached prefix and the chunks fed so far); 0 for a request that is not active."""
        state = self.active.get(request_id)
        return 0 if state is None else state.context.get(node, 0)

    def requires_guidance(self, request_id: str, node: str) -> bool:
        """Whether the active request requires guidance on `node` (plan/guidance_mode.py); False
        for a node without guidance sequences or a request that is not active."""
        rule = self.guidance_rules.get(node)
        state = self.active.get(request_id)
        if rule is None or state is None:
            return False
        known = state.guided.get(node)
        if known is None:
            request = state.record.request
            known = rule.requires(request.guidance, [w for walks in request.route.values() for w in walks])
            state.guided[node] = known
        return known

    @property
    def num_active(self) -> int:
        return len(self.active)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    def is_idle(self) -> bool:
        return not self.active and not self.waiting
