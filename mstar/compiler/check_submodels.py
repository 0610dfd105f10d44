"""Sub-models (`submodel NAME(ARGS) [samples OUTPUT depth=N] for WALK ...`), checked per node in pass 5.

In:  the spec, one node, the nodes each walk runs, the run's `Diagnostics` (arguments were checked
     against node_args.SUBMODEL_ARGS / DEPTH_SUBMODEL_ARGS in check_args, MW109/MW110/MW123).
Out: nothing; adds MW401 (a sub-model for a walk that does not run the node), MW124 when a
     sub-model cannot share the node's KV cache, MW125 when a depth model cannot extend its
     output and the warning MW126 when its frames count as the request's output tokens:
- only a kv node has sub-models (they run beside its KV cache), and not a decoder of a style
  whose runner runs one model (Whisper's, which cross-attends: check_cross.CROSS_STYLES);
- a walk runs on one model of the node: it is in at most one sub-model without `samples`, and
  sub-model names differ;
- the sub-model's query heads are a multiple of the KV heads it attends over (the node's, or a
  depth model's own);
- a depth model (`samples OUTPUT depth=N`) extends a declared `tokens` output of the node by
  N tokens, 1 <= N <= MAX_LAYERS (the runtime builds an embedding and a head per position, as it
  builds a module per layer, and frames of N + 1 tokens: depth=10**12 once compiled, and the
  simulated engine built a frame until memory ran out); every walk it lists emits that output
  from the node's call and runs the node's own model (it reads that model's hidden state and
  token embedding); one depth model per (walk, output); where the output feeds an audio codec
  with `quantizers=Q`, the frame it makes (the node's token and N more) holds Q codes, so
  N + 1 = Q;
- (warning) an edge of the output that counts toward the request's output tokens (`count_tokens`,
  or a `client text` edge, which a partition without `count_tokens` counts) counts N + 1 a frame,
  while the engines reserve and check `prompt + max_tokens` KV positions on the node: a frame takes
  one, so the budget is N + 1 times what the frames need and long requests are refused.
"""
from __future__ import annotations

from mstar.compiler import codes
from mstar.compiler.check_cross import CROSS_STYLES
from mstar.compiler.counting import counted_names
from mstar.compiler.memory_bounds import MAX_LAYERS
from mstar.compiler.resolve import iter_calls, name_span, suggestion
from mstar.lang import ast
from mstar.lang.diagnostics import Diagnostics, Note


def check_node(spec: ast.Spec, node: ast.NodeDecl, runs: dict[str, set[str]], diags: Diagnostics) -> None:
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
            walk_span = name_span(sub.span, walk, diags, skip=_skip(sub, walk))
            if walk in runs and node.name not in runs[walk]:
                diags.error(codes.NOT_A_WALK_OF_NODE, f"sub-model {sub.name} for walk {walk}, which does not run "
                            f"{node.name}", walk_span)
            if sub.samples is not None:
                continue  # a depth model runs after the node's model: the walk keeps its model
            if walk in owner:
                diags.error(codes.SUBMODEL_CANNOT_SHARE,
                            f"walk {walk} runs on sub-model {owner[walk].name} of {node.name} already; a walk "
                            f"runs on one model", walk_span, Note("the first", owner[walk].span))
                continue
            owner[walk] = sub
        _check_heads(node, sub, diags)
    _check_depth_models(spec, node, runs, diags)


def _skip(sub: ast.SubModelDecl, walk: str) -> int:
    """Occurrences of `walk` before the one in the walk list (the name, the sampled output)."""
    return (walk == sub.name) + (walk == sub.samples)


def _check_heads(node: ast.NodeDecl, sub: ast.SubModelDecl, diags: Diagnostics) -> None:
    args = {a.name: a for a in node.args}
    sub_args = {a.name: a for a in sub.args}
    if sub.samples is not None and "kv_heads" in sub_args:  # a depth model attends over its own KV
        kv_heads, whose = sub_args["kv_heads"].value, f"its own kv_heads={sub_args['kv_heads'].value}"
    else:
        kv_heads = args["kv_heads"].value if "kv_heads" in args else 1
        whose = f"{node.name}'s kv_heads={kv_heads}, whose KV cache it attends over"
    qo_heads = sub_args["qo_heads"].value if "qo_heads" in sub_args else None
    if isinstance(kv_heads, int) and isinstance(qo_heads, int) and kv_heads > 0 and qo_heads % kv_heads:
        diags.error(codes.SUBMODEL_CANNOT_SHARE,
                    f"sub-model {sub.name}: qo_heads={qo_heads} is not a multiple of {whose}",
                    sub_args["qo_heads"].span)


