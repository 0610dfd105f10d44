"""What the plan reserves, for the run report: capture families and their memory, TP groups.

In: a plan. Out: `plan_summary(plan)` -> a JSON-ready dict:

    {"workers": {rank: {"capture_memory_mib", "captures": {family: {kind, num_graphs, memory_mib,
                 batch_sizes, token_buckets}}, "tp_groups": [{node, walks, ranks, tp_size, sp_size,
                 leader}]}},
     "capture_memory_budget_mib": the deployment's budget (None: no budget),
     "tp_nodes": nodes the spec lets run tensor-parallel}

The capture memory is the compiler's estimate; a GPU engine compares it with what capture takes.
"""
from __future__ import annotations

from typing import Any, Optional

from mstar.plan.schema import Plan

MIB = float(1 << 20)


def _mib(num_bytes: Optional[int]) -> Optional[float]:
    return None if num_bytes is None else round(num_bytes / MIB, 3)


def plan_summary(plan: Plan) -> dict[str, Any]:
    workers: dict[str, Any] = {}
    for worker in plan.workers:
        captures = {
            family.name: {"kind": family.kind, "num_graphs": family.num_graphs, "memory_mib": _mib(family.memory_bytes),
                          "batch_sizes": list(family.batch_sizes), "token_buckets": list(family.token_buckets)}
            for key in worker.keys for family in key.captures
        }
        groups = [{"node": g.node, "walks": list(g.walks), "ranks": list(g.ranks), "tp_size": g.tp_size,
                   "sp_size": g.sp_size, "leader": g.leader} for g in worker.tp_groups]
        workers[str(worker.rank)] = {"capture_memory_mib": _mib(worker.capture_memory_bytes),
                                     "captures": captures, "tp_groups": groups}
    return {
        "workers": workers,
        "capture_memory_budget_mib": _mib(plan.deployment.capture_memory_budget_bytes),
        "tp_nodes": [node.name for node in plan.nodes if node.is_tp],
    }
