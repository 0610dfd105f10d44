"""Lowering, part 2: each walk's section tree -> the walk tables of the plan (schema 3).

In:  the walks as section trees (`lower_walks`), the partitions, the nodes' stream inputs, the
     names some edge persists, and (node, walk) -> instances (ranks running it, from the workers).
Out: `lower_walk_tables(trees, ...) -> list[WalkPlan]`, in the order of `trees`.

For every call, in source order:
- inputs: the run slots an edge of this walk fills for (node, input) - forward edges, loop-backs
  (from the second iteration), loop outputs routed to the node - then the slot of a loop output
  only loop-backs produced (read by name); `is_wait` when a parallel sibling fills the first;
  else the outside source: a stream chunk, the prompt, a persisted value, the request's media;
- edges: the action each output edge takes, decided here from the loops around the call (as the
  section-tree interpreter decided it per row before): a slot, a loop-back slot of a loop, a
  loop exit (output or accumulate), or the sink (conductor, client, stream), plus persist;
- then: the next calls (a sequence's next section), a parallel's join, a loop's iteration end,
  or the walk's end;
- counted outputs, the innermost loop and the loop a stop flag ends, and the instances.
Loops get their body start, their exit continuation, the slots their body fills (cleared when a
new iteration begins) and their exits (outputs and accumulated edges handed on with their onward
action, loop outputs only loop-backs produced written to a named slot).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, Optional, TypeVar, cast

from mstar.compiler.counting import counted_names
from mstar.compiler.walk_tree import (
    TreeCall,
    TreeEdge,
    TreeLoop,
    TreeParallel,
    WalkTree,
    iter_calls,
)
from mstar.plan.schema import (
    CallPlan,
    EdgePlan,
    InputSourcePlan,
    JoinPlan,
    LoopExitPlan,
    LoopPlan,
    Modality,
    NextPlan,
    NodePlan,
    PartitionPlan,
    WalkPlan,
)


EdgeAction = Literal["slot", "loop_back", "loop_output", "loop_accumulate", "sink"]
ExitKind = Literal["output", "accumulate", "scope"]
Source = Literal["stream", "prompt", "persisted", "none"]
_T = TypeVar("_T")


def _linked(value: Optional[_T]) -> _T:
    """A transition or join `link` set (every section of a tree is linked before the tables
    are built)."""
    if value is None:
        raise ValueError("a section of the walk was not linked (a bug in lower_tables)")
    return value


@dataclass
class WalkContext:
    """What lowering a walk needs beyond its tree."""

    stream_inputs: dict[str, set[str]]  # node -> its stream inputs
    prompts: dict[tuple[str, str], Modality]  # (node, input) -> the modality of the prompt it takes
    persisted: set[str]  # edge names some walk persists
    count_names: frozenset[str]  # output names counted as tokens in the walk's partition
    instances: dict[tuple[str, str], list[list[int]]]  # (node, walk) -> instances


@dataclass
class _Loop:
    index: int
    tree: TreeLoop
    parent: Optional["_Loop"]
    exits: list[LoopExitPlan] = field(default_factory=list)
    exit_keys: dict[tuple, int] = field(default_factory=dict)
    cleared: set[int] = field(default_factory=set)
    body: Optional[NextPlan] = None
    then: Optional[NextPlan] = None
    back_names: set[str] = field(default_factory=set)  # names of loop-backs into this loop


@dataclass
class _Site:
    call: TreeCall
    loop: Optional[_Loop]
    path: tuple  # ((id of container, is_parallel, member index), ...)
    then: Optional[NextPlan] = None


class _Lowering:
    def __init__(self, tree: WalkTree, ctx: WalkContext):
        self.tree = tree
        self.ctx = ctx
        self.sites: list[_Site] = []
        self.site_of: dict[int, int] = {}  # id(TreeCall) -> call index
        self.loops: list[_Loop] = []
        self.loop_of: dict[int, _Loop] = {}  # id(TreeLoop) -> its _Loop
        self.joins: list[Optional[JoinPlan]] = []
        self.join_of: dict[int, int] = {}  # id(TreeParallel) -> join index
        self.slots: list[str] = []
        self.slot_of: dict[tuple, int] = {}

    # ------------------------------------------------------------ numbering

    def number(self, sections: list, loop: Optional[_Loop], path: tuple, owner: int) -> None:
        """Give calls, joins and loops their indices in source order (outer loops first). A
        path names each container on the way to a call: (owner id, is a parallel, index)."""
        for index, section in enumerate(sections):
            self.number_one(section, loop, path + ((owner, False, index),))

    def number_one(self, section, loop: Optional[_Loop], here: tuple) -> None:
        if isinstance(section, TreeCall):
            self.site_of[id(section)] = len(self.sites)
            self.sites.append(_Site(section, loop, here))
        elif isinstance(section, TreeLoop):
            inner = _Loop(len(self.loops), section, loop)
            self.loops.append(inner)
            self.loop_of[id(section)] = inner
            self.number(section.body, inner, here, id(section))
        elif isinstance(section, TreeParallel):
            self.join_of[id(section)] = len(self.joins)
            self.joins.append(None)
            for member_index, member in enumerate(section.body):
                self.number_one(member, loop, here + ((id(section), True, member_index),))
        else:
            self.number(section.body, loop, here, id(section))

    def slot(self, key: tuple, label: str) -> int:
        if key not in self.slot_of:
            self.slot_of[key] = len(self.slots)
            self.slots.append(label)
        return self.slot_of[key]

    # ------------------------------------------------------------ control flow

    def entry(self, section) -> NextPlan:
        """The "start" transition that begins `section`: loops entered, joins armed, calls."""
        calls: list[int] = []
        joins: list[int] = []
        loops: list[int] = []

        def visit(s) -> None:
            if isinstance(s, TreeCall):
                calls.append(self.site_of[id(s)])
            elif isinstance(s, TreeLoop):
                loops.append(self.loop_of[id(s)].index)
                visit(s.body[0])
            elif isinstance(s, TreeParallel):
                joins.append(self.join_of[id(s)])
                for member in s.body:
                    visit(member)
            else:
                visit(s.body[0])

        visit(section)
        return NextPlan(kind="start", calls=calls, joins=joins, loops=loops)

    def link(self, sections: list, then: NextPlan) -> None:
        """Set what follows each section of a sequence: the next one's start, the last `then`."""
        for index, section in enumerate(sections):
            after = self.entry(sections[index + 1]) if index + 1 < len(sections) else then
            self.link_one(section, after)

    def link_one(self, section, then: NextPlan) -> None:
        if isinstance(section, TreeCall):
            self.sites[self.site_of[id(section)]].then = then
        elif isinstance(section, TreeLoop):
            loop = self.loop_of[id(section)]
            loop.then = then
            loop.body = self.entry(section.body[0])
            self.link(section.body, NextPlan(kind="loop_end", target=loop.index))
        elif isinstance(section, TreeParallel):
            join = self.join_of[id(section)]
            self.joins[join] = JoinPlan(num_members=len(section.body), then=then)
            for member in section.body:
                self.link_one(member, NextPlan(kind="join", target=join))
        else:
            self.link(section.body, then)

    # ------------------------------------------------------------ edges

    def edge_plan(self, edge: TreeEdge, action: str, **fields) -> EdgePlan:
        return EdgePlan(**edge.model_dump(exclude={"is_count_tokens"}), action=cast(EdgeAction, action), **fields)

    def route(self, edge: TreeEdge, loop: Optional[_Loop]) -> EdgePlan:
        """The action of `edge` (not a loop-back) leaving a call inside `loop`: held or
        accumulated by the first enclosing loop that names it (unless it goes to a node inside
        that loop), else a slot (node edges) or the sink."""
        while loop is not None:
            if edge.dest_kind == "node" and edge.dest in loop.tree.nodes:
                break
            if edge.name in loop.tree.outputs or edge.name in loop.tree.accumulate:
                kind = "output" if edge.name in loop.tree.outputs else "accumulate"
                key = (kind, edge.name, edge.dest_kind, edge.dest)
                if key not in loop.exit_keys:
                    loop.exit_keys[key] = len(loop.exits)
                    loop.exits.append(LoopExitPlan(kind=cast(ExitKind, kind), name=edge.name,
                                                   edge=self.route(edge, loop.parent)))
                action = "loop_output" if kind == "output" else "loop_accumulate"
                return self.edge_plan(edge, action, loop=loop.index, exit=loop.exit_keys[key])
            loop = loop.parent
        if edge.dest_kind == "node":
            return self.edge_plan(edge, "slot", slot=self.slot((edge.dest, edge.name), f"{edge.dest}.{edge.name}"))
        return self.edge_plan(edge, "sink")

    def call_edge(self, edge: TreeEdge, loop: Optional[_Loop]) -> EdgePlan:
        if not edge.is_loop_back:
            return self.route(edge, loop)
        # The innermost loop that declares it (else the innermost loop around the call).
        target = loop
        while target is not None and not any(
            (e.name, e.dest) == (edge.name, edge.dest) for e in target.tree.loop_back
        ):
            target = target.parent
        target = target or loop
        if target is None:  # the checks refuse a loop-back outside any loop
            raise ValueError(f"walk {self.tree.name}: loop-back edge {edge.name} outside any loop")
        target.back_names.add(edge.name)
        slot = self.slot((edge.dest, edge.name), f"{edge.dest}.{edge.name}")
        return self.edge_plan(edge, "loop_back", slot=slot, loop=target.index)

    # ------------------------------------------------------------ inputs

    def is_sibling(self, producer: _Site, consumer: _Site) -> bool:
        """Do the two calls sit in different members of one parallel section."""
        for a, b in zip(producer.path, consumer.path):
            if a != b:
                return a[1] and b[1] and a[0] == b[0]
        return False

    def input_plan(self, site: _Site, name: str, edges: dict[int, list[EdgePlan]],
                   scope: dict[str, int]) -> InputSourcePlan:
        node = site.call.node
        slots = []
        is_wait = False
        key = (node, name)
        if key in self.slot_of:
            slots.append(self.slot_of[key])
            is_wait = any(
                e.action == "slot" and (e.dest, e.name) == key and self.is_sibling(self.sites[i], site)
                for i, call_edges in edges.items() for e in call_edges
            )
        is_stream = name in self.ctx.stream_inputs.get(node, ())
        if name in scope and not is_stream:
            slots.append(scope[name])
        prompt = self.ctx.prompts.get((node, name))
        source: Source
        if is_stream:
            source = "stream"
        elif prompt is not None:
            source = "prompt"
        elif name in self.ctx.persisted:
            source = "persisted"
        else:
            source = "none"
        return InputSourcePlan(name=name, slots=slots, is_wait=is_wait, source=source, prompt=prompt)

    # ------------------------------------------------------------ the walk

    def run(self) -> WalkPlan:
        tree = self.tree
        self.number(tree.body, None, (), id(tree))
        self.link(tree.body, NextPlan(kind="walk_end"))
        edges = {i: [self.call_edge(e, site.loop) for e in site.call.edges] for i, site in enumerate(self.sites)}
        scope: dict[str, int] = {}
        for loop in self.loops:
            held = {x.name for x in loop.exits}
            for name in loop.tree.outputs:
                if name not in held and name in loop.back_names:
                    slot = scope[name] if name in scope else self.slot(("scope", name), f"loop output {name}")
                    scope[name] = slot
                    loop.exits.append(LoopExitPlan(kind="scope", name=name, slot=slot))
        for i, site in enumerate(self.sites):
            for e in edges[i]:
                if e.action == "slot" and e.slot is not None and not e.is_loop_back:
                    inner = site.loop
                    while inner is not None:  # every loop around the producer refills it
                        inner.cleared.add(e.slot)
                        inner = inner.parent
        calls = [self.call_plan(i, site, edges, scope) for i, site in enumerate(self.sites)]
        loops = [
            LoopPlan(
                name=loop.tree.name, max_iters=loop.tree.max_iters, has_stop=loop.tree.has_stop,
                count_param=loop.tree.count_param, default_count=loop.tree.default_count,
                nodes=list(loop.tree.nodes), body=_linked(loop.body), then=_linked(loop.then),
                cleared_slots=sorted(loop.cleared),
                exits=loop.exits,
            )
            for loop in self.loops
        ]
        return WalkPlan(
            name=tree.name, partition=tree.partition, nodes=list(tree.nodes), start=self.entry(tree.body[0]),
            calls=calls, joins=[_linked(join) for join in self.joins], loops=loops, slots=list(self.slots),
        )

    def call_plan(self, index: int, site: _Site, edges: dict[int, list[EdgePlan]], scope: dict[str, int]) -> CallPlan:
        call = site.call
        stop = site.loop
        while stop is not None and not stop.tree.has_stop:
            stop = stop.parent
        names_here = {e.name for c in iter_calls(self.tree.body) if c.node == call.node for e in c.edges}
        return CallPlan(
            node=call.node,
            inputs=[self.input_plan(site, name, edges, scope) for name in call.inputs],
            edges=edges[index],
            counted=sorted(self.ctx.count_names & names_here),
            loop=site.loop.index if site.loop else None,
            stop_loop=stop.index if stop else None,
            then=_linked(site.then),
            instances=self.ctx.instances.get((call.node, self.tree.name), []),
        )


