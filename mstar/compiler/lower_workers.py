"""Lowering, part 3: the per-worker tables (one WorkerPlan per rank the deployment uses).

In:  the checked spec, the loaded deployment (`groups_for(node, walk)`, node groups with ranks,
     tp_size, sp_size, graph_walks; `speculation_mixes_walks`), the lowered walks (section trees).
Out: `lower_workers(...) -> list[WorkerPlan]`, sorted by rank; keys in declaration order (node,
     then its combined walks, then its other walks), every other list inside sorted.

Per rank: placements (`node/walk` pairs placed on it), keys and walk_to_key (lower_keys),
speculation switches, the step token budget and chunk sizes of kv nodes' keys (chunking.py),
the TP groups (tp*sp > 1 instances) holding the rank, and the capture
memory of its keys' capture families. `call_instances(workers)` (plan/instances.py, which
`load_plan` checks by too) reads them back into the (node, walk) -> instances table the walk
tables carry per call (lower_tables).
"""
from __future__ import annotations

from mstar.compiler.chunking import chunk_sizes, holds_only_fixed_rows
from mstar.compiler.deployment import Deployment
from mstar.compiler.lower_keys import lower_node_keys
from mstar.compiler.walk_tree import WalkTree, has_device_loop_back
from mstar.lang import ast
from mstar.plan.schema import (
    KeyPlan,
    SpeculationPlan,
    TPGroup,
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


def _tp_groups(spec: ast.Spec, deployment: Deployment, walks: list[WalkTree], rank: int) -> list[TPGroup]:
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
    walks: list[WalkTree],
    fallback_cap: int,
) -> list[WorkerPlan]:
    """One WorkerPlan per rank used by the deployment (see the module docstring)."""
    walk_plans = {w.name: w for w in walks}
    spec_walk_order = [w.name for w in spec.walks]
    workers = []
    for rank in deployment.ranks():
        placements, walk_to_key, keys, speculation = [], {}, [], []
        for node in spec.nodes:
            walks_here = [
                w for w in spec_walk_order
                if node.name in walk_plans[w].nodes and rank in _pair_ranks(deployment, node.name, w)
            ]
            if not walks_here:
                continue
            tp_sizes = {w: _tp_size(deployment, node.name, w, rank) for w in walks_here}
            node_keys, node_walk_to_key = lower_node_keys(node, walks_here, walk_plans, tp_sizes, fallback_cap)
            node_keys = [_with_chunking(key, node, spec, deployment) for key in node_keys]
            keys.extend(node_keys)
            for walk in walks_here:
                pair = f"{node.name}/{walk}"
                placements.append(pair)
                walk_to_key[pair] = node_walk_to_key[walk]
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
                speculation=sorted(speculation, key=lambda s: (s.node, s.walk)),
                tp_groups=_tp_groups(spec, deployment, walks, rank),
                capture_memory_bytes=sum(families.values()),
            )
        )
    return workers


def _with_chunking(key: KeyPlan, node: ast.NodeDecl, spec: ast.Spec, deployment: Deployment) -> KeyPlan:
    """The key with its node's step token budget (none for a key whose walks run the node only in
    loops: `holds_only_fixed_rows`) and the chunk sizes of its chunkable walks (kv nodes only;
    compiler/chunking.py)."""
    if node.engine != "kv":
        return key
    chunking = deployment.chunking_for(node.name)
    walks = [w for w in spec.walks if w.name in key.walks]
    budget = None if holds_only_fixed_rows(node, walks) else chunking.token_budget
    return key.model_copy(update={"token_budget": budget,
                                  "chunk_sizes": chunk_sizes(node, walks, chunking.chunk_size)})
