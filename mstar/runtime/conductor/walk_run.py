"""One walk of one request: a position in the walk's tables plus small arrays.

In: a `RunWalk` (conductor/tables.py), and an `InputSource` that answers for inputs no slot
holds (stream chunks, persisted values, the prompt, media). Out: calls that became ready
(`WalkRun.new_ready`, drained by the conductor), edge values that leave the walk (`OutputSink`),
and `is_done` once the walk's end is reached.

State: the value slots, the active calls (node -> `ActiveCall`), the join counters, and per loop
its iteration, stop flag, next-iteration slots (loop-backs), held outputs, accumulated lists and
last loop-back values (for loop outputs only loop-backs produce).

Semantics (reference notes 0.1, 0.2), now decided by the compiler and only followed here:
- a "start" enters loops (iteration 0, fresh state), arms joins and activates calls; a call is
  ready once every input has a value (the first filled slot of its input, else the outside
  source; a stream input waits for a chunk, a waiting input for its slot);
- a finished call applies each edge's action (slot, loop-back, loop exit, sink), then follows its
  `then`: the next calls, a join (the parallel ends when every member has), an iteration end (the
  loop exits after its limit - max_iters, or the request's own count for a loop with a count
  param - iterations, or after the iteration in which a row of it reported a
  stop, for loops with has_stop), or the walk's end;
- a new iteration empties the slots the body fills and moves the loop-backs into their slots;
  an exiting loop hands on its outputs (the final value), accumulated lists and loop outputs that
  only loop-backs produced; the final iteration's loop-backs are dropped.
"""
from __future__ import annotations

from typing import Any, Optional, Protocol

from mstar.plan.schema import EdgePlan
from mstar.runtime.conductor.request import num_tokens_of
from mstar.runtime.conductor.tables import (
    JOIN, LOOP_BACK, LOOP_END, LOOP_OUTPUT, SINK, SLOT, START, STREAM, RunCall, RunNext, RunWalk,
)


class InputSource(Protocol):
    """What the conductor answers for inputs no slot of the walk run holds."""

    def can_supply(self, name: str, source: int) -> bool: ...

    def take(self, name: str, source: int) -> Any: ...


class OutputSink(Protocol):
    """Receives edges that leave the walk run (conductor, client, stream; persisted values)."""

    def deliver(self, edge: EdgePlan, value: Any) -> None: ...


class WalkStateError(Exception):
    """A result that does not fit the walk's state (a bug in the caller or the plan)."""


# An empty slot. Slots hold any value a row produced, None included (a value kept on the device).
EMPTY: Any = object()


class ActiveCall:
    """A call of the walk that has been reached and has not completed yet. `is_ready` is True
    exactly while the call is in its run's `active` with every input in hand: a call that left
    `active` (completed, its loop exited, its run cancelled) is never ready again, so a step's
    row can be checked for liveness by that flag alone."""

    __slots__ = ("call", "node", "run", "step", "loop_state", "inputs", "is_ready", "num_tokens", "num_fed",
                 "refs", "lane", "lanes")

    def __init__(self, call: RunCall, run: "WalkRun"):
        self.call = call
        self.node = call.node
        self.run = run
        self.step = call.loop_step  # conductor/tables.py LoopStep, None when not a loop step
        # The state of the call's loop: activated after its loop was entered, so this is the
        # iteration's loop (a loop entered again makes new active calls).
        self.loop_state = run.loops[call.loop] if call.loop is not None else None
        self.inputs: dict[str, Any] = {}
        self.is_ready = False
        self.num_tokens = 1  # tokens the row feeds: the largest over its inputs, 1 without any
        self.num_fed = 0  # of those, tokens earlier chunks already fed (a prompt cut by the scheduler)
        # What the loop pass's steady case touches per row, gathered once (loop_pass._steady_refs):
        # None until then, False when the call never takes the steady case.
        self.refs: Any = None
        # Its decode lane while it holds one (conductor/lanes.py: the lane and the table), else None.
        self.lane: Optional[int] = None
        self.lanes: Any = None


