"""Post-process of a step's loop rows in one pass (the common case: a decode step).

In:  the conductor, the node, the step's rows and the engine's row results (in row order).
Out: `advance_loop_rows(...) -> (rest rows, rest results)`: every row whose call is a loop step
     (conductor/tables.py `RunCall.is_loop_step`) is advanced here, any other row through the
     row-by-row path where it stands (so ready rows leave in row order, exactly as row by row);
     the rows from the first one the engine answered out of order are left to the caller.

One tight loop over the parallel lists of rows and results does, per row, only what a decode
iteration needs: the KV context, the edge actions (loop-back slots, client emissions, streams),
the token count, the stop flag, and the iteration counter; the call stays active and is re-readied
from its loop-back slots. The rows that became ready again leave as one group per walk. A row
touches the general machinery (its walk run's transitions, the conductor's pump) only when it
changes state: its loop exits (max iterations or a stop), max_tokens ends its partition, a host
loop-back value is missing, or it failed.

Rows of a `LoopStep.is_fast` call (every input on the device, at most one client edge and one
counted output: an LLM's decode iteration) take `_advance_fast`, the same effects written out in
one loop with no call per row: a call's liveness is its `is_ready` flag (walk_run.py keeps it
False once a call leaves its run), the ready rows are only their ids (one token each), and
note_tokens' bookkeeping is inlined (the partition's end stays `Conductor.end_at_tokens`). When
the call emits and counts one edge (a text LLM's decode), a row first reads every condition under
which it would leave the shape, then applies the common effects through references its call
gathered once (`ActiveCall.refs`); any other row takes the general kernel (`_fast_row`).
"""
from __future__ import annotations

from typing import Any, Optional

from mstar.runtime.conductor.request import num_tokens_of
from mstar.runtime.conductor.tables import model_stop_loop
from mstar.runtime.conductor.walk_run import EMPTY
from mstar.runtime.step import RowResult, StepRow

_MISSING: Any = object()


def advance_loop_rows(conductor, node: str, rows: list[StepRow], results: list[RowResult]):
    is_kv = node in conductor.kv_nodes
    now = conductor.clock()
    ready = _ReadyRows(conductor.ready_out, node)
    # From the first row the engine answered out of order on, the rows go row by row (matched
    # with their results by id): each kernel stops at a row whose result is another row's.
    num = min(len(rows), len(results))
    index = 0
    while index < num:
        row = rows[index]
        result = results[index]
        if result.request_id != row.request_id:
            break
        call = row.handle  # the walk position step_rows gave the row (ActiveCall)
        if call is not None and call.run.source.owner.lanes:  # its request's lanes, written back first
            conductor.lanes.detach_all(call.run.source.owner)
        step = call.step if call is not None else None
        if step is not None and step.is_fast:
            index = _advance_fast(conductor, node, step, rows, results, index, num, ready, now, is_kv)
            continue
        index += 1
        if step is None or result.error is not None or not call.is_ready:
            if call is None or call.run.active.get(node) is call:
                ready.flush()  # ready rows leave in row order, as row by row
                conductor.on_rows(node, [row], [result])
            continue  # else stale: the request, its partition or its walk moved on meanwhile
        run = call.run
        if is_kv:
            context = run.context
            context[node] = context.get(node, 0) + row.num_tokens
        if _advance_row(conductor, run, call, result, now):
            if step.needs_pump and not _is_settled(run.source.owner):
                ready.flush()
                run.new_ready.append(call)  # the pump sends it, in its partition's turn
                conductor.pump(run.source.owner, is_any_done=False)
                continue
            ready.add(row.walk, row.request_id, call.num_tokens)
        else:  # the row left the loop-step shape: its walk run moved; the pump takes it on
            _left_shape(conductor, ready, run)
    ready.flush()
    return rows[index:], results[index:]


