"""The loops around each call, followed through a walk's tables (mstar/plan/loop_nesting.py):
every walk mstarc lowers nests as the check expects (random section trees: sequences, parallels,
nested loops with and without stops, loop-backs and loop outputs), and a start transition that
leaves out any loop it enters is found."""
from __future__ import annotations

from hypothesis import given, strategies as st

from mstar.compiler.lower_tables import lower_walk_tables
from mstar.compiler.walk_tree import TreeCall, TreeEdge, TreeLoop, TreeParallel, TreeSequential, WalkTree
from mstar.plan.loop_nesting import loop_nesting_problems
from mstar.plan.schema import NextPlan, NodePlan, PartitionPlan, StagePlan, WalkPlan


def _shapes(depth: int):
    leaf = st.just(("call",))
    if depth == 0:
        return leaf
    inner = st.lists(_shapes(depth - 1), min_size=1, max_size=3)
    return st.one_of(leaf, st.tuples(st.just("seq"), inner), st.tuples(st.just("par"), inner),
                     st.tuples(st.just("loop"), st.booleans(), st.booleans(), inner))


class _Builder:
    """Section trees from shapes: each call a node of its own that loops back into itself inside a
    loop and sends `out` to the client (a loop output where its loop says so)."""

    def __init__(self):
        self.nodes: list[str] = []

    def section(self, shape, in_loop: bool):
        if shape[0] == "call":
            node = f"n{len(self.nodes)}"
            self.nodes.append(node)
            edges = [TreeEdge(name="out", dest_kind="client", modality="text")]
            if in_loop:
                edges.append(TreeEdge(name="back", dest_kind="node", dest=node, is_loop_back=True))
            return TreeCall(node=node, inputs=["back"], edges=edges)
        is_loop = shape[0] == "loop"
        body = [self.section(child, in_loop or is_loop) for child in shape[-1]]
        if shape[0] == "seq":
            return TreeSequential(body=body)
        if shape[0] == "par":
            return TreeParallel(body=body)
        return TreeLoop(name=f"l{len(self.nodes)}", max_iters=2, has_stop=shape[1], nodes=[], loop_back=[],
                        is_on_device=False, outputs=["out"] if shape[2] else [], accumulate=[], body=body)


def _lowered(shapes) -> WalkPlan:
    builder = _Builder()
    body = [builder.section(shape, False) for shape in shapes]
    tree = WalkTree(name="w", partition="P", nodes=builder.nodes, body=body)
    nodes = [NodePlan(name=n, engine="stateless", model_kind="audio_codec", dims={}, inputs=["back"],
                      input_roles=[], outputs=[]) for n in builder.nodes]
    partitions = [PartitionPlan(name="P", stages=[StagePlan(walks=["w"])], initial_walk="w")]
    instances = {(n, "w"): [[0]] for n in builder.nodes}
    return lower_walk_tables([tree], partitions, nodes, instances)[0]


def _starts(walk: WalkPlan):
    """(where, transition) for every start transition of the walk's tables."""
    yield "start", walk.start
    for i, call in enumerate(walk.calls):
        yield f"call {i}", call.then
    for i, loop in enumerate(walk.loops):
        yield f"loop {i} body", loop.body
        yield f"loop {i} then", loop.then
    for i, join in enumerate(walk.joins):
        yield f"join {i}", join.then


def _without_loop(walk: WalkPlan, where: str, loop: int) -> WalkPlan:
    """The walk with `loop` left out of the start transition at `where`."""
    def cut(then: NextPlan) -> NextPlan:
        return then.model_copy(update={"loops": [i for i in then.loops if i != loop]})

    if where == "start":
        return walk.model_copy(update={"start": cut(walk.start)})
    kind, index, *part = where.split()
    i = int(index)
    if kind == "call":
        calls = list(walk.calls)
        calls[i] = calls[i].model_copy(update={"then": cut(calls[i].then)})
        return walk.model_copy(update={"calls": calls})
    if kind == "join":
        joins = list(walk.joins)
        joins[i] = joins[i].model_copy(update={"then": cut(joins[i].then)})
        return walk.model_copy(update={"joins": joins})
    loops = list(walk.loops)
    field = "body" if part == ["body"] else "then"
    loops[i] = loops[i].model_copy(update={field: cut(getattr(loops[i], field))})
    return walk.model_copy(update={"loops": loops})


@given(st.lists(_shapes(3), min_size=1, max_size=3))
def test_lowered_walks_nest_as_the_check_expects(shapes):
    walk = _lowered(shapes)
    assert loop_nesting_problems(walk) == []


@given(st.lists(_shapes(3), min_size=1, max_size=3), st.data())
def test_a_start_that_leaves_out_a_loop_it_enters_is_found(shapes, data):
    walk = _lowered(shapes)
    entering = [(where, i) for where, then in _starts(walk) if then.kind == "start" for i in then.loops]
    if not entering:
        return
    where, loop = data.draw(st.sampled_from(entering))
    assert loop_nesting_problems(_without_loop(walk, where, loop)), (where, loop)
