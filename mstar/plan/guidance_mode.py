"""When a request requires guidance on a node: the plan's rule, shared by the run loop (which tells
the scheduler, whose capture pick keys on it), the engine (which keeps the guidance sequences of
such a request) and the engine's check of a step's guidance mode.

In:  a kv node's `NodePlan` (its `guidance` labels with their default scales, its `kv_access`),
     the scales a request sets by label, and the walks its explicit route names.
Out: `GuidanceRule.of(node)`, whose `requires(scales, route_walks) -> bool` says: the node has
     guidance sequences, some guidance label's scale for the request (its own, else the spec's
     default) is above 1, and the route takes a walk that reads a guidance sequence on the node
     (`guided_walks`; BAGEL's `requires_cfg`: image output and a scale above 1).

A step is guided when any of its rows' requests requires guidance (the reference's rule for
matching a batch to a capture: only configs whose `requires_cfg` equals it are candidates).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Collection, Mapping, Optional

from mstar.arg_types import shown
from mstar.plan.schema import NodePlan, Plan


@dataclass(frozen=True)
class GuidanceRule:
    defaults: tuple[tuple[str, float], ...]  # (guidance label, default scale), declaration order
    guided_walks: frozenset[str]  # walks that read a guidance sequence on the node

    @classmethod
    def of(cls, node: NodePlan) -> "GuidanceRule":
        labels = {g.label for g in node.guidance}
        return cls(
            defaults=tuple((g.label, g.scale) for g in node.guidance),
            guided_walks=frozenset(a.walk for a in node.kv_access if labels.intersection(a.reads)),
        )

    def requires(self, scales: Mapping[str, float], route_walks: Collection[str]) -> bool:
        if not any(scales.get(label, default) > 1.0 for label, default in self.defaults):
            return False
        return not self.guided_walks.isdisjoint(route_walks)


def unknown_label_problem(plan: Plan, scales: Collection[str]) -> Optional[str]:
    """A guidance label a request sets that no node of the plan declares (the torch engine's
    admission and the Python API's up-front check), else None. The label is the request's, so it is
    echoed clipped (`shown`: a 10,000-character label was echoed whole)."""
    labels = list(dict.fromkeys(g.label for node in plan.nodes for g in node.guidance))
    unknown = sorted(set(scales) - set(labels))
    if not unknown:
        return None
    return f"guidance {shown(unknown[0])} is not a guidance label of the plan (labels: {', '.join(labels) or 'none'})"
