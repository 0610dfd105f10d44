"""The plan's walk tables, prepared once per plan for the conductor's inner loops.

In:  a `WalkPlan` (mstar/plan/schema.py: calls, joins, loops, slots). Out: `RunWalk`, the same
tables as tuples of small ints and strings (no pydantic attribute access per row), plus what the
columnar pass needs to know about each call:

    RunCall.inputs   (name, slots, is_wait, source code) per input
    RunCall.edges    (name, action code, slot, loop, exit, is_device, is_persist, edge plan, scope exit)
    RunCall.loop_step   set when the call is the whole body of its loop and every input comes
                     from that loop's loop-backs written by this call: finishing an iteration
                     re-readies the same call from the slots alone (a decode step). The
                     conductor advances rows of such calls in one pass (conductor/loop_pass.py),
                     with what `LoopStep` sorted out of the call's edges once.
"""
from __future__ import annotations

from typing import Optional

from mstar.plan.io import PlanError
from mstar.plan.loop_nesting import loops_around_calls
from mstar.plan.schema import CallPlan, EdgePlan, LoopExitPlan, LoopPlan, NextPlan, WalkPlan
from mstar.runtime.step import RowResult

# Input sources (InputSourcePlan.source). PROMPT: the text prompt rule; PROMPT_IMAGE /
# PROMPT_AUDIO: a persisted value of that name, else the request's media of that modality;
# OUTSIDE: a persisted value of that name, else nothing (None: the engine synthesises stand-ins).
STREAM, PROMPT, OUTSIDE, PROMPT_IMAGE, PROMPT_AUDIO = range(5)
MEDIA_OF = {PROMPT_IMAGE: "image", PROMPT_AUDIO: "audio"}


def source_code(source: str, prompt) -> int:
    if source == "stream":
        return STREAM
    if source != "prompt":
        return OUTSIDE
    return {"text": PROMPT, "image": PROMPT_IMAGE, "audio": PROMPT_AUDIO}.get(prompt, OUTSIDE)
# Edge actions (EdgePlan.action)
SLOT, LOOP_BACK, LOOP_OUTPUT, LOOP_ACCUMULATE, SINK = range(5)
ACTIONS = {"slot": SLOT, "loop_back": LOOP_BACK, "loop_output": LOOP_OUTPUT,
           "loop_accumulate": LOOP_ACCUMULATE, "sink": SINK}
# Transitions (NextPlan.kind)
START, JOIN, LOOP_END, WALK_END = range(4)
KINDS = {"start": START, "join": JOIN, "loop_end": LOOP_END, "walk_end": WALK_END}
NO_TARGET = -1  # RunNext.target of a transition that names no join or loop


class RunNext:
    """A transition. target: the join or loop a "join" or "loop_end" names, resolved here once so
    the per-row walk (conductor/walk_run.py `WalkRun.follow`) indexes with a plain int; NO_TARGET
    for "start" and "walk_end", which never read it."""

    __slots__ = ("kind", "calls", "joins", "loops", "target")

    def __init__(self, plan: NextPlan):
        self.kind = KINDS[plan.kind]
        self.calls = tuple(plan.calls)
        self.joins = tuple(plan.joins)
        self.loops = tuple(plan.loops)
        if plan.target is not None:
            self.target: int = plan.target
        elif self.kind in (JOIN, LOOP_END):
            # load_plan's reference check refuses this already; a plan built without it gets here.
            raise PlanError(f"a {plan.kind} transition names no {'join' if self.kind == JOIN else 'loop'}")
        else:
            self.target = NO_TARGET


def edge_entry(edge: EdgePlan, scope_exit: Optional[int] = None) -> tuple:
    return (edge.name, ACTIONS[edge.action], edge.slot, edge.loop, edge.exit, edge.is_device,
            edge.is_persist, edge, scope_exit)


def _exit_entry(loop: str, plan: LoopExitPlan) -> tuple[str, str, tuple, int]:
    if plan.kind == "scope":
        if plan.slot is None:
            raise PlanError(f"loop {loop}: output {plan.name} names no slot")
        return (plan.kind, plan.name, (), plan.slot)
    if plan.edge is None:
        raise PlanError(f"loop {loop}: {plan.name} is handed on by no edge")
    return (plan.kind, plan.name, edge_entry(plan.edge), NO_TARGET)


