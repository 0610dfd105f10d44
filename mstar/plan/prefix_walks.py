"""Which (node, walk) pairs of a plan may start a request's row after its cached prefix: the plan's
kv pools with the prefix cache on (`KvPoolPlan.prefix_cache == "pages"`) and their `prefix_walks`.
Shared by the conductor (which asks the engine to claim a prompt's cached pages before such a
row) and the rank processes' controller (which claims them on the instance running those walks).
"""
from __future__ import annotations

from mstar.plan.schema import Plan


def prefix_walk_pairs(plan: Plan) -> frozenset[tuple[str, str]]:
    """(node, walk) of every walk whose first row on the node may start after a cached prefix."""
    return frozenset((pool.node, walk) for pool in plan.deployment.kv_pools if pool.prefix_cache == "pages"
                     for walk in pool.prefix_walks)
