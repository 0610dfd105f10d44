"""Which ranks run a (node, walk) for a request: read from the plan's walk tables.

In: the plan's walk tables (`CallPlan.instances`: per (node, walk) the instances that run it, a
TP group's ranks with the leader first, or one rank) and `deployment.replica_policy`. Out:
`Routing.ranks(request_id, node, walk)` -> the ranks of one instance. Among data-parallel
replicas (several instances of one (node, walk)) a request gets a replica index once, by the
policy ("request_hash": crc32 of its id; "round_robin": the order in which requests first need
one), and keeps it for every call, so its decode runs where its prefill left the KV cache. A
(node, walk) that no worker runs is a `RoutingError` (the plan cannot be driven).
"""
from __future__ import annotations

import zlib

from mstar.plan.schema import Plan

Instance = tuple[int, ...]


class RoutingError(Exception):
    """The plan places no worker for a (node, walk) a request reached."""


class Routing:
    def __init__(self, plan: Plan):
        self.instances: dict[tuple[str, str], list[Instance]] = {
            (call.node, walk.name): [tuple(instance) for instance in call.instances]
            for walk in plan.walks for call in walk.calls
        }
        # (node, walk) -> ranks, for pairs one instance runs (most of them): no per-row choice.
        self.single = {pair: found[0] for pair, found in self.instances.items() if len(found) == 1}
        self.is_hash = plan.deployment.replica_policy == "request_hash"
        self.replica_of: dict[str, int] = {}  # request id -> its replica index (round_robin)
        self.num_assigned = 0

    def ranks(self, request_id: str, node: str, walk: str) -> Instance:
        found = self.single.get((node, walk))
        if found is not None:
            return found
        instances = self.instances.get((node, walk))
        if not instances:
            raise RoutingError(f"the plan places no worker for {node}/{walk}; recompile the plan")
        if self.is_hash:
            return instances[zlib.crc32(request_id.encode()) % len(instances)]
        replica = self.replica_of.get(request_id)
        if replica is None:
            replica = self.replica_of[request_id] = self.num_assigned
            self.num_assigned += 1
        return instances[replica % len(instances)]

    def forget(self, request_id: str) -> None:
        """The request ended: drop its replica index."""
        self.replica_of.pop(request_id, None)
