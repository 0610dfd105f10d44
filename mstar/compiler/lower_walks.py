"""Lowering, part 1: walks and partitions of a checked spec -> section trees / PartitionPlans.

In:  a resolved, checked `Spec` (names resolve, loops are well formed).
Out: `lower_walks(spec) -> list[WalkTree]` (mstar/compiler/walk_tree.py, which also has the
     readers `iter_calls`, `iter_loops`, ...) and `lower_partitions(spec) -> list[PartitionPlan]`.
     `lower_tables` turns the trees into the plan's walk tables.

Loop-back edges are derived structurally, as the reference system does: inside a loop, an edge
from a node to itself, or, inside a sequential list of sections, an edge from a later section to
a node of an earlier one. Every other edge inside the loop is a forward edge or leaves the loop.
Unnamed loops are named `<walk>.loop<i>` (i counts the walk's unnamed loops from 0, in source
order); only loops with `stop` may end early.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterator, Literal

from mstar.lang import ast
from mstar.compiler.walk_tree import (
    TreeCall,
    TreeEdge,
    TreeLoop,
    TreeParallel,
    TreeSection,
    TreeSequential,
    WalkTree,
)
from mstar.plan.schema import ChunkPolicyPlan, PartitionPlan, RepeatPlan, StagePlan, StreamPlan

# Walks that no partition lists form one implicit partition, as in the reference system.
DEFAULT_PARTITION = "default"
CONDUCTOR = "conductor"
CLIENT = "client"


# ---------------------------------------------------------------- reading AST sections


def _ast_calls(sections: list, *, into_loops: bool = True) -> Iterator[ast.Call]:
    for section in sections:
        if isinstance(section, ast.Call):
            yield section
        elif isinstance(section, ast.Loop):
            if into_loops:
                yield from _ast_calls(section.body)
        else:
            yield from _ast_calls(section.body, into_loops=into_loops)


def _ast_nodes(section) -> set[str]:
    return {call.node for call in _ast_calls([section])}


def _loop_back_ids(sequence: list) -> set[int]:
    """ids of the Edge objects that loop back inside `sequence` (a loop body or a nested
    sequential): self edges, and edges from a later section to a node of an earlier one.
    Nested loops own their loop-backs and are not searched."""
    found: set[int] = set()
    earlier: set[str] = set()
    for section in sequence:
        if isinstance(section, ast.Loop):
            earlier |= _ast_nodes(section)
            continue
        for call in _ast_calls([section], into_loops=False):
            for edge in call.edges:
                if edge.is_stream or edge.dest in (CONDUCTOR, CLIENT):
                    continue
                if edge.dest == call.node or edge.dest in earlier:
                    found.add(id(edge))
        if isinstance(section, ast.Sequential):
            found |= _loop_back_ids(section.body)
        elif isinstance(section, ast.Parallel):
            for member in section.body:
                if isinstance(member, ast.Sequential):
                    found |= _loop_back_ids(member.body)
        earlier |= _ast_nodes(section)
    return found


# ---------------------------------------------------------------- lowering


@dataclass
class _WalkContext:
    spec: ast.Spec
    walk: str
    partition: str
    params: dict[str, int]
    stream_targets: dict[tuple[str, str, str], str]  # (producer partition, edge, node) -> consumer
    loop_back_ids: set[int] = field(default_factory=set)
    num_unnamed_loops: int = 0


def _lower_edge(edge: ast.Edge, ctx: _WalkContext) -> TreeEdge:
    dest_kind: Literal["node", "conductor", "client", "stream"]
    if edge.dest == CONDUCTOR:
        dest_kind, dest = "conductor", ""
    elif edge.dest == CLIENT:
        dest_kind, dest = "client", ""
    elif edge.is_stream:
        dest_kind, dest = "stream", edge.dest
    else:
        dest_kind, dest = "node", edge.dest
    stream_partition = None
    if dest_kind == "stream":
        stream_partition = ctx.stream_targets.get((ctx.partition, edge.name, edge.dest))
    return TreeEdge(
        name=edge.name,
        dest_kind=dest_kind,
        dest=dest,
        is_persist=edge.is_persist,
        is_device=edge.is_device,
        is_loop_back=id(edge) in ctx.loop_back_ids,
        is_count_tokens=edge.is_count_tokens,
        modality=edge.modality,
        stream_partition=stream_partition,
    )


def _lower_loop(loop: ast.Loop, ctx: _WalkContext) -> TreeLoop:
    if loop.name is None:
        name = f"{ctx.walk}.loop{ctx.num_unnamed_loops}"
        ctx.num_unnamed_loops += 1
    else:
        name = loop.name
    max_iters = loop.max_iters if isinstance(loop.max_iters, int) else ctx.params[loop.max_iters]
    own_ids = _loop_back_ids(loop.body)
    ctx.loop_back_ids |= own_ids
    body = _lower_sections(loop.body, ctx)
    loop_back = {}
    for call in _ast_calls(loop.body, into_loops=False):
        for edge in call.edges:
            if id(edge) in own_ids:
                loop_back[(edge.dest, edge.name)] = _lower_edge(edge, ctx)
    loop_back_edges = [loop_back[k] for k in sorted(loop_back)]
    return TreeLoop(
        name=name,
        max_iters=max_iters,
        count_param=loop.count,
        default_count=ctx.params[loop.count] if loop.count is not None else None,
        has_stop=loop.has_stop,
        nodes=_first_use_nodes(loop.body),
        loop_back=loop_back_edges,
        is_on_device=bool(loop_back_edges) and all(e.is_device for e in loop_back_edges),
        outputs=list(loop.outputs),
        accumulate=list(loop.accumulate),
        body=body,
    )


def _lower_sections(sections: list, ctx: _WalkContext) -> list[TreeSection]:
    out: list[TreeSection] = []
    for section in sections:
        if isinstance(section, ast.Call):
            edges = [_lower_edge(e, ctx) for e in section.edges]
            out.append(TreeCall(node=section.node, inputs=list(section.inputs), edges=edges))
        elif isinstance(section, ast.Loop):
            out.append(_lower_loop(section, ctx))
        elif isinstance(section, ast.Parallel):
            out.append(TreeParallel(body=_lower_sections(section.body, ctx)))
        else:
            out.append(TreeSequential(body=_lower_sections(section.body, ctx)))
    return out


def _first_use_nodes(sections: list) -> list[str]:
    seen: dict[str, None] = {}
    for call in _ast_calls(sections):
        seen.setdefault(call.node, None)
    return list(seen)


def walk_partitions(spec: ast.Spec) -> dict[str, str]:
    """walk name -> the partition that lists it (DEFAULT_PARTITION when none does)."""
    owner: dict[str, str] = {}
    for partition in spec.partitions:
        for stage in partition.stages:
            for walk in stage.walks:
                owner.setdefault(walk, partition.name)
    return {walk.name: owner.get(walk.name, DEFAULT_PARTITION) for walk in spec.walks}


def _stream_targets(spec: ast.Spec, partition_of: dict[str, str]) -> dict[tuple[str, str, str], str]:
    """(producer partition, edge, consumer node) -> the consumer partition, from `<-` sources."""
    nodes_of_partition: dict[str, set[str]] = {}
    for walk in spec.walks:
        nodes_of_partition.setdefault(partition_of[walk.name], set()).update(_first_use_nodes(walk.body))
    targets: dict[tuple[str, str, str], str] = {}
    for partition in spec.partitions:
        for source in partition.streams:
            for node in sorted(nodes_of_partition.get(partition.name, ())):
                targets.setdefault((source.partition, source.edge, node), partition.name)
    return targets


def lower_walks(spec: ast.Spec, params: dict[str, int]) -> list[WalkTree]:
    """Every walk of the spec as a section tree, in declaration order."""
    partition_of = walk_partitions(spec)
    targets = _stream_targets(spec, partition_of)
    walks = []
    for walk in spec.walks:
        ctx = _WalkContext(spec, walk.name, partition_of[walk.name], params, targets)
        walks.append(
            WalkTree(
                name=walk.name,
                partition=ctx.partition,
                nodes=_first_use_nodes(walk.body),
                body=_lower_sections(walk.body, ctx),
            )
        )
    return walks


def _producer_node(spec: ast.Spec, source: ast.StreamSource) -> str:
    """The node whose calls in `source.partition`'s walks send `source.edge` on a stream."""
    partition = next((p for p in spec.partitions if p.name == source.partition), None)
    walk_names = {w for stage in partition.stages for w in stage.walks} if partition is not None else set()
    for walk in spec.walks:
        if walk.name in walk_names:
            for call in _ast_calls(walk.body):
                if any(edge.name == source.edge and edge.is_stream for edge in call.edges):
                    return call.node
    return ""


