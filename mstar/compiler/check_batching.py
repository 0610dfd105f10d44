"""Batching rules (`batching WALK same shape, iteration, guidance`), checked per node in pass 5.

In:  the spec, one node, the nodes each walk runs, the run's `Diagnostics`.
Out: nothing; adds MW401 (a rule for a walk that does not run the node) and MW412 when a rule
     cannot apply to its walk:
- a walk has one `batching` line per node (its rules are one set);
- `iteration`: the node's calls in the walk are inside a loop (else every row is at iteration 0);
- `guidance`: the node has guidance sequences (else every row has the same, empty, mode);
- the walk is in no combined walk of the node: a step of a walk with rules holds that walk's rows
  only (the scheduler never mixes it), so a combined walk could never run its mixed steps.
"""
from __future__ import annotations

from mstar.compiler import codes
from mstar.compiler.resolve import iter_sections, name_span
from mstar.lang import ast
from mstar.lang.diagnostics import Diagnostics, Note


def check_node(spec: ast.Spec, node: ast.NodeDecl, runs: dict[str, set[str]], diags: Diagnostics) -> None:
    seen: dict[str, ast.BatchingDecl] = {}
    walks = {w.name: w for w in spec.walks}
    for decl in node.batching:
        where = name_span(decl.span, decl.walk, diags)
        if decl.walk in seen:
            diags.error(codes.BATCHING_RULE_CANNOT_APPLY,
                        f"walk {decl.walk} has a second batching line on {node.name}; list every rule on one",
                        where, Note("the first", seen[decl.walk].span))
            continue
        seen[decl.walk] = decl
        if decl.walk in runs and node.name not in runs[decl.walk]:
            diags.error(codes.NOT_A_WALK_OF_NODE, f"batching rule for walk {decl.walk}, which does not run "
                        f"{node.name}", where)
            continue
        walk = walks.get(decl.walk)
        if walk is not None and "iteration" in decl.rules and not _is_in_loop(walk, node.name):
            diags.error(codes.BATCHING_RULE_CANNOT_APPLY,
                        f"batching {decl.walk} same iteration: walk {decl.walk} calls {node.name} in no loop, "
                        f"so every row is at iteration 0", name_span(decl.span, "iteration", diags))
        if "guidance" in decl.rules and not node.guidance:
            diags.error(codes.BATCHING_RULE_CANNOT_APPLY,
                        f"batching {decl.walk} same guidance: {node.name} has no guidance sequence, so every "
                        f"row has the same guidance mode", name_span(decl.span, "guidance", diags))
        for combine in node.combines:
            if decl.walk in combine.walks:
                diags.error(codes.BATCHING_RULE_CANNOT_APPLY,
                            f"walk {decl.walk} has batching rules and is in combined walk {combine.name}: a step "
                            f"of a walk with rules holds only its own rows, so no mixed step could run",
                            where, Note("the combined walk", name_span(combine.span, combine.name, diags)))


def _is_in_loop(walk: ast.Walk, node: str) -> bool:
    """Whether some call of `node` in the walk is inside a loop."""
    for section in iter_sections(walk.body):
        if isinstance(section, ast.Loop) and any(
                isinstance(inner, ast.Call) and inner.node == node for inner in iter_sections(section.body)):
            return True
    return False
