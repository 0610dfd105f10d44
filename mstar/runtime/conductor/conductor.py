"""The conductor: requests through their partitions' walks (reference notes 0.4).

In: requests (`submit`), step results (`on_step`), failures and cancellations. Out, drained by the
driver after each call: `ready_out` rows (request id, node, walk, num_tokens) to put on the
schedulers of the ranks that run them, and `ended_out` request ids whose engine resources and
scheduler rows must be freed. It never touches workers, schedulers or tensors itself.

- Admission: at most deployment.max_concurrent_requests at once, the rest wait FIFO. The engine
  may refuse a request (`add_request` returns a reason, e.g. it can never fit): it fails alone.
- Each partition runs its route's walks stage by stage (`PartitionState`); a stream-consumer
  partition (no initial walk) starts a run whenever a chunk is ready, and is done once its
  streams are exhausted; a partition whose walk waits on a stream that will never deliver ends.
- Token counting: every value produced under a name of the partition's count_tokens edges
  (once per row; a partition without such edges counts its text edges to the client) adds its
  element count; at max_tokens the partition ends ("length").
- When a partition ends, the streams it produces are marked producer-done (final chunks flow).
- A request ends when every partition is done; a row error fails the request alone.
"""
from __future__ import annotations

from collections import deque
from typing import Any, Callable, Optional

from mstar.plan.schema import CallPlan, Plan, WalkPlan
from mstar.runtime.conductor.partition_state import PartitionState
from mstar.runtime.conductor.request import Request, RequestRecord, count_elements
from mstar.runtime.step import Engine, RowResult, StepRow
from mstar.runtime.conductor.streams import StreamBuffer


class RouteError(Exception):
    """A request's route does not match its partitions' stages (or its id was used before)."""


def _walk_edges(walk: WalkPlan):
    stack = list(walk.body)
    while stack:
        section = stack.pop()
        if isinstance(section, CallPlan):
            yield from section.edges
        else:
            stack.extend(section.body)


class _RequestState:
    """One admitted request: its partitions, their stream buffers, and KV context per node."""

    __slots__ = ("record", "partitions", "by_walk", "context", "buffers", "signalled")

    def __init__(self, record: RequestRecord):
        self.record = record
        self.partitions: list[PartitionState] = []
        self.by_walk: dict[str, PartitionState] = {}  # walk name -> its partition
        self.context: dict[str, int] = {}  # kv node -> tokens in its KV sequence
        self.buffers: dict[tuple[str, str], StreamBuffer] = {}  # (consumer partition, edge)
        self.signalled: set[str] = set()  # partitions whose end was sent to their streams