class RunLoop:
    __slots__ = ("name", "max_iters", "count_param", "default_count", "has_stop", "body", "then", "cleared",
                 "exits", "scope_exits")

    def __init__(self, plan: LoopPlan):
        self.name = plan.name
        self.max_iters = plan.max_iters
        self.count_param = plan.count_param
        self.default_count = plan.default_count if plan.default_count is not None else plan.max_iters
        self.has_stop = plan.has_stop
        self.body = RunNext(plan.body)
        self.then = RunNext(plan.then)
        self.cleared = tuple(plan.cleared_slots)
        # (kind, name, onward edge entry, slot) in the plan's order: an output or accumulated exit
        # has its onward edge and slot NO_TARGET; a scope exit has its slot and no edge (()).
        self.exits = tuple(_exit_entry(plan.name, x) for x in plan.exits)
        self.scope_exits = {x.name: i for i, x in enumerate(plan.exits) if x.kind == "scope"}


class LoopStep:
    """A loop-step call's edges sorted for the columnar pass, decided once per call.

    client: (name, (name, modality)) of the edges that only emit to the client; back: (name, slot,
    scope exit, is_device) of the loop-backs into the call's own loop; other: the remaining edge
    entries (streams, persisted values, loop exits: applied through the walk run); device_inputs:
    when every input is a loop-back kept on the device, the inputs a next iteration always gets
    ({name: None}, one token a row), else None."""

    __slots__ = ("client", "back", "other", "device_inputs", "has_stop", "is_own_stop", "cleared",
                 "counted_one", "is_plain", "needs_pump", "is_fast", "fast")

    def __init__(self, call: "RunCall", loop: RunLoop):
        # (edge, modality) pairs: one shared object per edge for every emission it makes
        self.client = tuple((e[0], (e[0], e[7].modality)) for e in call.edges
                            if e[1] == SINK and e[7].dest_kind == "client" and not e[6])
        self.back = tuple((e[0], e[2], e[8], e[5]) for e in call.edges if e[1] == LOOP_BACK and e[3] == call.loop)
        taken = {id(e) for e in call.edges if (e[1] == SINK and e[7].dest_kind == "client" and not e[6])
                 or (e[1] == LOOP_BACK and e[3] == call.loop)}
        self.other = tuple(e for e in call.edges if id(e) not in taken)
        device_slots = {slot for _, slot, _, is_device in self.back if is_device}
        is_device = all(slots[0] in device_slots for _, slots, _, _ in call.inputs)
        self.device_inputs = {name: None for name, _, _, _ in call.inputs} if is_device else None
        self.has_stop = loop.has_stop
        self.is_own_stop = call.stop_loop == call.loop
        self.cleared = loop.cleared
        # The one counted output (None: none or several, counted by Conductor.count).
        self.counted_one = call.counted[0] if len(call.counted) == 1 else None
        # Every input on the device and nothing but client emissions besides: a steady iteration
        # touches no slot (its loop-backs are None, already in their slots).
        self.is_plain = (self.device_inputs is not None and not self.other and not self.cleared
                         and all(scope is None for _, _, scope, _ in self.back))
        # Other edges (a stream push, a persisted value, a slot) may let another call of the
        # request go on: such a row is pumped as row by row would (its partitions in order).
        self.needs_pump = bool(self.other)
        # A plain step with at most one client edge and at most one counted output: its rows take
        # the loop pass's fast kernel (no loop over edges or counted names per row).
        self.is_fast = self.is_plain and len(self.client) <= 1 and (self.counted_one is not None or not call.counted)
        # What the fast kernel reads, in one tuple: client edge name and (edge, modality) (None,
        # None without one), counted output, has_stop, device inputs (the iterations left are the
        # row's loop state's: its limit may be the request's own count).
        client = self.client[0] if len(self.client) == 1 else (None, None)
        # counted: the client edge's own name object when they are equal (the kernel tests `is`)
        counted = client[0] if self.counted_one is not None and self.counted_one == client[0] else self.counted_one
        self.fast = (client[0], client[1], counted, self.has_stop, self.device_inputs)


