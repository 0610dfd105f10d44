"""Which ranks run a (node, walk): the instances the workers' placements and TP groups give.

    call_instances(workers) -> {(node, walk): [instance, ...]}   an instance: ranks, leader first

mstarc's lowering writes this table into every call of the walk tables (compiler/lower_tables.py),
and `load_plan` checks a plan's calls against it (rank_checks.py): one reading of the workers for
both, so the check cannot drift from what the compiler writes.
"""
from __future__ import annotations

from typing import Optional

from mstar.plan.schema import TPGroup, WorkerPlan


def tp_group_for(worker: WorkerPlan, node: str, walk: str) -> Optional[TPGroup]:
    """The TP group `worker` runs (node, walk) in (the first listed), or None: it runs it alone."""
    return next((g for g in worker.tp_groups if g.node == node and walk in g.walks), None)


def call_instances(workers: list[WorkerPlan]) -> dict[tuple[str, str], list[list[int]]]:
    """(node, walk) -> the instances that run it, in rank order: a TP group's ranks with its
    leader first, or one rank. More than one instance: data-parallel replicas."""
    instances: dict[tuple[str, str], list[list[int]]] = {}
    for worker in workers:
        for placement in worker.placements:
            node, _, walk = placement.partition("/")  # (a placement without one: reference_problems says so)
            group = tp_group_for(worker, node, walk)
            instance = [worker.rank] if group is None else [group.leader] + [r for r in group.ranks
                                                                              if r != group.leader]
            found = instances.setdefault((node, walk), [])
            if instance not in found:
                found.append(instance)
    return instances