class Conductor:
    """Requests through partitions and walks (module docstring). `engine` is only asked to
    add and end requests; `clock` stamps arrivals, tokens and endings (the run clock)."""

    def __init__(self, plan: Plan, engine: Engine, clock: Callable[[], float]):
        self.plan = plan
        self.engine = engine
        self.clock = clock
        self.walks = {walk.name: walk for walk in plan.walks}
        self.kv_nodes = {node.name for node in plan.nodes if node.engine == "kv"}
        self.stream_inputs = {node.name: set(node.stream_inputs) for node in plan.nodes}
        self.max_concurrent = plan.deployment.max_concurrent_requests
        self.count_names: dict[str, frozenset[str]] = {}
        for part in plan.partitions:
            names = set()
            for stage in part.stages:
                for walk_name in stage.walks:
                    names.update(e.name for e in _walk_edges(self.walks[walk_name]) if e.is_count_tokens)
            if not names:  # no count_tokens edge: text sent to the client counts
                for stage in part.stages:
                    for walk_name in stage.walks:
                        names.update(
                            e.name for e in _walk_edges(self.walks[walk_name])
                            if e.dest_kind == "client" and e.modality == "text"
                        )
            self.count_names[part.name] = frozenset(names)
        self.records: dict[str, RequestRecord] = {}
        self.active: dict[str, _RequestState] = {}
        self.waiting: deque[RequestRecord] = deque()
        self.num_finished = 0
        self.ready_out: list[tuple[str, str, str, int]] = []
        self.ended_out: list[str] = []

    # ------------------------------------------------------------ requests in

    def submit(self, request: Request) -> RequestRecord:
        """A request arrives now; it is admitted at once or waits (FIFO)."""
        if request.id in self.records:
            raise RouteError(f"request id {request.id!r} was submitted twice")
        record = RequestRecord(request=request, arrival_s=self.clock())
        self.records[request.id] = record
        self.waiting.append(record)
        self._admit()
        return record

    def _admit(self) -> None:
        while self.waiting and (self.max_concurrent is None or len(self.active) < self.max_concurrent):
            record = self.waiting.popleft()
            self._start(record)

    def _route_of(self, request: Request) -> dict[str, list[WalkPlan]]:
        unknown = set(request.route) - {p.name for p in self.plan.partitions}
        if unknown:
            raise RouteError(f"route names unknown partitions {sorted(unknown)}")
        routes = {}
        for part in self.plan.partitions:
            if part.name not in request.route:
                routes[part.name] = [self.walks[st.walks[0]] for st in part.stages if not st.is_optional]
                continue
            wanted = request.route[part.name]
            taken: list[WalkPlan] = []
            index = 0
            for stage in part.stages:
                if index < len(wanted) and wanted[index] in stage.walks:
                    taken.append(self.walks[wanted[index]])
                    index += 1
                elif not (stage.is_optional or not wanted):
                    raise RouteError(
                        f"partition {part.name}: stage {stage.walks} is not optional and the route "
                        f"{wanted} does not take it"
                    )
            if index != len(wanted):
                raise RouteError(f"partition {part.name}: route {wanted} does not follow the stages")
            routes[part.name] = taken
        return routes

    def _start(self, record: RequestRecord) -> None:
        request = record.request
        record.admit_s = self.clock()
        try:
            routes = self._route_of(request)
        except RouteError as error:
            self._finish_unadmitted(record, f"error: {error}")
            return
        reason = self.engine.add_request(request.id, request)
        if reason is not None:
            self._finish_unadmitted(record, f"error: {reason}")
            return
        state = _RequestState(record)
        self.active[request.id] = state
        buffers = state.buffers
        for part in self.plan.partitions:
            for stream in part.streams:
                buffers[(part.name, stream.edge)] = StreamBuffer(stream.policy)
        for part in self.plan.partitions:
            ps = PartitionState(
                part, routes[part.name], record, buffers, self.stream_inputs,
                self.count_names[part.name], self.clock,
            )
            state.partitions.append(ps)
            for walk in ps.walks:
                state.by_walk[walk.name] = ps
        for ps in state.partitions:
            ps.other_stores = [other.store for other in state.partitions if other is not ps]
        self._pump(state)

    def _finish_unadmitted(self, record: RequestRecord, reason: str) -> None:
        self.num_finished += 1
        record.finish_reason = reason
        record.finish_s = self.clock()

    # ------------------------------------------------------------ rows

    def step_rows(self, node: str, request_ids: list[str], walks: list[str]) -> tuple[list[StepRow], list[str]]:
        """The rows of a scheduled batch that are still live, and the ids of those whose loop
        has iterations left after this one (what a speculative next step may continue). A row
        is stale (left out) when its request or partition ended, its walk is no longer the
        partition's current run, or its call is no longer ready."""
        rows = []
        continuing = []
        active = self.active
        for request_id, walk in zip(request_ids, walks):
            state = active.get(request_id)
            if state is None:
                continue
            ps = state.by_walk.get(walk)
            run = ps.run if ps is not None else None
            if run is None or run.walk.name != walk:
                continue
            call = run.active.get(node)
            if call is None or not call.is_ready:
                continue
            loop = call.loop
            iteration = loop.iteration if loop is not None else 0
            rows.append(StepRow(request_id, walk, call.num_tokens, state.context.get(node, 0), call.inputs, iteration))
            if loop is not None and iteration + 1 < loop.plan.max_iters:
                continuing.append(request_id)
        return rows, continuing

    def on_step(self, node: str, rows: list[StepRow], results: list[RowResult]) -> None:
        """A step of `node` ran: one pass over its row results. A row without a result (or an
        engine answering twice for a row) fails that request; results of stale rows (their
        request or partition ended meanwhile) are ignored."""
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
                self.fail(request_id, "error: the engine returned a result for a row it was not given")
                continue
            if result.error is not None:
                self.fail(request_id, f"error: {result.error}")
                continue
            ps = state.by_walk.get(row.walk)
            run = ps.run if ps is not None else None
            if run is None or run.name != row.walk or node not in run.active:
                continue
            if is_kv:
                context = state.context
                context[node] = context.get(node, 0) + row.num_tokens
            outputs = result.outputs
            run.complete(node, outputs, result.is_stop)
            if not ps.count_names.isdisjoint(outputs):
                self._count(state, ps, outputs, now)
            if run.is_done and ps.run is run:
                ps.finish_run()
            self._pump(state, is_any_done=ps.is_done)
        for request_id in by_id:
            self.fail(request_id, "error: the engine returned no result for the row")

    def _count(self, state: _RequestState, ps: PartitionState, outputs: dict[str, Any], now: float) -> None:
        """Count the values under the partition's count names (tokens at time `now`)."""
        record = state.record
        num = 0
        for name in ps.count_names:
            if name in outputs:
                value = outputs[name]
                if isinstance(value, list):
                    num += len(value)
                    record.output_tokens.extend(value)
                else:
                    num += count_elements(value)
                    record.output_tokens.append(value)
        if num == 0:
            return
        if record.first_token_s is None:
            record.first_token_s = now
        record.token_times_s.append(now)
        record.num_output_tokens += num
        ps.num_tokens += num
        if ps.num_tokens >= record.request.max_tokens and not ps.is_done:
            ps.end(is_length=True)

    # ------------------------------------------------------------ progress

    def _pump(self, state: _RequestState, is_any_done: bool = True) -> None:
        """Start walks, re-check waiting calls, end partitions, propagate producer-done, and
        collect ready rows, until nothing changes. is_any_done: a partition may have ended
        before this call (max tokens, routes) without its end sent to its streams; False only
        when the caller knows none did (a row result that ended no partition)."""
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
                    request_id = state.record.request.id
                    for call in run.new_ready:
                        self.ready_out.append((request_id, call.node, run.name, call.num_tokens))
                    run.new_ready.clear()
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

    def _signal_done(self, state: _RequestState, ps: PartitionState) -> None:
        state.signalled.add(ps.name)
        for part in self.plan.partitions:
            for stream in part.streams:
                if stream.producer_partition == ps.name:
                    state.buffers[(part.name, stream.edge)].mark_producer_done()

    # ------------------------------------------------------------ endings

    def fail(self, request_id: str, reason: str) -> None:
        """End one request now with `reason` (an error, or a cancellation); the others go on."""
        state = self.active.get(request_id)
        if state is not None:
            for ps in state.partitions:
                ps.end()
            self._end(state, reason)
            return
        record = self.records.get(request_id)
        if record is not None and not record.is_finished:
            self.waiting.remove(record)
            self._finish_unadmitted(record, reason)

    def cancel(self, request_id: str) -> None:
        self.fail(request_id, "cancelled")

    def _end(self, state: _RequestState, reason: str) -> None:
        record = state.record
        self.num_finished += 1
        record.finish_reason = reason
        record.finish_s = self.clock()
        del self.active[record.request.id]
        self.ended_out.append(record.request.id)
        self.engine.end_request(record.request.id)
        self._admit()

    # ------------------------------------------------------------ state

    @property
    def num_active(self) -> int:
        return len(self.active)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    def is_idle(self) -> bool:
        return not self.active and not self.waiting
