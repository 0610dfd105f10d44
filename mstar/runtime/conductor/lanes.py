"""Decode lanes: the walk state of calls in the steady decode shape, held in arrays.

In:  calls that take the loop pass's steady case (conductor/loop_pass.py: a fast loop step that
     emits and counts one edge, an LLM's decode iteration) once they ran an iteration there;
     per step, the lanes of its rows and the token ids the engine sampled for them.
Out: `Lanes`: `attach(call, ...)` gives a call a lane, `advance(...)` moves every lane of a step
     by one iteration with a few array operations (no Python per row), `sync(call)` writes a
     lane back into its walk run, partition and request record, `detach(call)` syncs and frees
     it; `rows_of(...)` answers a step's laned rows' loop iterations and KV contexts.

While a call holds a lane, the lane is the truth for what a steady decode row moves: `pos`, the
steady iterations since the lane's base (the walk run's loop iteration, the partition's counted
tokens, the request's output tokens and the KV context of a kv node each moved by one per
iteration, all `pos` behind in the Python objects), and the tokens and times of those iterations
(`tokens`, `times`: not yet in the record's columns). Its room is how many iterations the lane
may take from its base before a row of it must go the general way: the one that reaches
max_tokens or the loop's last iteration (its effects are more than the common ones), or fills
its buffers.

The conductor detaches every lane of a request before any other code reads or writes that
request's state (its row-by-row path, pump, failure, the step building of its other calls) and
syncs every lane before anyone outside reads records (`Conductor.sync_lanes`): the Python objects
are then exactly what the row-by-row path would have made. A lane's `serial` changes whenever it
is given out or freed, so a step built before that (a speculative step N+1) sees its row's lane
is no longer its call's.
"""
from __future__ import annotations

from typing import Any, Optional

import numpy as np

# Steady iterations a lane buffers before a row of it syncs (a decode output of 2000 tokens
# syncs about eight times; a row that syncs goes the general way once).
WIDTH = 256
_INITIAL_LANES = 64


class LaneRows:
    """The laned rows of one built step (Conductor.build_step): their lanes and serials then
    (arrays, in row order), how many lanes had been freed then (while none was since, every
    serial still holds), the row index of each (None when every row of the step is laned), the
    request id of every row of the step, and the one walk of the laned rows (None when they are
    of several walks: the step then goes row by row)."""

    __slots__ = ("lanes", "serials", "num_frees", "at", "ids", "walk")

    def __init__(self, lanes: np.ndarray, serials: np.ndarray, num_frees: int, at: Optional[list[int]],
                 ids: list[str], walk: Optional[str]):
        self.lanes, self.serials, self.num_frees = lanes, serials, num_frees
        self.at, self.ids, self.walk = at, ids, walk


