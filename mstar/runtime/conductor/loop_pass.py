"""Post-process of a step's loop rows in one pass (the common case: a decode step).

In:  the conductor, the node, the step's rows and the engine's row results (in row order).
Out: `advance_loop_rows(...) -> (rest rows, rest results)`: every row whose call is a loop step
     (conductor/tables.py `RunCall.is_loop_step`) is advanced here; the others, and every row
     from the first one the engine answered out of order, are left to the row-by-row path.

One tight loop over the parallel lists of rows and results does, per row, only what a decode
iteration needs: the KV context, the edge actions (loop-back slots, client emissions, streams),
the token count, the stop flag, and the iteration counter; the call stays active and is re-readied
from its loop-back slots. The rows that became ready again leave as one group per walk. A row
touches the general machinery (its walk run's transitions, the conductor's pump) only when it
changes state: its loop exits (max iterations or a stop), max_tokens ends its partition, a host
loop-back value is missing, or it failed.
"""
from __future__ import annotations

from typing import Any

from mstar.runtime.conductor.request import Emission, num_tokens_of
from mstar.runtime.conductor.tables import LOOP_BACK, SINK
from mstar.runtime.conductor.walk_run import EMPTY
from mstar.runtime.step import RowResult, StepRow

_MISSING: Any = object()


def advance_loop_rows(conductor, node: str, rows: list[StepRow], results: list[RowResult]):
    active = conductor.active
    is_kv = node in conductor.kv_nodes
    now = conductor.clock()
    rest_rows: list[StepRow] = []
    rest_results: list[RowResult] = []
    ready: dict[str, tuple[list[str], list[int]]] = {}
    num = min(len(rows), len(results))
    index = 0
    while index < num:
        row = rows[index]
        result = results[index]
        request_id = row.request_id
        if result.request_id != request_id:
            break  # answered out of order: the rest go row by row (they match results by id)
        index += 1
        state = active.get(request_id)
        if state is None:
            continue  # the request ended meanwhile: a stale row
        ps = state.by_walk.get(row.walk)
        run = ps.run if ps is not None else None
        if run is None or run.name != row.walk:
            continue  # its partition moved on: a stale row
        call = run.active.get(node)
        if call is None:
            continue
        if result.error is not None or not call.call.is_loop_step or not call.is_ready:
            rest_rows.append(row)
            rest_results.append(result)
            continue
        if is_kv:
            context = state.context
            context[node] = context.get(node, 0) + row.num_tokens
        if _advance_row(conductor, state, ps, run, call, result, now):
            group = ready.get(row.walk)
            if group is None:
                group = ready[row.walk] = ([], [])
            group[0].append(request_id)
            group[1].append(call.num_tokens)
    for walk, (request_ids, num_tokens) in ready.items():
        conductor.ready_out.append((node, walk, request_ids, num_tokens))
    if index < len(rows) or index < len(results):
        rest_rows.extend(rows[index:])
        rest_results.extend(results[index:])
    return rest_rows, rest_results


def _advance_row(conductor, state, ps, run, call, result: RowResult, now: float) -> bool:
    """One loop row's result: True when the same call is ready again (the next iteration); False
    when the row left the loop-step shape (handled through its walk run and the pump)."""
    run_call = call.call
    outputs = result.outputs
    loop = run_call.loop
    loop_state = run.loops[loop]
    next_slots = loop_state.next_slots
    is_missing = False
    for edge in run_call.edges:
        value = outputs.get(edge[0], _MISSING)
        if value is _MISSING:
            if not edge[5]:
                is_missing = is_missing or edge[1] == LOOP_BACK  # a host loop-back not returned
                continue
            value = None  # kept on the device
        if edge[1] == LOOP_BACK and edge[3] == loop:
            next_slots[edge[2]] = value
            if edge[8] is not None:
                loop_state.latest[edge[8]] = value
        elif edge[1] == SINK and edge[7].dest_kind == "client" and not edge[6]:
            record = ps.record
            record.emissions.append(Emission(now, edge[0], edge[7].modality, value))
            if record.first_token_s is None:
                record.first_token_s = now
        else:
            run.apply(edge, value)
    run.num_calls_done += 1
    if run_call.counted:
        conductor.count(state, ps, run_call.counted, outputs, now)
        if ps.is_done:  # max_tokens ended the partition (and cancelled the run)
            conductor.after_row(state, ps, run)
            return False
    if result.is_stop and run_call.stop_loop is not None and run.loops[run_call.stop_loop] is not None:
        run.loops[run_call.stop_loop].is_stop = True
    loop_plan = run.walk.loops[loop]
    if is_missing or loop_state.iteration + 1 >= loop_plan.max_iters or (loop_plan.has_stop and loop_state.is_stop):
        # The loop exits (or its next iteration cannot start from its slots alone): the walk run
        # takes the transition and the conductor pumps the request.
        del run.active[run_call.node]
        run.follow(run_call.then)
        conductor.after_row(state, ps, run)
        return False
    loop_state.iteration += 1
    slots = run.slots
    for slot in loop_plan.cleared:
        slots[slot] = EMPTY
    for slot, value in next_slots.items():
        slots[slot] = value
    next_slots.clear()
    inputs = {name: slots[input_slots[0]] for name, input_slots, _, _ in run_call.inputs}
    call.inputs = inputs
    if len(inputs) == 1:
        call.num_tokens = num_tokens_of(next(iter(inputs.values())))
    else:
        call.num_tokens = max(map(num_tokens_of, inputs.values()), default=1)
    return True
