"""Lowering, part 3: the per-worker tables (one WorkerPlan per rank the deployment uses).

In:  the checked spec, the loaded deployment (`groups_for(node, walk)`, node groups with ranks,
     tp_size, sp_size, graph_walks; `speculation_mixes_walks`), the lowered walks and partitions.
Out: `lower_workers(...) -> list[WorkerPlan]`, sorted by rank; keys in declaration order (node,
     then its combined walks, then its other walks), every other list inside sorted.

Per rank: placements (`node/walk` pairs placed on it), keys and walk_to_key (lower_keys),
routes (each output edge of a placed pair -> destination ranks, stream partition, client or
conductor), speculation switches, the TP groups (tp*sp > 1 instances) holding the rank, and the
capture memory of its keys' capture families.
"""
from __future__ import annotations

from mstar.compiler.deployment import Deployment
from mstar.compiler.lower_keys import lower_node_keys
from mstar.compiler.lower_walks import has_device_loop_back, iter_calls
from mstar.lang import ast
from mstar.plan.schema import (
    PartitionPlan,
    RouteEntry,
    SpeculationPlan,
    TPGroup,
    WalkPlan,
    WorkerPlan,
)


def _instances(group) -> list[list[int]]:
    """The lockstep instances of a node group: consecutive runs of tp*sp ranks."""
    size = group.world_size
    ranks = list(group.ranks)
    return [ranks[i : i + size] for i in range(0, len(ranks), size)]


def _pair_ranks(deployment: Deployment, node: str, walk: str) -> list[int]:
    return sorted({r for g in deployment.groups_for(node, walk) for r in g.ranks})


def _lockstep_size(deployment: Deployment, node: str, walk: str, rank: int) -> int:
    """tp*sp of the group placing (node, walk) on `rank` (1 when it is not lockstep)."""
    for group in deployment.groups_for(node, walk):
        if rank in group.ranks:
            return group.world_size
    return 1


def _tp_size(deployment: Deployment, node: str, walk: str, rank: int) -> int:
    for group in deployment.groups_for(node, walk):
        if rank in group.ranks:
            return group.tp_size
    return 1


def _routes(deployment: Deployment, node: str, walk: WalkPlan, partitions: dict[str, PartitionPlan]) -> list[RouteEntry]:
    routes: dict[tuple, RouteEntry] = {}
    for call in iter_calls(walk.body):
        if call.node != node:
            continue
        for edge in call.edges:
            dest_ranks: list[int] = []
            if edge.dest_kind == "node":
                dest_ranks = _pair_ranks(deployment, edge.dest, walk.name)
            elif edge.dest_kind == "stream" and edge.stream_partition in partitions:
                consumer = partitions[edge.stream_partition]
                ranks = set()
                for stage in consumer.stages:
                    for consumer_walk in stage.walks:
                        ranks.update(_pair_ranks(deployment, edge.dest, consumer_walk))
                dest_ranks = sorted(ranks)
            route = RouteEntry(
                node=node,
                walk=walk.name,
                edge=edge.name,
                dest_kind=edge.dest_kind,
                dest_node=edge.dest,
                dest_ranks=dest_ranks,
                stream_partition=edge.stream_partition,
                modality=edge.modality,
            )
            routes[(edge.name, edge.dest_kind, edge.dest)] = route
    return [routes[k] for k in sorted(routes)]


def _tp_groups(spec: ast.Spec, deployment: Deployment, walks: list[WalkPlan], rank: int) -> list[TPGroup]:
    groups = []
    for group in deployment.node_groups:
        if group.world_size <= 1:
            continue
        for node in group.node_names:
            node_walks = [w.name for w in walks if node in w.nodes]
            if group.graph_walks:
                node_walks = [w for w in node_walks if w in group.graph_walks]
            for instance in _instances(group):
                if rank in instance:
                    groups.append(
                        TPGroup(
                            node=node,
                            walks=sorted(node_walks),
                            ranks=instance,
                            tp_size=group.tp_size,
                            sp_size=group.sp_size,
                            leader=instance[0],
                        )
                    )
    return sorted(groups, key=lambda g: (g.node, g.walks, g.ranks))


def lower_workers(
    spec: ast.Spec,
    deployment: Deployment,
    walks: list[WalkPlan],
    partitions: list[PartitionPlan],
    fallback_cap: int,
) -> list[WorkerPlan]:
    """One WorkerPlan per rank used by the deployment (see the module docstring)."""
    walk_plans = {w.name: w for w in walks}
    partition_plans = {p.name: p for p in partitions}
    spec_walk_order = [w.name for w in spec.walks]
    workers = []
    for rank in deployment.ranks():
        placements, walk_to_key, keys, routes, speculation = [], {}, [], [], []
        for node in spec.nodes:
            walks_here = [
                w for w in spec_walk_order
                if node.name in walk_plans[w].nodes and rank in _pair_ranks(deployment, node.name, w)
            ]
            if not walks_here:
                continue
            tp_sizes = {w: _tp_size(deployment, node.name, w, rank) for w in walks_here}
            node_keys, node_walk_to_key = lower_node_keys(node, walks_here, walk_plans, tp_sizes, fallback_cap)
            keys.extend(node_keys)
            for walk in walks_here:
                pair = f"{node.name}/{walk}"
                placements.append(pair)
                walk_to_key[pair] = node_walk_to_key[walk]
                routes.extend(_routes(deployment, node.name, walk_plans[walk], partition_plans))
                is_lockstep = _lockstep_size(deployment, node.name, walk, rank) > 1
                speculation.append(
                    SpeculationPlan(
                        node=node.name,
                        walk=walk,
                        can_speculate=(
                            node.is_async
                            and not is_lockstep
                            and has_device_loop_back(walk_plans[walk], node.name)
                        ),
                        mixes_walks=deployment.mixes_walks(node.name, walk),
                    )
                )
        families = {f.name: f.memory_bytes for k in keys for f in k.captures}
        workers.append(
            WorkerPlan(
                rank=rank,
                placements=sorted(placements),
                walk_to_key=walk_to_key,
                keys=keys,
                routes=sorted(routes, key=lambda r: (r.node, r.walk, r.edge, r.dest_kind, r.dest_node)),
                speculation=sorted(speculation, key=lambda s: (s.node, s.walk)),
                tp_groups=_tp_groups(spec, deployment, walks, rank),
                capture_memory_bytes=sum(families.values()),
            )
        )
    return workers