def _advance_fast(conductor, node: str, step, rows: list[StepRow], results: list[RowResult], start: int,
                  num: int, ready: "_ReadyRows", now: float, is_kv: bool) -> int:
    """`_advance_row`'s effects on the rows from `start` on whose call takes `step` (is_fast), in
    one loop; returns the index of the first row it did not take. A row that leaves the shape
    (error, stale, loop or partition ends, stop) goes out of line, after the rows before it.

    A step that emits and counts one edge (an LLM's decode iteration) takes the steady case per
    row: every condition under which the row would leave the shape or need more than the common
    effects is read first, and only then are the effects applied through the call's `refs` (its
    KV context, partition, record, loop state and the record's column appends, gathered once per
    call). A row failing any of those reads goes through `_fast_row`, the general kernel, before
    any of its effects: the same effects in the same order as that kernel alone."""
    client_name, client_kind, counted, has_stop, device_inputs = step.fast
    is_steady = client_name is not None and counted is client_name and conductor.is_steady
    ids_append = ready.start(rows[start].walk)  # one call, one walk; one token a row (padded at flush)
    for row, result in zip(rows[start:num], results[start:num]):
        call = row.handle
        request_id = row.request_id
        if call is None or call.step is not step or result.request_id != request_id:
            ready.pad_tokens()
            # a row of another call, or answered out of order: the caller goes on from it
            return rows.index(row, start)
        if is_steady:
            refs = call.refs
            if refs is None:
                refs = call.refs = steady_refs(call, node, is_kv)
            if refs and result.error is None and call.is_ready:
                context, ps, record, loop_state, emission_times, emission_kinds, emission_values, is_token, \
                    tokens, token_times = refs
                if ps.owner.lanes:  # its request's lanes, written back before any of it is read
                    conductor.lanes.detach_all(ps.owner)
                value = result.outputs.get(client_name)
                if (type(value) is list and value and not ps.is_done and not result.is_stop
                        and call.inputs is device_inputs):
                    num_new = len(value)
                    num_tokens = ps.num_tokens + num_new
                    iteration = loop_state.iteration + 1
                    if (num_tokens < ps.max_tokens and iteration < loop_state.limit
                            and not (has_stop and loop_state.is_stop)):
                        if is_kv:
                            context[node] += row.num_tokens
                        emission_times.append(now)
                        emission_kinds.append(client_kind)
                        if num_new == 1 and type(value[0]) is int:  # as RequestRecord.add_emission
                            emission_values.append(value[0])
                            is_token.append(1)
                        else:
                            emission_values.append(value)
                            is_token.append(0)
                        tokens.extend(value)
                        token_times.append(now)
                        record.num_output_tokens += num_new
                        ps.num_tokens = num_tokens
                        loop_state.iteration = iteration
                        ids_append(request_id)
                        continue
        _fast_row(conductor, node, step, row, result, ready, now, is_kv)
        ids_append = ready.ids.append  # a row out of line may have flushed the group
    ready.pad_tokens()
    return num


def steady_refs(call, node: str, is_kv: bool):
    """What the steady case reads and appends to per row, fixed for the call's life (its run,
    partition, record and loop state never change; the record's columns are only appended to; a
    KV context entry, once there, stays). None while the call cannot take the steady case yet (no
    first token recorded, no KV context on the node yet: asked again next row); False for good
    (stop strings: every count checks the decoded tail, `Conductor.end_at_tokens`)."""
    run = call.run
    ps = run.source
    record = ps.record
    if record.request.stop_strings or record.request.logprobs is not None:  # (the second: RowResult.logprobs)
        return False
    if record.first_token_s is None or (is_kv and node not in run.context):
        return None
    return (run.context, ps, record, call.loop_state, record.emission_times_s, record.emission_kinds,
            record.emission_values, record.emission_is_token, record.output_tokens, record.token_times_s)


def _fast_row(conductor, node: str, step, row: StepRow, result: RowResult, ready: "_ReadyRows", now: float,
              is_kv: bool) -> None:
    """One row of the fast kernel, every case: its effects, then either the row is ready again
    (its id joins the group) or it leaves the shape out of line."""
    client_name, client_kind, counted, has_stop, device_inputs = step.fast
    call = row.handle
    owner = call.run.source.owner
    if owner.lanes:  # its request's lanes, written back before any of it is read
        conductor.lanes.detach_all(owner)
    if result.error is not None or not call.is_ready:
        _off_shape(conductor, node, ready, row, result)
        return
    run = call.run
    if is_kv:
        context = run.context
        context[node] = context.get(node, 0) + row.num_tokens
    ps = run.source
    record = ps.record
    outputs = result.outputs
    if client_name is not None:
        value = outputs.get(client_name, _MISSING)
        if value is not _MISSING:
            record.add_emission(now, client_kind, value)
            if record.first_token_s is None:
                record.first_token_s = now
            if result.logprobs is not None:
                record.attach_logprobs(result.logprobs, len(record.emission_values) - 1)
    if counted is not None:
        if counted is not client_name:  # the same name: `value` is already its value (or _MISSING)
            value = outputs.get(counted)
        if type(value) is list:
            if value:  # Conductor.note_tokens inlined (module docstring)
                num_tokens = len(value)
                record.output_tokens += value
                if record.first_token_s is None:
                    record.first_token_s = now
                record.token_times_s.append(now)
                record.num_output_tokens += num_tokens
                ps.num_tokens += num_tokens
                if ps.num_tokens >= ps.max_tokens or record.request.stop_strings:
                    conductor.end_at_tokens(record, ps, model_stop_loop(call.call, result))
        elif counted in outputs:  # not a list: counted by its elements (a tensor, a number)
            conductor.count(ps.owner, ps, call.call.counted, outputs, now,
                            model_stop_loop(call.call, result) if result.is_stop else None)
    loop_state = call.loop_state
    iteration = loop_state.iteration + 1  # against its limit: max_iters, or the request's own count
    if ps.is_done or result.is_stop or iteration >= loop_state.limit or (has_stop and loop_state.is_stop):
        _end_of_shape(conductor, ready, row, result, ps)
        return
    loop_state.iteration = iteration
    if call.inputs is not device_inputs:
        _next_iteration(run, call, step, loop_state)
    ready.ids.append(row.request_id)


