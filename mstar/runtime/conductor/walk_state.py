"""One walk of one request, interpreted: the plan's section tree as a small state machine.

In: a WalkPlan, and an `InputSource` that answers for inputs no edge of this walk produced
(stream chunks, persisted values, the request's prompt and media). Out: calls that became ready
(`WalkRun.new_ready`, drained by the conductor), edge values that leave the walk (`OutputSink`),
and `is_done` once the whole body has run.

Semantics (reference notes 0.1, 0.2):
- sequential sections run in order; a parallel section starts all members and ends when all end;
- a call is ready once every input has a value: an edge delivered to (node, name) in this walk
  run, a loop output of that name, else the input source; it is then handed to the scheduler;
- a loop repeats its body; an iteration ends when the whole body ended. The loop ends after
  max_iters iterations, or, for loops with has_stop, after the iteration in which a row of the
  loop reported is_stop. Loop-back edges feed the next iteration (the final iteration's are
  dropped). Edges named in `outputs` are held and delivered once, with the final iteration's
  value, when the loop ends; `accumulate` names deliver the list of every iteration's values.
  Values that fed the body from outside the loop stay in place, so they are re-read each
  iteration; values produced inside the body are cleared at each new iteration so a consumer
  never runs on the previous iteration's data.
"""
from __future__ import annotations

from typing import Any, Optional, Protocol

from mstar.plan.schema import CallPlan, EdgePlan, LoopPlan, ParallelPlan, SectionPlan, WalkPlan
from mstar.runtime.conductor.request import num_tokens_of


class InputSource(Protocol):
    """What the conductor answers for inputs the walk's own edges did not produce."""

    def can_supply(self, node: str, name: str) -> bool: ...

    def take(self, node: str, name: str) -> Any: ...


class OutputSink(Protocol):
    """Receives edges that leave the walk run (conductor, client, stream; persisted values)."""

    def deliver(self, edge: EdgePlan, value: Any) -> None: ...


class WalkStateError(Exception):
    """A result that does not fit the walk's state (a bug in the caller or the plan)."""


class ActiveCall:
    """A call of the walk that has been reached and has not completed yet."""

    __slots__ = ("run", "plan", "node", "parent", "loop", "inputs", "is_ready", "num_tokens")

    def __init__(self, run: "WalkRun", plan: CallPlan, parent: "_Frame", loop: Optional["_LoopFrame"]):
        self.run = run
        self.plan = plan
        self.node = plan.node
        self.parent = parent
        self.loop = loop
        self.inputs: dict[str, Any] = {}
        self.is_ready = False
        self.num_tokens = 1  # tokens the row feeds: the largest over its inputs, 1 without any

    @property
    def loop_iter(self) -> int:
        return self.loop.iteration if self.loop is not None else 0

    def start(self) -> bool:
        self.run._activate(self)
        return False  # a call never completes while it starts


class _Frame(Protocol):
    """A section being interpreted. `start()` begins it and returns True when it completed at
    once (nothing to run); otherwise it later calls `parent.child_done(self)` when it ends."""

    def start(self) -> bool: ...

    def child_done(self, child: Any) -> None: ...


def _make(run: "WalkRun", section: SectionPlan, parent: Any, loop: Optional["_LoopFrame"]) -> Any:
    if isinstance(section, CallPlan):
        return ActiveCall(run, section, parent, loop)
    if isinstance(section, ParallelPlan):
        return _ParFrame(run, section.body, parent, loop)
    if isinstance(section, LoopPlan):
        return _LoopFrame(run, section, parent, loop)
    return _SeqFrame(run, section.body, parent, loop)


class _SeqFrame:
    def __init__(self, run: "WalkRun", body: list, parent: Any, loop: Optional["_LoopFrame"]):
        self.run, self.body, self.parent, self.loop = run, body, parent, loop
        self.index = 0

    def start(self) -> bool:
        return self._advance()

    def _advance(self) -> bool:
        while self.index < len(self.body):
            child = _make(self.run, self.body[self.index], self, self.loop)
            self.index += 1
            if not child.start():
                return False
        return True

    def child_done(self, child: Any) -> None:
        if self._advance():
            self.parent.child_done(self)