def _consumer_node(spec: ast.Spec, partition: ast.Partition, source: ast.StreamSource) -> str:
    """The node of `partition` that takes `source.edge` as a stream input."""
    walk_names = {w for stage in partition.stages for w in stage.walks}
    called = set()
    for walk in spec.walks:
        if walk.name in walk_names:
            called.update(_first_use_nodes(walk.body))
    for node in spec.nodes:
        if node.name in called and any(i.name == source.edge and i.is_stream for i in node.inputs):
            return node.name
    for node in spec.nodes:
        if node.name in called and any(i.name == source.edge for i in node.inputs):
            return node.name
    return sorted(called)[0] if called else ""


def lower_partitions(spec: ast.Spec) -> list[PartitionPlan]:
    """Partitions in declaration order (the implicit one last). A partition fed by streams self-triggers from its stream
    buffers (initial_walk None); any other starts at the first walk of its first stage."""
    partitions = []
    params = ast.values_by_name(spec.params)
    for partition in spec.partitions:
        streams = [
            StreamPlan(
                producer_partition=source.partition,
                edge=source.edge,
                consumer_node=_consumer_node(spec, partition, source),
                policy=ChunkPolicyPlan(
                    kind=source.policy.kind,
                    size=source.policy.size,
                    stride=source.policy.stride,
                    context=source.policy.context,
                    is_continue_after_done=source.policy.is_continue_after_done,
                ),
                keep=source.keep,
                producer_node=_producer_node(spec, source),
            )
            for source in partition.streams
        ]
        stages = [StagePlan(walks=list(s.walks), is_optional=s.is_optional, sequence_lengths=list(s.sequence_lengths))
                  for s in partition.stages]
        initial = None if streams or not stages else stages[0].walks[0]
        repeat = None
        if partition.repeat is not None:
            bound = partition.repeat.max_rounds
            repeat = RepeatPlan(value=partition.repeat.value,
                                max_rounds=bound if isinstance(bound, int) else params[bound])
        partitions.append(
            PartitionPlan(name=partition.name, stages=stages, initial_walk=initial, streams=streams, repeat=repeat)
        )
    # Every walk is in a partition (check_graph, MW209), so there is no implicit one.
    return partitions
