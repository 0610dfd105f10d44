"""Which ranks run a (node, walk) for a request.

In: the plan's workers (placements, TP groups). Out: `Routing.ranks(request_id, node, walk)` ->
the ranks of one instance of that (node, walk): a TP group's ranks (leader first) or one rank.
Data-parallel replicas (several instances of one (node, walk)) are chosen per request by a hash
of its id, so every row of a request stays on the same replica. A (node, walk) that no worker
runs is a `RoutingError` (the plan cannot be driven).
"""
from __future__ import annotations

import zlib

from mstar.plan.schema import Plan

Instance = tuple[int, ...]


class RoutingError(Exception):
    """The plan places no worker for a (node, walk) a request reached."""


class Routing:
    def __init__(self, plan: Plan):
        self.instances = _placement_instances(plan)
        # (node, walk) -> ranks, for pairs one instance runs (most of them): no per-row choice.
        self.single = {pair: found[0] for pair, found in self.instances.items() if len(found) == 1}

    def ranks(self, request_id: str, node: str, walk: str) -> Instance:
        found = self.single.get((node, walk))
        if found is not None:
            return found
        instances = self.instances.get((node, walk))
        if not instances:
            raise RoutingError(f"the plan places no worker for {node}/{walk}; recompile the plan")
        return instances[zlib.crc32(request_id.encode()) % len(instances)]


def _placement_instances(plan: Plan) -> dict[tuple[str, str], list[Instance]]:
    """(node, walk) -> instances that run it: a TP group's ranks (leader first) or one rank."""
    instances: dict[tuple[str, str], list[Instance]] = {}
    for worker in plan.workers:
        for placement in worker.placements:
            node, walk = placement.split("/", 1)
            group = next((g for g in worker.tp_groups if g.node == node and walk in g.walks), None)
            if group is None:
                instance: Instance = (worker.rank,)
            else:
                instance = (group.leader,) + tuple(r for r in group.ranks if r != group.leader)
            found = instances.setdefault((node, walk), [])
            if instance not in found:
                found.append(instance)
    return instances