class _ParFrame:
    def __init__(self, run: "WalkRun", body: list, parent: Any, loop: Optional["_LoopFrame"]):
        self.run, self.body, self.parent, self.loop = run, body, parent, loop
        self.num_running = 0

    def start(self) -> bool:
        children = [_make(self.run, section, self, self.loop) for section in self.body]
        self.num_running = len(children)
        for child in children:
            if child.start():
                self.num_running -= 1
        return self.num_running == 0

    def child_done(self, child: Any) -> None:
        self.num_running -= 1
        if self.num_running == 0:
            self.parent.child_done(self)


class _LoopShape:
    """What a loop's body produces, computed once per LoopPlan."""

    def __init__(self, plan: LoopPlan):
        self.plan = plan  # kept alive, so its id (the cache key) is never reused by another plan
        self.inside_nodes = set(plan.nodes)
        # A one-call body (a decode loop) needs no sequence frame around its call.
        self.is_one_call = len(plan.body) == 1 and isinstance(plan.body[0], CallPlan)
        self.loop_back = {(e.name, e.dest) for e in plan.loop_back}
        self.produced_inside: set[tuple[str, str]] = set()
        stack = list(plan.body)
        while stack:
            section = stack.pop()
            if isinstance(section, CallPlan):
                for edge in section.edges:
                    if edge.dest_kind == "node" and not edge.is_loop_back:
                        self.produced_inside.add((edge.dest, edge.name))
            else:
                stack.extend(section.body)


_SHAPES: dict[int, _LoopShape] = {}


def _shape(plan: LoopPlan) -> _LoopShape:
    # Keyed by identity (plans are frozen); the shape keeps its plan alive, so the id is stable.
    shape = _SHAPES.get(id(plan))
    if shape is None or shape.plan is not plan:
        shape = _SHAPES[id(plan)] = _LoopShape(plan)
    return shape


# Edge routes of a call, decided once per CallPlan from the loops around it (innermost first).
_LOOP_BACK, _INBOX, _SINK, _HELD, _ACCUMULATE = range(5)

_ROUTES: dict[int, tuple[CallPlan, list[tuple]]] = {}  # id -> (the plan, kept alive; its routes)


def _routes(plan: CallPlan, loop: Optional["_LoopFrame"]) -> list[tuple]:
    """Per output edge of `plan`: (name, is_device, action, depth, edge, inbox key), where depth
    is how many `outer` hops from the call's innermost loop lead to the loop the value goes to
    (loop-backs, held outputs, accumulated values). The rules of `WalkRun._route` (and, for
    loop-backs, the innermost loop declaring the edge), applied once: the loop nesting of a call is fixed by the plan. Keyed by identity (plans are
    frozen); the entry keeps its plan alive, so the id is never reused by another plan."""
    cached = _ROUTES.get(id(plan))
    if cached is not None and cached[0] is plan:
        return cached[1]
    shapes = []  # the loop frames around the call, innermost first
    frame = loop
    while frame is not None:
        shapes.append(frame)
        frame = frame.outer
    routes = []
    for edge in plan.edges:
        action, depth = _INBOX if edge.dest_kind == "node" else _SINK, 0
        if edge.is_loop_back:
            # The innermost loop that declares it (else the innermost loop; outside any loop
            # the edge raises when it is delivered).
            action = _LOOP_BACK
            depth = next((i for i, f in enumerate(shapes) if (edge.name, edge.dest) in f.shape.loop_back), 0)
        else:
            for i, f in enumerate(shapes):
                if edge.dest_kind == "node" and edge.dest in f.shape.inside_nodes:
                    break
                if edge.name in f.plan.outputs:
                    action, depth = _HELD, i
                    break
                if edge.name in f.plan.accumulate:
                    action, depth = _ACCUMULATE, i
                    break
        routes.append((edge.name, edge.is_device, action, depth, edge, (edge.dest, edge.name)))
    _ROUTES[id(plan)] = (plan, routes)
    return routes