class RunCall:
    __slots__ = ("index", "node", "inputs", "edges", "counted", "loop", "stop_loop", "then",
                 "is_loop_step", "loop_step", "loop_back_slots", "plan")

    def __init__(self, index: int, plan: CallPlan, loops: list[RunLoop]):
        self.index = index
        self.plan = plan
        self.node = plan.node
        self.inputs = tuple((i.name, tuple(i.slots), i.is_wait, source_code(i.source, i.prompt)) for i in plan.inputs)
        edges = []
        for edge in plan.edges:
            scope_exit = None
            if edge.action == "loop_back" and edge.loop is not None:
                scope_exit = loops[edge.loop].scope_exits.get(edge.name)
            edges.append(edge_entry(edge, scope_exit))
        self.edges = tuple(edges)
        self.counted = tuple(plan.counted)
        self.loop = plan.loop
        self.stop_loop = plan.stop_loop
        self.then = RunNext(plan.then)
        # Slots this call's own loop-backs into its loop fill for the next iteration.
        self.loop_back_slots = {e.slot for e in plan.edges if e.action == "loop_back" and e.loop == plan.loop}
        own_loop = self._loop_if_loop_step(loops)
        self.is_loop_step = own_loop is not None
        self.loop_step = LoopStep(self, own_loop) if own_loop is not None else None

    def _loop_if_loop_step(self, loops: list[RunLoop]) -> Optional[RunLoop]:
        """The call's loop when the call is a loop step (see the module docstring), else None."""
        if self.loop is None or self.then.kind != LOOP_END or self.then.target != self.loop:
            return None
        loop = loops[self.loop]
        body = loop.body
        if body.calls != (self.index,) or body.joins or body.loops:
            return None
        # Every input is refilled by this call's own loop-back (a device loop-back always is;
        # a host one only when the engine returned the value: checked per row).
        is_refilled = all(slots and slots[0] in self.loop_back_slots and not is_wait
                          for _, slots, is_wait, _ in self.inputs)
        return loop if is_refilled else None


class RunWalk:
    __slots__ = ("name", "partition", "calls", "loops", "joins", "start", "num_slots", "plan", "max_limits",
                 "has_counts", "counts_output", "counts_once", "stop_ends_counts", "stopping_nodes")

    def __init__(self, plan: WalkPlan):
        self.plan = plan
        self.name = plan.name
        self.partition = plan.partition
        self.loops = tuple(RunLoop(loop) for loop in plan.loops)
        self.calls = tuple(RunCall(i, call, list(self.loops)) for i, call in enumerate(plan.calls))
        self.joins = tuple((join.num_members, RunNext(join.then)) for join in plan.joins)
        self.start = RunNext(plan.start)
        self.num_slots = len(plan.slots)
        self.max_limits = tuple(loop.max_iters for loop in self.loops)
        self.has_counts = any(loop.count_param is not None for loop in self.loops)
        counting = [index for index, call in enumerate(plan.calls) if call.counted]
        self.counts_output = bool(counting)  # some call's outputs count toward max_tokens
        # The nodes whose stop ends one of the walk's loops (PartitionState.stop_before_later_loops).
        self.stopping_nodes = frozenset(call.node for call in plan.calls if call.stop_loop is not None)
        # One counting call outside every loop: once its output is counted the run counts no more
        # (PartitionState.may_count_more: BAGEL's prefill_text before image_gen).
        self.counts_once = len(counting) == 1 and plan.calls[counting[0]].loop is None
        # The loops a model's stop in which ends the run's counting: the one counting call's own loop,
        # when that is the only loop around it and the one its stop ends. A stop ends its loop after
        # the iteration it came in, so a second counting call later in that iteration still counts
        # (A then B in one loop), and an inner loop around the call goes on to its limit (a stop of
        # the loop around that one): there max_tokens still ends the partition.
        self.stop_ends_counts: frozenset[int] = frozenset()
        if len(counting) == 1:
            call = plan.calls[counting[0]]
            if call.loop is not None and call.stop_loop == call.loop \
                    and loops_around_calls(plan).get(counting[0]) == {call.loop}:
                self.stop_ends_counts = frozenset((call.loop,))

    def loop_limits(self, counts: dict[str, int]) -> tuple[int, ...]:
        """Iterations each loop runs for a request with these loop counts (checked against the
        plan when it was admitted, conductor/loop_counts.py): its count, else the default count
        of a loop with a count param, else max_iters."""
        if not self.has_counts:
            return self.max_limits
        return tuple(loop.max_iters if loop.count_param is None else counts.get(loop.count_param, loop.default_count)
                     for loop in self.loops)


OUTSIDE_LOOPS = -1  # model_stop_loop of a call outside every loop (a prefill's first token)


def model_stop_loop(call: RunCall, result: RowResult) -> Optional[int]:
    """The loop a row's model stop ends (a stop token, not a limit: `RowResult.is_length`), OUTSIDE_LOOPS
    for a call outside every loop, or None: a counted stop token as the request's max_tokens-th ends
    the request `stop` where nothing after it counts, and one outside loops ends the partition's
    counting (PartitionState.may_count_more, Conductor.end_at_tokens)."""
    if not result.is_stop or result.is_length:
        return None
    return OUTSIDE_LOOPS if call.loop is None else call.stop_loop
