"""The most output tokens a request can get from a plan: what its walks' loops and stages allow,
whatever max_tokens asks (a request asking more is refused up front: serve/plan_checks.py).

A partition counts the elements of its calls' `counted` outputs (conductor.py `count`). Where each
such output is a kv node's `tokens` or `transcript` output, a call makes one token a row, or 1 + depth
where a depth model extends that output on the call's walk (`SubModelPlan.samples`); a call inside
loops runs at most the product of their `max_iters`; a stage runs the walks of one alternative
(the largest counts); a partition that repeats runs its stages `max_rounds` times. Any other
counted output (a stateless node's, or another role) has no size the plan states: then no bound.

    most_counted_tokens(plan) -> Optional[int]   the largest partition's bound, None if unknown
    partition_bound(plan, partition) -> Optional[int]
    frame_depths(node, walk) -> {output: depth}   the depth models extending a call's outputs
    excess_tokens_problem(what, asked, most) -> Optional[str]   the refusal of asking past it
"""
from __future__ import annotations

import math
from typing import Optional

from mstar.arg_types import shown
from mstar.plan.loop_nesting import loops_around_calls
from mstar.plan.schema import NodePlan, PartitionPlan, Plan, StagePlan, WalkPlan
from mstar.plan.stages import alternatives

# a kv node's sampled output: one token a row a call (a call with one samples; the sim engine reads this too)
SAMPLED_ROLES = ("tokens", "transcript")


def most_counted_tokens(plan: Plan) -> Optional[int]:
    """The most counted tokens any partition of `plan` can make for one request; None when a counted
    output's size is not stated by the plan, or no partition counts any."""
    bounds = [partition_bound(plan, partition) for partition in plan.partitions]
    if any(b is None for b in bounds):
        return None
    counting = [b for b in bounds if b]
    return max(counting) if counting else None


def excess_tokens_problem(what: str, asked: int, most: Optional[int]) -> Optional[str]:
    """Why `asked` output tokens (named `what`: max_tokens, --output-len, ...) cannot be had when the
    plan makes at most `most` for a request (`most_counted_tokens`; None: no bound), or None. Such a
    request ran and ended `length` at that count. `asked` is the request's, echoed clipped (`shown`: a
    4000-digit max_tokens was echoed whole, and one past 4,300 digits raised ValueError)."""
    if most is None or asked <= most:
        return None
    return (f"{what} {shown(asked)} is more than this plan makes for a request: at most {most} output tokens (its "
            "loops' max iterations over its stages)")


def partition_bound(plan: Plan, partition: PartitionPlan) -> Optional[int]:
    walks = {walk.name: walk for walk in plan.walks}
    nodes = {node.name: node for node in plan.nodes}
    total = 0
    for stage in partition.stages:
        stage_bound = _stage_bound(stage, walks, nodes)
        if stage_bound is None:
            return None
        total += stage_bound
    return total * (partition.repeat.max_rounds if partition.repeat else 1)


def _stage_bound(stage: StagePlan, walks: dict[str, WalkPlan], nodes: dict[str, NodePlan]) -> Optional[int]:
    """The largest alternative: one walk each, or a sequence of walks each in order."""
    best = 0
    for alternative in alternatives(stage):
        bounds = [walk_bound(walks[name], nodes) for name in alternative]
        if any(b is None for b in bounds):
            return None
        best = max(best, sum(b for b in bounds if b is not None))
    return best


def walk_bound(walk: WalkPlan, nodes: dict[str, NodePlan]) -> Optional[int]:
    """The most counted tokens one run of `walk` makes."""
    around = loops_around_calls(walk)
    total = 0
    for index, call in enumerate(walk.calls):
        if not call.counted or index not in around:
            continue
        per_call = _tokens_a_call(call.counted, nodes[call.node], walk.name)
        if per_call is None:
            return None
        total += per_call * math.prod(walk.loops[loop].max_iters for loop in around[index])
    return total


def _tokens_a_call(counted: list[str], node: NodePlan, walk: str) -> Optional[int]:
    roles = {output.name: output.role for output in node.outputs}
    if node.engine != "kv" or any(roles.get(name) not in SAMPLED_ROLES for name in counted):
        return None
    depth = frame_depths(node, walk)
    return sum(1 + depth.get(name, 0) for name in counted)


def frame_depths(node: NodePlan, walk: str) -> dict[str, int]:
    """{tokens output: depth} of the depth models extending `node`'s outputs on `walk` (a frame of
    1 + depth tokens a row)."""
    return {sub.samples: sub.depth for sub in node.submodels if sub.samples and walk in sub.walks}