class Lanes:
    """The lanes' arrays. A lane's buffers are one block of WIDTH entries of the flat `tokens`
    and `times`; `head[lane]` is the flat index its next iteration writes (its base is the
    block's start, so `pos` = head - lane * WIDTH) and `end[lane]` the block's start plus its
    room, so a row is a common one while head < end."""

    def __init__(self) -> None:
        self.width = WIDTH
        self.num_lanes = 0
        self.head = np.zeros(0, dtype=np.int64)
        self.end = np.zeros(0, dtype=np.int64)
        self.serial = np.zeros(0, dtype=np.int64)
        # at the lane's base: its call's loop iteration and KV context, and its loop's limit
        self.iteration = np.zeros(0, dtype=np.int64)
        self.context = np.zeros(0, dtype=np.int64)
        self.limit = np.zeros(0, dtype=np.int64)
        # per lane: the iteration whose token is the request's last (max_tokens): no row goes on past it
        self.last_token = np.zeros(0, dtype=np.int64)
        self.tokens = np.zeros(0, dtype=np.int64)
        self.times = np.zeros(0, dtype=np.float64)
        self.calls: list[Any] = []  # lane -> its ActiveCall (None when free)
        self.nodes: list[Optional[str]] = []  # lane -> the kv node whose context it moves (None: stateless)
        self.kinds: list[Any] = []  # lane -> the (edge, modality) of its client emission
        self.free: list[int] = []
        self.num_serials = 0  # lanes given out so far
        self.num_frees = 0  # lanes freed so far
        self.num_attached = 0
        self._grow(_INITIAL_LANES)

    def _grow(self, num: int) -> None:
        old, width = self.num_lanes, self.width
        starts = np.arange(old, old + num, dtype=np.int64) * width
        self.head = np.concatenate([self.head, starts])
        self.end = np.concatenate([self.end, starts])
        self.serial = np.concatenate([self.serial, np.zeros(num, dtype=np.int64)])
        self.iteration = np.concatenate([self.iteration, np.zeros(num, dtype=np.int64)])
        self.context = np.concatenate([self.context, np.zeros(num, dtype=np.int64)])
        self.limit = np.concatenate([self.limit, np.zeros(num, dtype=np.int64)])
        self.last_token = np.concatenate([self.last_token, np.zeros(num, dtype=np.int64)])
        self.tokens = np.concatenate([self.tokens, np.zeros(num * width, dtype=np.int64)])
        self.times = np.concatenate([self.times, np.zeros(num * width, dtype=np.float64)])
        self.calls.extend([None] * num)
        self.nodes.extend([None] * num)
        self.kinds.extend([None] * num)
        self.num_lanes = old + num
        self.free.extend(range(self.num_lanes - 1, old - 1, -1))  # lowest lanes first

    # ------------------------------------------------------------ a lane's life

    def attach(self, call: Any, owner: Any, node: Optional[str], kind: Any) -> None:
        """Give `call` (in the steady shape, `call.refs` gathered) a lane. owner: its request's
        conductor state (its `lanes` list names the request's laned calls); node: the kv node
        whose KV context the call moves, None for a stateless node; kind: its client emission's
        (edge, modality)."""
        room = _room_of(call, self.width)
        if room <= 0:
            return  # its next row is not a common one: nothing to gain
        if not self.free:
            self._grow(self.num_lanes)
        lane = self.free.pop()
        self.num_serials += 1
        self.serial[lane] = self.num_serials
        start = lane * self.width
        self.head[lane] = start
        self.end[lane] = start + room
        self._base(lane, call)
        self.calls[lane] = call
        self.nodes[lane] = node
        self.kinds[lane] = kind
        call.lane = lane
        call.lanes = self
        owner.lanes.append(call)
        self.num_attached += 1

    def sync(self, call: Any) -> None:
        """Write the lane's iterations since its base into the call's walk run, partition and
        record (what the row-by-row path would hold now); the lane stays, based there."""
        lane = call.lane
        start = lane * self.width
        num = int(self.head[lane]) - start
        if num:
            context, ps, record, loop_state, emission_times, emission_kinds, emission_values, is_token, \
                tokens, token_times = call.refs
            ids = self.tokens[start:start + num].tolist()
            times = self.times[start:start + num].tolist()
            emission_times.extend(times)
            emission_kinds.extend([self.kinds[lane]] * num)
            emission_values.extend(ids)  # one-token emissions, kept as ints (RequestRecord)
            is_token.extend(b"\x01" * num)
            tokens.extend(ids)
            token_times.extend(times)
            record.num_output_tokens += num
            ps.num_tokens += num
            loop_state.iteration += num
            node = self.nodes[lane]
            if node is not None:
                context[node] += num
            self.head[lane] = start
            self._base(lane, call)
        self.end[lane] = start + _room_of(call, self.width)

    def _base(self, lane: int, call: Any) -> None:
        loop_state = call.loop_state
        self.iteration[lane] = loop_state.iteration
        self.context[lane] = call.run.context.get(call.node, 0)
        self.limit[lane] = loop_state.limit
        partition = call.run.source  # each steady iteration adds one counted token
        self.last_token[lane] = loop_state.iteration + partition.max_tokens - partition.num_tokens

    def detach(self, call: Any) -> None:
        """Sync the call's lane and free it (the call leaves the steady shape, or its request is
        about to be touched by the general machinery)."""
        self.sync(call)
        lane = call.lane
        self.serial[lane] = 0  # no step row carries serial 0: rows built before now go the general way
        self.end[lane] = self.head[lane]
        self.calls[lane] = None
        self.kinds[lane] = None
        self.free.append(lane)
        self.num_frees += 1
        call.lane = None
        call.lanes = None
        call.run.source.owner.lanes.remove(call)
        self.num_attached -= 1

    def detach_all(self, owner: Any) -> None:
        """Every lane of one request (its conductor state `owner`)."""
        for call in list(owner.lanes):
            self.detach(call)

    def sync_all(self) -> None:
        """Every attached lane written back (records complete for a reader outside the conductor)."""
        if self.num_attached:
            for call in self.calls:
                if call is not None:
                    self.sync(call)

    # ------------------------------------------------------------ a step's rows

    def rows_of(self, lanes: np.ndarray, moves_context: bool) -> tuple[list[int], list[int], list[int], list[bool]]:
        """Step building's values of the lanes' rows: each one's loop iteration, KV context (moved
        by one an iteration on a kv node), loop limit, and whether its loop goes on after it (its loop
        limit and its request's max_tokens both leave room for another iteration)."""
        pos = self.head[lanes] - lanes * self.width
        iterations = self.iteration[lanes] + pos
        contexts = self.context[lanes] + pos if moves_context else self.context[lanes]
        limits = self.limit[lanes]
        is_continuing = (iterations + 1 < limits) & (iterations + 1 < self.last_token[lanes])
        return iterations.tolist(), contexts.tolist(), limits.tolist(), is_continuing.tolist()

    def advance_all(self, rows: LaneRows, token_ids: Any, now: float) -> bool:
        """Every row of the step laned and common (its lane still its call's, room left): one
        iteration of each, its token and time buffered; True. Else nothing done: False."""
        lanes = rows.lanes
        head = self.head[lanes]
        if not (head < self.end[lanes]).all():
            return False
        if rows.num_frees != self.num_frees and not (self.serial[lanes] == rows.serials).all():
            return False
        self.tokens[head] = token_ids
        self.times[head] = now
        self.head[lanes] = head + 1
        return True

    def check(self, rows: LaneRows) -> tuple[np.ndarray, np.ndarray]:
        """Per laned row of a step: True where its lane is still its call's and the row is a
        common one; and the lanes' heads."""
        lanes = rows.lanes
        head = self.head[lanes]
        is_good = head < self.end[lanes]
        if rows.num_frees != self.num_frees:
            is_good &= self.serial[lanes] == rows.serials
        return is_good, head

    def advance(self, lanes: np.ndarray, head: np.ndarray, token_ids: Any, now: float) -> None:
        """One steady iteration of each lane (distinct lanes): its token and time buffered."""
        self.tokens[head] = token_ids
        self.times[head] = now
        self.head[lanes] = head + 1


def _room_of(call: Any, width: int) -> int:
    """Steady iterations the call may take from its state now: each adds one token and one
    iteration, and the one that reaches max_tokens or the loop's limit is not a common one."""
    ps = call.run.source
    loop_state = call.loop_state
    return min(ps.max_tokens - ps.num_tokens, loop_state.limit - loop_state.iteration, width + 1) - 1