def count_names(trees: list[WalkTree], partition: PartitionPlan) -> frozenset[str]:
    """Output names counted as tokens in a partition: its walks' count_tokens edges, else (none
    marked) the text its walks send to the client."""
    names_in = {w for stage in partition.stages for w in stage.walks}
    return counted_names((e.name, e.is_count_tokens, e.dest_kind == "client" and e.modality == "text")
                         for t in trees if t.name in names_in for c in iter_calls(t.body) for e in c.edges)


def lower_walk_tables(
    trees: list[WalkTree],
    partitions: list[PartitionPlan],
    nodes: list[NodePlan],
    instances: dict[tuple[str, str], list[list[int]]],
) -> list[WalkPlan]:
    """The walk tables of every tree (module docstring), in the order of `trees`. `nodes` say
    which inputs are streams and which take the prompt (their roles)."""
    stream_inputs = {node.name: set(node.stream_inputs) for node in nodes}
    prompts = {(node.name, i.name): i.prompt for node in nodes for i in node.input_roles if i.prompt is not None}
    persisted = {e.name for t in trees for c in iter_calls(t.body) for e in c.edges if e.is_persist}
    counts = {p.name: count_names(trees, p) for p in partitions}
    walks = []
    for tree in trees:
        ctx = WalkContext(stream_inputs, prompts, persisted, counts.get(tree.partition, frozenset()), instances)
        walks.append(_Lowering(tree, ctx).run())
    return walks


def tables_for(trees: list[WalkTree], partitions: list[PartitionPlan], nodes: list[NodePlan],
               workers: list) -> list[WalkPlan]:
    """The walk tables of section trees for a plan with these `NodePlan`s and `WorkerPlan`s
    (what `lower.run` does from a spec; tests build plans from hand-written trees with it)."""
    from mstar.plan.instances import call_instances

    return lower_walk_tables(trees, partitions, nodes, call_instances(workers))