def _check_depth_models(spec: ast.Spec, node: ast.NodeDecl, runs: dict[str, set[str]], diags: Diagnostics) -> None:
    outputs = {o.name: o for o in node.outputs}
    walks = {w.name: w for w in spec.walks}
    taken: dict[tuple[str, str], ast.SubModelDecl] = {}
    replaced = {walk: sub for sub in node.submodels if sub.samples is None for walk in sub.walks}
    for sub in node.submodels:
        if sub.samples is None or node.engine != "kv":
            continue
        where = name_span(sub.span, sub.samples, diags, skip=int(sub.samples == sub.name))
        output = outputs.get(sub.samples)
        if output is None:
            diags.error(codes.DEPTH_MODEL_BAD, f"depth model {sub.name} samples {sub.samples}, which is not an "
                        f"output of {node.name}{suggestion(sub.samples, outputs)}", where)
            continue
        if output.role != "tokens":
            diags.error(codes.DEPTH_MODEL_BAD, f"depth model {sub.name} samples {sub.samples}, an output of role "
                        f"{output.role}; a depth model extends a sampled `tokens` output", where,
                        Note("declared here", output.span))
            continue
        if sub.depth < 1:
            diags.error(codes.DEPTH_MODEL_BAD, f"depth model {sub.name}: depth={sub.depth} adds no token; "
                        f"give the number of tokens it samples after the node's (at least 1)", sub.span)
            continue
        if sub.depth > MAX_LAYERS:
            diags.error(codes.DEPTH_MODEL_BAD, f"depth model {sub.name}: depth={sub.depth} is more than the runtime "
                        f"builds (at most {MAX_LAYERS}: a head per position, and frames of depth + 1 tokens)",
                        sub.span)
            continue
        for walk in sub.walks:
            walk_span = name_span(sub.span, walk, diags, skip=_skip(sub, walk))
            if walk not in walks or node.name not in runs.get(walk, set()):
                continue  # MW103 / MW401 above
            if (walk, sub.samples) in taken:
                diags.error(codes.DEPTH_MODEL_BAD, f"walk {walk} has a depth model for {sub.samples} of "
                            f"{node.name} already", walk_span, Note("the first", taken[(walk, sub.samples)].span))
                continue
            taken[(walk, sub.samples)] = sub
            if walk in replaced:
                diags.error(codes.DEPTH_MODEL_BAD, f"depth model {sub.name} for walk {walk}, which runs on sub-model "
                            f"{replaced[walk].name}; a depth model follows the node's own model", walk_span,
                            Note("that sub-model", replaced[walk].span))
                continue
            edges = [e for call in iter_calls(walks[walk].body) if call.node == node.name for e in call.edges
                     if e.name == sub.samples]
            if not edges:
                diags.error(codes.DEPTH_MODEL_BAD, f"depth model {sub.name} for walk {walk}, whose call of "
                            f"{node.name} emits no {sub.samples}", walk_span)
            _check_frame(spec, sub, edges, diags)
            _warn_counted(spec, node, sub, walk, edges, diags)


def _warn_counted(spec: ast.Spec, node: ast.NodeDecl, sub: ast.SubModelDecl, walk: str, edges: list[ast.Edge],
                  diags: Diagnostics) -> None:
    """MW126 where a partition running `walk` counts the depth model's output (lowering's rule)."""
    walks = {w.name: w for w in spec.walks}
    for partition in spec.partitions:
        names_in = {w for stage in partition.stages for w in stage.walks}
        if walk not in names_in:
            continue
        counted = counted_names((e.name, e.is_count_tokens, e.dest == "client" and e.modality == "text")
                                for name in names_in if name in walks for call in iter_calls(walks[name].body)
                                for e in call.edges)
        if sub.samples in counted and edges:
            # the edge that counts here, else (counted through another walk of the partition) the first
            edge = next((e for e in edges if e.is_count_tokens or (e.dest == "client" and e.modality == "text")),
                        edges[0])
            diags.warning(codes.DEPTH_FRAMES_COUNTED,
                          f"{sub.samples} counts as the request's output tokens, {sub.depth + 1} a frame (depth "
                          f"model {sub.name}), but the engines reserve prompt + max_tokens KV positions on "
                          f"{node.name} and a frame takes one: requests reserve {sub.depth + 1} times the pages "
                          f"their frames need; count nothing there (max_tokens then bounds the frames)",
                          edge.span, Note("the depth model", sub.span))
            return


def _check_frame(spec: ast.Spec, sub: ast.SubModelDecl, edges: list[ast.Edge], diags: Diagnostics) -> None:
    """depth + 1 = quantizers of every multi-quantizer codec the output feeds."""
    nodes = {n.name: n for n in spec.nodes}
    for edge in edges:
        dest = nodes.get(edge.dest)
        if dest is None or dest.model_kind != "audio_codec":
            continue
        quantizers = next((a.value for a in dest.args if a.name == "quantizers"), None)
        if isinstance(quantizers, int) and not isinstance(quantizers, bool) and quantizers != sub.depth + 1:
            diags.error(codes.DEPTH_MODEL_BAD,
                        f"depth model {sub.name} makes frames of {sub.depth + 1} codes ({sub.samples} and "
                        f"depth={sub.depth} more) but codec {dest.name} reads {quantizers} quantizers",
                        sub.span, Note("the edge", edge.span))