def _off_shape(conductor, node: str, ready: "_ReadyRows", row: StepRow, result: RowResult) -> None:
    """A row the engine failed, or a stale one: a live call goes row by row (after the rows made
    ready before it); a stale row (its request, partition or walk moved on) is dropped."""
    if row.handle.run.active.get(node) is row.handle:
        ready.flush()
        conductor.on_rows(node, [row], [result])


def _end_of_shape(conductor, ready: "_ReadyRows", row: StepRow, result: RowResult, ps) -> None:
    """After its tokens were counted, a row whose partition ended, that reported a stop, or whose
    loop has no iteration left (`_advance_row`'s order): a stop marks its stop loop; a loop with
    no next iteration exits; else the row goes on like any other."""
    call = row.handle
    run = call.run
    if not ps.is_done:
        if result.is_stop and call.call.stop_loop is not None:
            _stop(run, call, result.is_length)
        step = call.step
        loop_state = call.loop_state
        if not (loop_state.iteration + 1 >= loop_state.limit or (step.has_stop and loop_state.is_stop)):
            loop_state.iteration += 1  # a stop of an outer loop: this loop goes on for now
            if call.inputs is not step.device_inputs:
                _next_iteration(run, call, step, loop_state)
            ready.ids.append(row.request_id)
            return
        _exit_loop(run, call)
    _left_shape(conductor, ready, run)


def _left_shape(conductor, ready: "_ReadyRows", run) -> None:
    """A row left the loop-step shape (its loop exited, its partition ended): the rows made ready
    so far leave first, then the conductor takes the walk run on as row by row would."""
    ready.flush()
    ps = run.source
    conductor.after_row(ps.owner, ps, run)


def _exit_loop(run, call) -> None:
    """The loop exits after this iteration (or cannot start the next from its slots alone): the
    call leaves the run's active calls and the walk run takes the transition."""
    del run.active[call.node]
    call.is_ready = False
    run.follow(call.call.then)


class _ReadyRows:
    """The rows made ready again, grouped per walk while consecutive rows share one."""

    __slots__ = ("out", "node", "walk", "ids", "tokens")

    def __init__(self, out: list, node: str):
        self.out, self.node = out, node
        self.walk: Optional[str] = None
        self.ids: list[str] = []
        self.tokens: list[int] = []

    def add(self, walk: str, request_id: str, num_tokens: int) -> None:
        self.start(walk)
        self.ids.append(request_id)
        self.tokens.append(num_tokens)

    def start(self, walk: str):
        """Rows of `walk` follow (the group so far leaves first if of another walk); returns the
        append of the ids list, valid until the next flush."""
        if walk != self.walk:
            self.flush()
            self.walk = walk
        return self.ids.append

    def pad_tokens(self) -> None:
        """Rows the fast kernel added feed one token each (inputs on the device): only their ids
        were appended."""
        if len(self.tokens) < len(self.ids):
            self.tokens.extend([1] * (len(self.ids) - len(self.tokens)))

    def flush(self) -> None:
        if self.ids:
            self.pad_tokens()
            self.out.append((self.node, self.walk, self.ids, self.tokens))
            self.ids, self.tokens = [], []


