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
"""
from __future__ import annotations

from typing import Any, Optional

from mstar.runtime.conductor.request import num_tokens_of
from mstar.runtime.conductor.walk_run import EMPTY
from mstar.runtime.step import RowResult, StepRow

_MISSING: Any = object()


def advance_loop_rows(conductor, node: str, rows: list[StepRow], results: list[RowResult]):
    is_kv = node in conductor.kv_nodes
    now = conductor.clock()
    ready = _ReadyRows(conductor.ready_out, node)
    num = min(len(rows), len(results))
    index = 0
    while index < num:
        row = rows[index]
        result = results[index]
        if result.request_id != row.request_id:
            break  # answered out of order: the rest go row by row (they match results by id)
        index += 1
        call = row.handle  # the walk position step_rows gave the row (ActiveCall)
        if call is None or call.step is None or result.error is not None or not call.is_ready:
            if call is None or call.run.active.get(node) is call:
                ready.flush()  # ready rows leave in row order, as row by row
                conductor.on_rows(node, [row], [result])
            continue  # else stale: the request, its partition or its walk moved on meanwhile
        run = call.run
        if run.active.get(node) is not call:
            continue
        if is_kv:
            context = run.context
            context[node] = context.get(node, 0) + row.num_tokens
        if _advance_row(conductor, run, call, result, now):
            if call.step.needs_pump and not _is_settled(run.source.owner):
                ready.flush()
                run.new_ready.append(call)  # the pump sends it, in its partition's turn
                conductor.pump(run.source.owner, is_any_done=False)
                continue
            if row.walk != ready.walk:
                ready.start(row.walk)
            ready.ids.append(row.request_id)
            ready.tokens.append(call.num_tokens)
        else:  # the row left the loop-step shape: its walk run moved; the pump takes it on
            ready.flush()
            ps = run.source
            conductor.after_row(ps.owner, ps, run)
    ready.flush()
    return rows[index:], results[index:]


class _ReadyRows:
    """The rows made ready again, grouped per walk while consecutive rows share one."""

    __slots__ = ("out", "node", "walk", "ids", "tokens")

    def __init__(self, out: list, node: str):
        self.out, self.node = out, node
        self.walk: Optional[str] = None
        self.ids: list[str] = []
        self.tokens: list[int] = []

    def start(self, walk: str) -> None:
        """Rows of another walk follow: the group so far leaves first."""
        self.flush()
        self.walk = walk

    def flush(self) -> None:
        if self.ids:
            self.out.append((self.node, self.walk, self.ids, self.tokens))
            self.ids, self.tokens = [], []


def _advance_row(conductor, run, call, result: RowResult, now: float) -> bool:
    """One loop row's result: True when the same call is ready again (the next iteration); False
    when the row left the loop-step shape (the caller has the conductor pump its request)."""
    step = call.step
    outputs = result.outputs
    ps = run.source
    record = ps.record
    for name, kind in step.client:
        value = outputs.get(name, _MISSING)
        if value is not _MISSING:
            record.emission_times_s.append(now)
            record.emission_kinds.append(kind)
            record.emission_values.append(value)
            if record.first_token_s is None:
                record.first_token_s = now
    loop_state = call.loop_state
    is_missing = False if step.is_plain else _apply_edges(run, step, loop_state, outputs)
    run.num_calls_done += 1
    counted = step.counted_one
    value = outputs.get(counted) if counted is not None else None
    if type(value) is list:
        num = len(value)
        if num:
            record.output_tokens += value
            conductor.note_tokens(record, ps, num, now)
    elif call.call.counted:
        conductor.count(ps.owner, ps, call.call.counted, outputs, now)
    if ps.is_done:  # max_tokens or a stop string ended the partition (and cancelled the run)
        return False
    if result.is_stop and call.call.stop_loop is not None:
        _stop(run, call)
    if is_missing or loop_state.iteration + 1 >= step.max_iters or (step.has_stop and loop_state.is_stop):
        # The loop exits (or its next iteration cannot start from its slots alone): the walk run
        # takes the transition.
        del run.active[call.node]
        run.follow(call.call.then)
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


def _stop(run, call) -> None:
    """A row reported a stop: its innermost stop loop ends after this iteration."""
    state = run.loops[call.call.stop_loop]
    if state is not None:
        state.is_stop = True


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
