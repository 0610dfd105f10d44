"""The loops around each call of a walk, followed through its tables from the walk's start.

mstarc's lowering (compiler/lower_tables.py `entry`) writes a "start" transition as the loops it
enters on the way down to a section's first calls (outer first), the joins it arms and those
calls; a loop's `body` is the same transition for the loop's own body. So a loop or call that a
start reaches lies inside the loops already around the transition plus every loop the start
enters whose `body` reaches it too. Following the transitions from `walk.start` (no loop around)
gives every call, loop and join the set of loops around it, and mstarc's tables satisfy:

- a start enters no loop that is already around it;
- a call's `loop` is the innermost loop around it (the highest index: loops are numbered outer
  first), its `stop_loop` the innermost `has_stop` one, and every loop its edges (and a loop's exit
  edges) write is around it;
- `loop_end` ends the innermost loop around what ends; `walk_end` is reached outside every loop;
- a call, loop or join reached from two transitions has the same loops around it both times.

The runtime follows the tables without checking them (conductor/walk_run.py): a decode call
started without entering its loop failed inside a step ("a ready call ... is in a loop that is
not running"), as an internal error.

    loop_nesting_problems(walk) -> list[str]   (its indices in range: references.py checks first)
"""
from __future__ import annotations

from typing import Optional

from mstar.plan.schema import EdgePlan, NextPlan, WalkPlan

_LOOP_ACTIONS = ("loop_back", "loop_output", "loop_accumulate")


class _Nesting:
    """One walk's loops followed from its start; each call, loop and join is visited once."""

    def __init__(self, walk: WalkPlan):
        self.walk = walk
        self.where = f"walk {walk.name}"
        self.around: dict[tuple[str, int], frozenset[int]] = {}
        self.todo: list[tuple[NextPlan, frozenset[int], str]] = [(walk.start, frozenset(), "its start")]
        self.problems: list[str] = []

    def loop_name(self, index: Optional[int]) -> str:
        return "no loop" if index is None else f"loop {index} ({self.walk.loops[index].name})"

    def run(self) -> list[str]:
        while self.todo:
            then, around, what = self.todo.pop()
            if then.kind == "start":
                self.start(then, around, what)
            elif then.kind == "loop_end" and then.target != max(around, default=None):
                self.problems.append(f"{self.where}: {what} ends an iteration of {self.loop_name(then.target)}, "
                                     f"but the innermost loop around it is {self.loop_name(max(around, default=None))}")
            elif then.kind == "join" and then.target is not None and self.reach("join", then.target, around):
                self.todo.append((self.walk.joins[then.target].then, around, f"join {then.target}"))
            elif then.kind == "walk_end" and around:
                self.problems.append(f"{self.where}: {what} ends the walk inside {self.loop_name(max(around))}")
        return self.problems

    def reach(self, kind: str, index: int, around: frozenset[int]) -> bool:
        """Record the loops around call, loop or join `index`: True the first time it is reached."""
        seen = self.around.get((kind, index))
        if seen is None:
            self.around[(kind, index)] = around
            return True
        if seen != around:
            self.problems.append(f"{self.where}: {kind} {index} is reached inside loops {sorted(seen)} and "
                                 f"inside loops {sorted(around)}")
        return False

    def start(self, then: NextPlan, around: frozenset[int], what: str) -> None:
        loops = self.walk.loops
        self.problems.extend(f"{self.where}: {what} enters {self.loop_name(i)}, which is already around it"
                             for i in then.loops if i in around)
        for index in then.loops:
            inside = around | {m for m in then.loops if index in loops[m].body.loops}
            if self.reach("loop", index, inside):
                loop = loops[index]
                self.edge_problems(f"loop {loop.name}", [x.edge for x in loop.exits if x.edge is not None], inside)
                self.todo.append((loop.body, inside | {index}, f"loop {loop.name}"))
                self.todo.append((loop.then, inside, f"loop {loop.name}"))
        for index in then.calls:
            inside = around | {m for m in then.loops if index in loops[m].body.calls}
            if self.reach("call", index, inside):
                self.call_problems(index, inside, f"{what} (loops {then.loops})")
                call = self.walk.calls[index]
                self.todo.append((call.then, inside, f"call {index} ({call.node})"))

    def call_problems(self, index: int, around: frozenset[int], started_by: str) -> None:
        call = self.walk.calls[index]
        what = f"call {index} ({call.node})"
        innermost = max(around, default=None)
        if call.loop is not None and call.loop not in around:
            self.problems.append(f"{self.where}: {started_by} starts {what}, which sits in "
                                 f"{self.loop_name(call.loop)}, without entering that loop")
        elif call.loop != innermost:
            self.problems.append(f"{self.where}: {what} has loop {call.loop}, but the innermost loop around it "
                                 f"is {self.loop_name(innermost)}")
        stop = max((i for i in around if self.walk.loops[i].has_stop), default=None)
        if call.stop_loop != stop:
            self.problems.append(f"{self.where}: {what} has stop_loop {call.stop_loop}, but the innermost has_stop "
                                 f"loop around it is {self.loop_name(stop)}")
        self.edge_problems(what, call.edges, around)

    def edge_problems(self, what: str, edges: list[EdgePlan], around: frozenset[int]) -> None:
        self.problems.extend(f"{self.where}: {what} edge {e.name} ({e.action}) writes {self.loop_name(e.loop)}, "
                             "which is not around it"
                             for e in edges if e.action in _LOOP_ACTIONS and e.loop not in around)


def loop_nesting_problems(walk: WalkPlan) -> list[str]:
    """What in `walk`'s tables does not nest as mstarc writes it (module docstring); every index of
    the walk must be within its lists (references.py checks that first)."""
    return _Nesting(walk).run()


def loops_around_calls(walk: WalkPlan) -> dict[int, frozenset[int]]:
    """The loops around each call its start reaches (outer and inner alike), for a walk whose
    tables nest (`loop_nesting_problems` found nothing: every loaded plan's)."""
    nesting = _Nesting(walk)
    nesting.run()
    return {index: loops for (kind, index), loops in nesting.around.items() if kind == "call"}


def loops_around_loops(walk: WalkPlan) -> dict[int, frozenset[int]]:
    """The loops around each loop its start reaches (the loop itself not among them), for a walk
    whose tables nest (`loop_nesting_problems` found nothing)."""
    nesting = _Nesting(walk)
    nesting.run()
    return {index: loops for (kind, index), loops in nesting.around.items() if kind == "loop"}
