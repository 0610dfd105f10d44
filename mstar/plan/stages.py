"""A partition's stages read as the routes they allow: each stage's alternatives, and the walks a
request takes where its route does not name the partition.

A `StagePlan` holds its alternatives flat: `walks`, split by `sequence_lengths` into sequences when
an alternative runs several walks in order (`(prefill_audio -> prefill_text)?`), else one walk an
alternative. The conductor follows a route with them, the engines and the server find the default
route's walks, and `output_bound` the largest alternative; one reading, so they cannot disagree.
(mstar/lang/ast.py `alternatives` reads the spec's `Stage` the same way, on the compiler's side of
the import directions.)
"""
from __future__ import annotations

from mstar.plan.schema import PartitionPlan, StagePlan


def alternatives(stage: StagePlan) -> list[list[str]]:
    """The stage's alternatives, each the sequence of walks it runs."""
    if not stage.sequence_lengths:
        return [[walk] for walk in stage.walks]
    found, at = [], 0
    for length in stage.sequence_lengths:
        found.append(stage.walks[at:at + length])
        at += length
    return found


def default_walks(part: PartitionPlan) -> list[str]:
    """The walks a request takes in a partition its route does not name: the first alternative (a
    walk, or a sequence of walks) of every stage that is not optional."""
    return [walk for stage in part.stages if not stage.is_optional for walk in alternatives(stage)[0]]