class _LoopState:
    __slots__ = ("iteration", "limit", "is_stop", "next_slots", "held", "accumulated", "latest")

    def __init__(self, limit: int) -> None:
        self.iteration = 0
        self.limit = limit  # iterations this request runs: the loop's max, or the request's count
        self.is_stop = False
        self.next_slots: dict[int, Any] = {}  # slot -> loop-back value for the next iteration
        self.held: dict[int, Any] = {}  # exit -> the last value (outputs)
        self.accumulated: dict[int, list] = {}  # exit -> every iteration's value
        self.latest: dict[int, Any] = {}  # scope exit -> the last loop-back value of its name


class WalkRun:
    """The state of one walk for one request (one partition's current stage)."""

    def __init__(self, walk: RunWalk, source: InputSource, sink: OutputSink,
                 loop_counts: Optional[dict[str, int]] = None):
        """loop_counts: the request's own loop counts by param (Request.loop_counts)."""
        self.walk = walk
        self.limits = walk.loop_limits(loop_counts or {})
        self.name = walk.name
        self.source = source
        self.sink = sink
        self.slots: list[Any] = [EMPTY] * walk.num_slots
        self.loops: list[Optional[_LoopState]] = [None] * len(walk.loops)
        self.joins: list[int] = [0] * len(walk.joins)
        self.active: dict[str, ActiveCall] = {}  # node -> its active call
        self.waiting: list[ActiveCall] = []
        self.new_ready: list[ActiveCall] = []
        self.is_done = False
        # A loop with a stop condition ran out of iterations before its stop, or the engine stopped
        # it at a limit (RowResult.is_length: the node sampled the request's max_tokens): the output
        # was cut, so the request ends "length".
        self.is_cut = False
        self.context: dict[str, int] = {}  # the request's KV context per node (set by its partition)

    def start(self) -> None:
        self.follow(self.walk.start)

    def cancel(self) -> None:
        """Stop: nothing of this run becomes ready or completes any more."""
        self.waiting.clear()
        for active in self.active.values():
            if active.lanes is not None:  # written back (the conductor frees lanes before this)
                active.lanes.detach(active)
            active.is_ready = False  # a call left `active`: never ready again (the loop pass reads this)
        self.active.clear()

    def loop_iteration(self, loop: Optional[int]) -> int:
        state = self.loops[loop] if loop is not None else None
        return state.iteration if state is not None else 0

    # ------------------------------------------------------------ transitions

    def follow(self, then: RunNext) -> None:
        """Apply a transition (and whatever it completes in turn)."""
        while True:
            kind = then.kind
            if kind == START:
                for loop in then.loops:
                    self.loops[loop] = _LoopState(self.limits[loop])
                for join in then.joins:
                    self.joins[join] = self.walk.joins[join][0]
                for index in then.calls:
                    self.activate(self.walk.calls[index])
                return
            if kind == JOIN:
                self.joins[then.target] -= 1
                if self.joins[then.target] != 0:
                    return
                then = self.walk.joins[then.target][1]
            elif kind == LOOP_END:
                loop = then.target
                then = self.end_iteration(loop)
            else:
                self.is_done = True
                return

    def end_iteration(self, loop: int) -> RunNext:
        """Close an iteration of `loop`: the transition that follows (its body again, or its exit)."""
        plan = self.walk.loops[loop]
        state = self.loops[loop]
        if state is None:
            raise WalkStateError(f"walk {self.name}: an iteration of loop {plan.name} ends while it is not running")
        if plan.has_stop and state.is_stop:
            self.exit_loop(loop, state)
            return plan.then
        if state.iteration + 1 >= state.limit:
            self.is_cut = self.is_cut or plan.has_stop
            self.exit_loop(loop, state)
            return plan.then
        state.iteration += 1
        slots = self.slots
        for slot in plan.cleared:
            slots[slot] = EMPTY
        for slot, value in state.next_slots.items():
            slots[slot] = value
        state.next_slots.clear()
        return plan.body

    def exit_loop(self, loop: int, state: _LoopState) -> None:
        """Leave `loop` (its running `state`): hand on its outputs, accumulated lists and scope values."""
        self.loops[loop] = None
        for index, (kind, _, onward, slot) in enumerate(self.walk.loops[loop].exits):
            if kind == "output":
                if index in state.held:
                    self.apply(onward, state.held[index])
            elif kind == "accumulate":
                if index in state.accumulated:
                    self.apply(onward, state.accumulated[index])
            elif index in state.latest:
                self.slots[slot] = state.latest[index]

    # ------------------------------------------------------------ readiness

    def activate(self, call: RunCall) -> None:
        if call.node in self.active:
            raise WalkStateError(f"walk {self.name}: node {call.node} is called twice at once")
        active = self.active[call.node] = ActiveCall(call, self)
        if not self.try_ready(active):
            self.waiting.append(active)

    def try_ready(self, active: ActiveCall) -> bool:
        slots = self.slots
        source = self.source
        inputs = {}
        outside = None
        for name, input_slots, is_wait, kind in active.call.inputs:
            for slot in input_slots:
                value = slots[slot]
                if value is not EMPTY:
                    inputs[name] = value
                    break
            else:
                if is_wait or (kind == STREAM and not source.can_supply(name, kind)):
                    return False
                if outside is None:
                    outside = []
                outside.append((name, kind))
        if outside is not None:
            # Taken only once every input can be had (a stream chunk is consumed by take).
            for name, kind in outside:
                inputs[name] = source.take(name, kind)
            inputs = {name: inputs[name] for name, _, _, _ in active.call.inputs}
        active.inputs = inputs
        if len(inputs) == 1:
            active.num_tokens = num_tokens_of(next(iter(inputs.values())))
        elif inputs:
            active.num_tokens = max(map(num_tokens_of, inputs.values()))
        active.is_ready = True
        self.new_ready.append(active)
        return True

    def retry_waiting(self) -> None:
        """Inputs may have arrived (stream chunks, persisted values): re-check waiting calls."""
        if self.waiting:
            self.waiting = [call for call in self.waiting if not self.try_ready(call)]

    # ------------------------------------------------------------ results

    def apply(self, edge: tuple, value: Any) -> None:
        """One edge action (conductor/tables.py `edge_entry`) on a value."""
        _, action, slot, loop, exit_index, _, is_persist, plan, scope_exit = edge
        if action == SINK:
            self.sink.deliver(plan, value)
        elif action == SLOT:
            self.slots[slot] = value
            if is_persist:
                self.sink.deliver(plan, value)
        elif action == LOOP_BACK:
            state = self.loops[loop]
            if state is None:
                raise WalkStateError(f"walk {self.name}: loop-back edge {plan.name} outside its loop")
            state.next_slots[slot] = value
            if scope_exit is not None:
                state.latest[scope_exit] = value
        else:
            state = self.loops[loop]
            if state is None:
                raise WalkStateError(f"walk {self.name}: edge {plan.name} leaves a loop that is not running")
            if action == LOOP_OUTPUT:
                state.held[exit_index] = value
            else:
                state.accumulated.setdefault(exit_index, []).append(value)

    def complete(self, node: str, outputs: dict[str, Any], is_stop: bool, is_length: bool = False) -> None:
        """The ready call of `node` ran: apply its edge actions and follow its transition (a stop
        that was a limit, `is_length`, marks the run cut)."""
        active = self.active.pop(node, None)
        if active is None or not active.is_ready:
            raise WalkStateError(f"walk {self.name}: no ready call of node {node}")
        active.is_ready = False
        call = active.call
        for edge in call.edges:
            name = edge[0]
            if name in outputs:
                value = outputs[name]
            elif edge[5]:  # is_device: the value stays on the device; the engine keeps it
                value = None
            else:
                continue
            self.apply(edge, value)
        if is_stop and call.stop_loop is not None:
            self.mark_stop(call.stop_loop, is_length)
        self.follow(call.then)

    def mark_stop(self, loop: int, is_length: bool) -> None:
        """A row of `loop` reported a stop: the loop ends after this iteration, and the run is cut
        when the stop was a limit (`RowResult.is_length`)."""
        state = self.loops[loop]
        if state is not None:
            state.is_stop = True
            self.is_cut = self.is_cut or is_length