def _advance_row(conductor, run, call, result: RowResult, now: float) -> bool:
    """One loop row's result: True when the same call is ready again (the next iteration); False
    when the row left the loop-step shape (the caller has the conductor pump its request)."""
    step = call.step
    outputs = result.outputs
    ps = run.source
    record = ps.record
    logprobs = result.logprobs
    since = len(record.emission_values) if logprobs is not None else 0  # (a len a row only where asked)
    for name, kind in step.client:
        value = outputs.get(name, _MISSING)
        if value is not _MISSING:
            record.add_emission(now, kind, value)
            if record.first_token_s is None:
                record.first_token_s = now
    if logprobs is not None:
        record.attach_logprobs(logprobs, since)
    loop_state = call.loop_state
    is_missing = False if step.is_plain else _apply_edges(run, step, loop_state, outputs)
    counted = step.counted_one
    value = outputs.get(counted) if counted is not None else None
    # without a stop token the row's model stop ends no loop (model_stop_loop is None): asked only then
    stop_loop = model_stop_loop(call.call, result) if result.is_stop else None
    if type(value) is list:
        num = len(value)
        if num:
            record.output_tokens += value
            conductor.note_tokens(record, ps, num, now, stop_loop)
    elif call.call.counted:
        conductor.count(ps.owner, ps, call.call.counted, outputs, now, stop_loop)
    if ps.is_done:  # max_tokens or a stop string ended the partition (and cancelled the run)
        return False
    if result.is_stop and call.call.stop_loop is not None:
        _stop(run, call, result.is_length)
    if is_missing or loop_state.iteration + 1 >= loop_state.limit or (step.has_stop and loop_state.is_stop):
        _exit_loop(run, call)
        return False
    loop_state.iteration += 1
    if not step.is_plain or call.inputs is not step.device_inputs:
        _next_iteration(run, call, step, loop_state)
    return True


def _apply_edges(run, step, loop_state, outputs: dict) -> bool:
    """The edges besides client emissions: loop-backs into the next iteration's slots, then the
    others through the walk run. True when a host loop-back value is missing."""
    is_missing = False
    for name, slot, scope_exit, is_device in step.back:
        value = outputs.get(name, _MISSING)
        if value is _MISSING:
            if not is_device:
                is_missing = True  # a host loop-back the engine did not return
                continue
            value = None  # kept on the device
        loop_state.next_slots[slot] = value
        if scope_exit is not None:
            loop_state.latest[scope_exit] = value
    for edge in step.other:
        value = outputs.get(edge[0], _MISSING)
        if value is not _MISSING or edge[5]:
            run.apply(edge, None if value is _MISSING else value)
    return is_missing


def _is_settled(state) -> bool:
    """Would the pump do nothing for this request but send the row just made ready: no partition
    can start a walk (a stream chunk for a stream-fed one), end (streams drained) or wake a
    waiting call. Then the row joins its group, in the same order as the pump would send it."""
    for ps in state.partitions:
        if ps.is_done:
            continue
        run = ps.run
        if run is None:
            if not ps.is_self_triggered:
                return False
            for buf in ps.own_buffers:
                if buf.has_chunk():
                    return False
            if ps.is_drained():
                return False
        elif run.waiting or run.new_ready:
            return False
    return True


def _stop(run, call, is_length: bool) -> None:
    """A row reported a stop: its innermost stop loop ends after this iteration."""
    run.mark_stop(call.call.stop_loop, is_length)


def _next_iteration(run, call, step, loop_state) -> None:
    """Open the loop's next iteration (the counter already moved): empty the slots the body
    fills, move the loop-backs in, and re-ready the same call from its slots."""
    slots = run.slots
    for slot in step.cleared:
        slots[slot] = EMPTY
    next_slots = loop_state.next_slots
    if step.is_plain:
        for _, slot, _, _ in step.back:  # loop-backs on the device: None, never sent
            slots[slot] = None
    for slot, value in next_slots.items():
        slots[slot] = value
    next_slots.clear()
    if step.device_inputs is not None:
        # Every input stays on the device: the same (read-only) inputs each iteration.
        call.inputs = step.device_inputs
        call.num_tokens = 1
        return
    inputs = {name: slots[input_slots[0]] for name, input_slots, _, _ in call.call.inputs}
    call.inputs = inputs
    if len(inputs) == 1:
        call.num_tokens = num_tokens_of(next(iter(inputs.values())))
    else:
        call.num_tokens = max(map(num_tokens_of, inputs.values()), default=1)
