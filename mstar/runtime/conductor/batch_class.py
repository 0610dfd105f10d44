"""The batch class of a ready row under its walk's batching rules (KeyPlan.batch_rules).

In:  the conductor (its active requests and plan), the (node, walk) and the rows that became
     ready with the tokens each feeds, and the rules ("shape", "iteration", "guidance").
Out: `batch_classes(...) -> list[tuple]`, one per row: the values the rules compare, in the
     rules' order - the tokens the row feeds (shape), its loop iteration (iteration), and the
     guidance sequences whose scale for this request is above 1 (guidance: the request's own
     scale by label, else the node's default), none when the request does not require guidance
     on the node (plan/guidance_mode.py: the rule the engine keeps guidance sequences by and the
     capture pick keys on, so a step of one class is of one guidance mode). The scheduler puts
     rows in one step only when their classes are equal (scheduler/batch_rules.py).
Called only for pairs with rules, once per row that becomes ready.
"""
from __future__ import annotations

from typing import Any, Sequence


def batch_classes(conductor: Any, node: str, walk: str, request_ids: Sequence[str], num_tokens: Sequence[int],
                  rules: tuple[str, ...]) -> list[tuple]:
    defaults = _guidance_defaults(conductor, node)
    classes = []
    for request_id, tokens in zip(request_ids, num_tokens):
        state = conductor.active.get(request_id)
        values: list[Any] = []
        for rule in rules:
            if rule == "shape":
                values.append(tokens)
            elif rule == "iteration":
                values.append(_iteration(state, node, walk))
            elif state is None or not conductor.requires_guidance(request_id, node):
                values.append(frozenset())
            else:
                scales = state.record.request.guidance
                values.append(frozenset(label for label, scale in defaults if scales.get(label, scale) > 1.0))
        classes.append(tuple(values))
    return classes


def _guidance_defaults(conductor: Any, node: str) -> list[tuple[str, float]]:
    plan = next((n for n in conductor.plan.nodes if n.name == node), None)
    return [(g.label, g.scale) for g in plan.guidance] if plan is not None else []


def _iteration(state: Any, node: str, walk: str) -> int:
    """The loop iteration of the request's ready call of `node` in `walk` (0 outside loops)."""
    partition = state.by_walk.get(walk) if state is not None else None
    run = partition.run if partition is not None else None
    call = run.active.get(node) if run is not None else None
    return run.loop_iteration(call.call.loop) if run is not None and call is not None else 0
