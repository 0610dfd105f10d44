"""Sub-models (`submodel NAME(ARGS) for WALK ...`), checked per node in pass 5.

In:  one node, the nodes each walk runs, the run's `Diagnostics` (arguments were checked against
     node_args.SUBMODEL_ARGS in check_args, MW109/MW110).
Out: nothing; adds MW401 (a sub-model for a walk that does not run the node) and MW124 when a
     sub-model cannot share the node's KV cache:
- only a kv node has sub-models (they attend over its KV cache), and not a decoder of a style
  whose runner runs one model (Whisper's, which cross-attends: check_cross.CROSS_STYLES);
- a walk runs on one model of the node: it is in at most one sub-model, and sub-model names differ;
- the sub-model's query heads are a multiple of the node's KV heads (its attention reads them).
"""
from __future__ import annotations

from mstar.compiler import codes
from mstar.compiler.check_cross import CROSS_STYLES
from mstar.compiler.resolve import name_span
from mstar.lang import ast
from mstar.lang.diagnostics import Diagnostics, Note


def check_node(node: ast.NodeDecl, runs: dict[str, set[str]], diags: Diagnostics) -> None:
    owner: dict[str, ast.SubModelDecl] = {}
    names: dict[str, ast.SubModelDecl] = {}
    style = next((a.value for a in node.args if a.name == "style"), None)
    for sub in node.submodels:
        where = name_span(sub.span, sub.name, diags)
        if node.engine != "kv":
            diags.error(codes.SUBMODEL_CANNOT_SHARE,
                        f"sub-model {sub.name} on stateless node {node.name}: a sub-model shares a kv node's "
                        f"KV cache", where)
            continue
        if style in CROSS_STYLES:
            diags.error(codes.SUBMODEL_CANNOT_SHARE,
                        f"sub-model {sub.name} on node {node.name}: a {style} decoder runs one model", where)
            continue
        if sub.name in names:
            diags.error(codes.SUBMODEL_CANNOT_SHARE, f"node {node.name} declares sub-model {sub.name} twice",
                        where, Note("first here", names[sub.name].span))
        names.setdefault(sub.name, sub)
        for walk in sub.walks:
            if walk in owner:
                diags.error(codes.SUBMODEL_CANNOT_SHARE,
                            f"walk {walk} runs on sub-model {owner[walk].name} of {node.name} already; a walk "
                            f"runs on one model", name_span(sub.span, walk, diags, skip=1 if walk == sub.name else 0),
                            Note("the first", owner[walk].span))
                continue
            owner[walk] = sub
            if walk in runs and node.name not in runs[walk]:
                diags.error(codes.NOT_A_WALK_OF_NODE, f"sub-model {sub.name} for walk {walk}, which does not run "
                            f"{node.name}", name_span(sub.span, walk, diags))
        _check_heads(node, sub, diags)


def _check_heads(node: ast.NodeDecl, sub: ast.SubModelDecl, diags: Diagnostics) -> None:
    args = {a.name: a for a in node.args}
    sub_args = {a.name: a for a in sub.args}
    kv_heads = args["kv_heads"].value if "kv_heads" in args else 1
    qo_heads = sub_args["qo_heads"].value if "qo_heads" in sub_args else None
    if isinstance(kv_heads, int) and isinstance(qo_heads, int) and kv_heads > 0 and qo_heads % kv_heads:
        diags.error(codes.SUBMODEL_CANNOT_SHARE,
                    f"sub-model {sub.name}: qo_heads={qo_heads} is not a multiple of {node.name}'s "
                    f"kv_heads={kv_heads}, whose KV cache it attends over", sub_args["qo_heads"].span)
