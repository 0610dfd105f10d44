"""A capture family's key beyond its buckets: the guidance mode of the steps that replay it and the
KV sequences its graphs touch (the reference's `requires_cfg` and `labels`).

In:  a node declaration, one of its captures and the walks whose steps replay it (the capture's
     walk, or a combined walk's walks).
Out:
    sequences(node) -> list[str]                   the node's KV sequences, then its cross_kv pools
    guidance_labels(node) -> list[str]             its guidance sequences (declaration order)
    touched(node, walks, is_guided) -> list[str]   the sequences steps of those walks touch in that
                                                   guidance mode, in `sequences` order
    plan_guidance(capture) -> "any" | "guided" | "unguided"   the plan's CaptureFamily.guidance
    family_labels(node, capture, walks) -> list[str]          the plan's CaptureFamily.labels
    num_self_sequences(node, labels) -> int        the self-attention sequences a row of the family
                                                   runs (at least 1), for the memory estimate

What a step touches (the engine's rule, mstar/runtime/engine/runners/guidance.py): a walk's rows
read and write its `kv` line's sequences (a walk without one: the first sequence), but an
unguided request keeps only the first sequence, so an unguided step touches its walk's sequences
less the guidance ones. A capture's `labels`, when written, must be exactly what its steps touch
(MW419, check_capture_keys.py); when not written they are that set (a capture both modes replay
touches one set in both, or MW419 refuses it). A stateless node touches none.
"""
from __future__ import annotations

from typing import Literal

from mstar.lang import ast

# The label of a kv node's one KV sequence when the spec declares none (a label is for people).
DEFAULT_KV_SEQUENCE = "main"
PlanGuidance = Literal["any", "guided", "unguided"]


def sequences(node: ast.NodeDecl) -> list[str]:
    if node.engine != "kv":
        return []
    labels = list(node.kv_sequences.labels) if node.kv_sequences is not None else [DEFAULT_KV_SEQUENCE]
    return labels + [cross.label for cross in node.cross_kv if cross.label not in labels]


def guidance_labels(node: ast.NodeDecl) -> list[str]:
    return [g.label for g in node.guidance] if node.engine == "kv" else []


def touched(node: ast.NodeDecl, walks: list[str], is_guided: bool) -> list[str]:
    order = sequences(node)
    if not order:
        return []
    stated = {a.walk: a for a in node.kv_access}
    used: set[str] = set()
    for walk in walks:
        access = stated.get(walk)
        used |= set(access.reads) | set(access.writes) if access is not None else {order[0]}
    if not is_guided:
        used -= set(guidance_labels(node))
    return [label for label in order if label in used]


def plan_guidance(capture: ast.CaptureDecl) -> PlanGuidance:
    return capture.guidance if capture.guidance is not None else "any"


def family_labels(node: ast.NodeDecl, capture: ast.CaptureDecl, walks: list[str]) -> list[str]:
    """The labels as written (in the node's order), else what the capture's steps touch: those of
    its mode, or for a capture of both modes the guided set (equal to the unguided one, or MW419)."""
    order = sequences(node)
    if capture.labels:
        return [label for label in order if label in capture.labels]
    return touched(node, walks, is_guided=capture.guidance != "unguided")


def num_self_sequences(node: ast.NodeDecl, labels: list[str]) -> int:
    own = set(node.kv_sequences.labels) if node.kv_sequences is not None else {DEFAULT_KV_SEQUENCE}
    return max(1, sum(1 for label in labels if label in own))
