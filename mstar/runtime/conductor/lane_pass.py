"""Post-process of a step whose engine answered in columns: its laned rows advanced at once.

In:  the conductor, the node, the step's rows and row results, the engine's columns
     (`StepResult.token_ids`: one sampled token id per row, in row order; `stop_rows`: the rows
     that reported a stop) and the step's `LaneRows` (conductor/lanes.py, from step building).
Out: `advance_step(...)`: every laned row that is a common one (its lane is still its call's, it
     did not stop, its lane has room) moves by one iteration in a few array operations and
     leaves ready in one group; every other row goes through the loop pass (conductor/
     loop_pass.py) where it stands, so ready rows and every other effect come in row order,
     exactly as row by row. Afterwards each row of the loop pass whose call can take a lane
     gets one.
"""
from __future__ import annotations

from typing import Any, Optional

import numpy as np

from mstar.runtime.conductor.lanes import LaneRows
from mstar.runtime.step import RowResult, StepRow


def advance_step(conductor, node: str, rows: list[StepRow], results: list[RowResult], token_ids: Any,
                 stop_rows: list[int], lane_rows: Optional[LaneRows]) -> None:
    num = len(rows)
    if lane_rows is None:
        _general(conductor, node, rows, results)
        return
    lanes = conductor.lanes
    at = lane_rows.at
    # The common decode step: every row laned (of one walk) and common.
    if (at is None and not stop_rows and lane_rows.walk is not None
            and lanes.advance_all(lane_rows, token_ids, conductor.clock())):
        conductor.ready_out.append((node, lane_rows.walk, lane_rows.ids, [1] * num))
        return
    is_good, head = lanes.check(lane_rows)
    # Some rows are not common ones: the common ones move at once, the others in row order.
    is_row_good = np.zeros(num, dtype=bool)
    if at is None:
        is_row_good[:] = is_good
    else:
        is_row_good[at] = is_good
    if stop_rows:
        is_row_good[stop_rows] = False
    good = np.flatnonzero(is_row_good)
    if good.size:
        keep = good if at is None else is_row_good[at]  # the common rows among the laned ones
        lanes.advance(lane_rows.lanes[keep], head[keep], np.asarray(token_ids)[good], conductor.clock())
    _interleave(conductor, node, rows, results, lane_rows, np.flatnonzero(~is_row_good).tolist())


def _interleave(conductor, node: str, rows: list[StepRow], results: list[RowResult], lane_rows: LaneRows,
                bad: list[int]) -> None:
    """The common rows leave ready in groups between the other rows, each run of those going
    through the loop pass where it stands."""
    start = 0
    index = 0
    while index < len(bad):
        first = bad[index]
        last = first + 1
        index += 1
        while index < len(bad) and bad[index] == last:
            last += 1
            index += 1
        _ready(conductor, node, rows, lane_rows, start, first)
        _general(conductor, node, rows[first:last], results[first:last])
        start = last
    _ready(conductor, node, rows, lane_rows, start, len(rows))


def _ready(conductor, node: str, rows: list[StepRow], lane_rows: LaneRows, start: int, stop: int) -> None:
    """Common rows start..stop leave ready: one group, or one per run of a walk when the laned
    rows are of several walks."""
    if start >= stop:
        return
    ids, out = lane_rows.ids, conductor.ready_out
    if lane_rows.walk is not None:
        out.append((node, lane_rows.walk, ids[start:stop], [1] * (stop - start)))
        return
    first = start
    for index in range(start + 1, stop + 1):
        if index == stop or rows[index].walk != rows[first].walk:
            out.append((node, rows[first].walk, ids[first:index], [1] * (index - first)))
            first = index


def _general(conductor, node: str, rows: list[StepRow], results: list[RowResult]) -> None:
    """Rows through the loop pass (which frees the lanes of every request it touches), then a
    lane for each row's call that can take one."""
    conductor.advance_rows(node, rows, results)
    is_kv = node in conductor.kv_nodes
    for row in rows:
        call = row.handle
        if call is not None and call.lane is None and call.is_ready:
            step: Any = call.step
            if step is not None and step.is_fast:
                conductor.try_lane(call, node, is_kv)