class _LoopFrame:
    def __init__(self, run: "WalkRun", plan: LoopPlan, parent: Any, loop: Optional["_LoopFrame"]):
        self.run, self.plan, self.parent, self.outer = run, plan, parent, loop
        self.shape = _shape(plan)
        self.iteration = 0
        self.is_stop_requested = False
        self.next_inbox: dict[tuple[str, str], Any] = {}
        self.held: dict[tuple[str, str, str], tuple[EdgePlan, Any]] = {}  # outputs, last value
        self.accumulated: dict[tuple[str, str, str], tuple[EdgePlan, list]] = {}
        self.loop_back_latest: dict[str, Any] = {}

    def start(self) -> bool:
        if self.plan.max_iters <= 0:
            return True
        return self._run_iterations()

    def _run_iterations(self) -> bool:
        sections = self.plan.body
        is_one_call = self.shape.is_one_call
        while True:
            if is_one_call:
                body = ActiveCall(self.run, sections[0], self, self)
            else:
                body = _SeqFrame(self.run, sections, self, self)
            if not body.start():
                return False
            if self._end_iteration():
                return True

    def child_done(self, child: Any) -> None:
        if self._end_iteration():
            self.parent.child_done(self)
        elif self.shape.is_one_call:
            # The next iteration of a one-call body (a decode step): its call, activated
            # directly (a call never completes while it starts).
            self.run._activate(ActiveCall(self.run, self.plan.body[0], self, self))
        elif self._run_iterations():
            self.parent.child_done(self)

    def _end_iteration(self) -> bool:
        """Close an iteration; True when the loop is over (its outputs are then delivered)."""
        is_last = self.iteration + 1 >= self.plan.max_iters or (
            self.plan.has_stop and self.is_stop_requested
        )
        if is_last:
            self._finish()
            return True
        self.iteration += 1
        inbox = self.run.inbox
        for key in self.shape.produced_inside:
            inbox.pop(key, None)
        inbox.update(self.next_inbox)  # keys are (dest node, name), as in the inbox
        self.next_inbox.clear()
        return False

    def _finish(self) -> None:
        for edge, value in self.held.values():
            self.run._route(edge, value, self.outer)
        for edge, values in self.accumulated.values():
            self.run._route(edge, values, self.outer)
        delivered = {edge.name for edge, _ in self.held.values()}
        delivered.update(edge.name for edge, _ in self.accumulated.values())
        # Outputs produced only by loop-back edges have no edge to leave by: later calls of
        # the walk read them by name.
        for name in self.plan.outputs:
            if name not in delivered and name in self.loop_back_latest:
                self.run.scope[name] = self.loop_back_latest[name]


class WalkRun:
    """The state of one walk for one request (one partition's current stage)."""

    def __init__(self, walk: WalkPlan, source: InputSource, sink: OutputSink, stream_inputs: dict[str, set[str]]):
        """stream_inputs: node -> its input names fed by streams (NodePlan.stream_inputs)."""
        self.walk = walk
        self.source = source
        self.sink = sink
        self.stream_inputs = stream_inputs
        self.inbox: dict[tuple[str, str], Any] = {}  # (dest node, name) -> value
        self.scope: dict[str, Any] = {}  # loop outputs without an edge, by name
        self.active: dict[str, ActiveCall] = {}  # node -> its active call
        self.waiting: list[ActiveCall] = []
        self.new_ready: list[ActiveCall] = []
        self.is_done = False
        self.is_cancelled = False
        self.num_calls_done = 0

    @property
    def name(self) -> str:
        return self.walk.name

    def start(self) -> None:
        root = _SeqFrame(self, self.walk.body, self, None)
        if root.start():
            self.is_done = True

    def child_done(self, child: Any) -> None:
        self.is_done = True

    def cancel(self) -> None:
        """Stop interpreting: nothing of this run becomes ready or completes any more."""
        self.is_cancelled = True
        self.waiting.clear()
        self.active.clear()

    # ------------------------------------------------------------ readiness

    def _activate(self, call: ActiveCall) -> None:
        if call.node in self.active:
            raise WalkStateError(f"walk {self.name}: node {call.node} is called twice at once")
        self.active[call.node] = call
        if not self._try_ready(call):
            self.waiting.append(call)

    def _has_input(self, node: str, name: str) -> bool:
        if (node, name) in self.inbox:
            return True
        if name in self.scope and name not in self.stream_inputs.get(node, ()):
            return True
        return self.source.can_supply(node, name)

    def _try_ready(self, call: ActiveCall) -> bool:
        node = call.node
        inbox = self.inbox
        names = call.plan.inputs
        inputs = {}
        for name in names:
            key = (node, name)
            if key not in inbox:
                break
            inputs[name] = inbox[key]
        else:
            # Every input came by an edge of this run (a decode iteration's loop-back).
            return self._mark_ready(call, inputs)
        for name in names:
            if not self._has_input(node, name):
                return False
        inputs = {}
        for name in call.plan.inputs:
            if (node, name) in self.inbox:
                inputs[name] = self.inbox[(node, name)]
            elif name in self.scope and name not in self.stream_inputs.get(node, ()):
                inputs[name] = self.scope[name]
            else:
                inputs[name] = self.source.take(node, name)
        return self._mark_ready(call, inputs)

    def _mark_ready(self, call: ActiveCall, inputs: dict[str, Any]) -> bool:
        call.inputs = inputs
        if len(inputs) == 1:
            call.num_tokens = num_tokens_of(next(iter(inputs.values())))
        elif inputs:
            call.num_tokens = max(map(num_tokens_of, inputs.values()))
        call.is_ready = True
        self.new_ready.append(call)
        return True

    def retry_waiting(self) -> None:
        """Inputs may have arrived (stream chunks, persisted values): re-check waiting calls."""
        if self.waiting:
            self.waiting = [call for call in self.waiting if not self._try_ready(call)]

    # ------------------------------------------------------------ results

    def complete(self, node: str, outputs: dict[str, Any], is_stop: bool) -> None:
        """The ready call of `node` ran: route its outputs and advance the section tree."""
        call = self.active.pop(node, None)
        if call is None or not call.is_ready:
            raise WalkStateError(f"walk {self.name}: no ready call of node {node}")
        self.num_calls_done += 1
        loop = call.loop
        cached = _ROUTES.get(id(call.plan))
        routes = cached[1] if cached is not None and cached[0] is call.plan else _routes(call.plan, loop)
        for name, is_device, action, depth, edge, key in routes:
            if name in outputs:
                value = outputs[name]
            elif is_device:
                value = None  # stays on the device; the engine keeps it
            else:
                continue
            if action == _SINK:
                self.sink.deliver(edge, value)
                continue
            if action == _INBOX:
                self.inbox[key] = value
                if edge.is_persist:
                    self.sink.deliver(edge, value)
                continue
            target = loop
            for _ in range(depth):
                target = target.outer
            if action == _LOOP_BACK:
                if target is None:
                    raise WalkStateError(f"walk {self.name}: loop-back edge {name} outside any loop")
                target.next_inbox[key] = value
                target.loop_back_latest[name] = value
            elif action == _HELD:
                target.held[(name, edge.dest_kind, edge.dest)] = (edge, value)
            else:
                entry = target.accumulated.setdefault((name, edge.dest_kind, edge.dest), (edge, []))
                entry[1].append(value)
        if is_stop:
            stopping = loop
            while stopping is not None and not stopping.plan.has_stop:
                stopping = stopping.outer
            if stopping is not None:
                stopping.is_stop_requested = True
        call.parent.child_done(call)

    def _route(self, edge: EdgePlan, value: Any, loop: Optional[_LoopFrame]) -> None:
        """Deliver an edge value through the enclosing loops' output rules."""
        while loop is not None:
            if edge.dest_kind == "node" and edge.dest in loop.shape.inside_nodes:
                break  # a forward edge inside the loop body
            key = (edge.name, edge.dest_kind, edge.dest)
            if edge.name in loop.plan.outputs:
                loop.held[key] = (edge, value)
                return
            if edge.name in loop.plan.accumulate:
                entry = loop.accumulated.setdefault(key, (edge, []))
                entry[1].append(value)
                return
            loop = loop.outer
        if edge.dest_kind == "node":
            self.inbox[(edge.dest, edge.name)] = value
            if edge.is_persist:
                self.sink.deliver(edge, value)
        else:
            self.sink.deliver(edge, value)
