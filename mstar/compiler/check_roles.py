"""Pass 5b, roles: what each value is, as the spec states it, fits where the value goes.

In:  a `Spec` that passed every other check (names resolve, walks and partitions are well formed),
     and the run's `Diagnostics`.
Out: nothing; adds
     MW113 a stateless node without a model kind;
     MW114 an input without a role;
     MW115 an edge whose name is not a declared output (`out NAME: ROLE`) of the calling node;
     MW116 a walk where requests enter a partition that takes no prompt input;
     MW117 an edge whose output role does not fit the destination input's role;
     MW118 a client edge whose modality does not fit the output's role;
     MW119 a prompt on an input that cannot take it (a stream input, a role that does not fit the
           modality, two inputs of one node for the same modality);
     MW120 guidance or kv access naming no KV sequence of the node (or on the node's first sequence,
           which holds the whole prompt, or on a node without `kv_sequences`);
     MW121 kv access missing on a node with several sequences or a cross_kv pool, a kv line that
           leaves a pool of the node out, or an image-flow walk that writes (it only reads; any
           other walk may write, or only read: a read-only KV walk);
     and runs check_cross (MW130-MW133, cross-attention KV pools).
     MW122 a role the node's model kind does not take or produce.

Runs after the deployment and combine checks (like the old MW113): a spec broken in its shape
reports that first (names that do not resolve are skipped here, never a crash). The runtime reads
only the roles lowered from here (docs/language.md "Roles").
"""
from __future__ import annotations

from typing import Iterator, Literal, Optional

from mstar.compiler import check_cross, codes
from mstar.compiler.resolve import iter_calls, name_span, walk_nodes
from mstar.lang import ast
from mstar.lang.diagnostics import Diagnostics, Note

# Output role -> the input roles a value of it may feed (`signal` inputs take anything).
FEEDS: dict[str, frozenset[str]] = {
    "tokens": frozenset({"tokens"}),
    "embeddings": frozenset({"embeddings", "hidden"}),
    "hidden": frozenset({"embeddings", "hidden"}),
    "velocity": frozenset({"embeddings", "hidden"}),
    "mask": frozenset({"mask"}),
    "flow_latents": frozenset({"flow_latents"}),
    "flow_time": frozenset({"flow_time"}),
    "audio": frozenset({"media"}),
    "image": frozenset({"media"}),
    "transcript": frozenset({"tokens"}),
    "signal": frozenset({"signal"}),
}
# Client modality -> the output roles it carries.
CLIENT_ROLES = {"text": ("tokens", "transcript"), "audio": ("audio",), "image": ("image",),
                "action": ("flow_latents",), "latents": ("hidden", "embeddings")}
# Prompt modality -> the input role that receives it.
PROMPT_ROLE = {"text": "tokens", "image": "media", "audio": "media"}
# Model kind -> (input roles it takes, output roles it produces). A kv node is a decoder.
DECODER: Literal["decoder"] = "decoder"
KIND_ROLES: dict[str, tuple[frozenset[str], frozenset[str]]] = {
    DECODER: (frozenset({"tokens", "embeddings", "hidden", "mask", "flow_latents", "flow_time", "signal"}),
              frozenset({"tokens", "embeddings", "hidden", "mask", "velocity", "flow_latents", "flow_time",
                         "transcript", "signal"})),
    "audio_codec": (frozenset({"tokens", "signal"}), frozenset({"audio"})),
    "image_decoder": (frozenset({"flow_latents", "signal"}), frozenset({"image"})),
    "vision_encoder": (frozenset({"media", "signal"}), frozenset({"embeddings", "hidden"})),
    "audio_encoder": (frozenset({"media", "signal"}), frozenset({"embeddings", "hidden", "signal"})),
}


def model_kind(node: ast.NodeDecl) -> Optional[Literal["decoder"] | ast.ModelKind]:
    return DECODER if node.engine == "kv" else node.model_kind


def run(spec: ast.Spec, diags: Diagnostics) -> None:
    nodes = {n.name: n for n in spec.nodes}
    for node in spec.nodes:
        _check_node(node, diags)
        _check_sequences(spec, node, diags)
    for walk in spec.walks:
        for call in iter_calls(walk.body):
            _check_call(call, nodes, diags)
    _check_entries(spec, nodes, diags)
    check_cross.run(spec, diags)


# ---------------------------------------------------------------- nodes


def _check_node(node: ast.NodeDecl, diags: Diagnostics) -> None:
    kind = model_kind(node)
    if kind is None:
        diags.error(codes.MISSING_MODEL_KIND,
                    f"stateless node {node.name} does not say what model it is; write "
                    f"`node {node.name} stateless KIND` with KIND one of "
                    f"{', '.join(k for k in KIND_ROLES if k != DECODER)} (a decoder is a `kv` node: "
                    f"`node {node.name} kv(...)`)",
                    name_span(node.span, node.name, diags))
    takes, makes = KIND_ROLES.get(kind or "", (None, None))
    prompted: dict[str, ast.InputDecl] = {}
    for decl in node.inputs:
        if decl.role is None:
            diags.error(codes.INPUT_WITHOUT_ROLE,
                        f"input {decl.name} of node {node.name} has no role; write `in {decl.name}: ROLE` "
                        f"with ROLE one of {', '.join(ast.INPUT_ROLES)}", decl.span)
            continue
        if takes is not None and decl.role not in takes:
            diags.error(codes.ROLE_FOR_KIND,
                        f"a node of kind {kind} does not take `{decl.role}` (input {decl.name} of node {node.name}; "
                        f"it takes {', '.join(sorted(takes))})", decl.span)
        if decl.prompt is not None:
            _check_prompt(node, decl, prompted, diags)
    for out in node.outputs:
        if makes is not None and out.role not in makes:
            diags.error(codes.ROLE_FOR_KIND,
                        f"a node of kind {kind} does not produce `{out.role}` (output {out.name} of node {node.name}; "
                        f"it produces {', '.join(sorted(makes))})", out.span)


def _check_prompt(node: ast.NodeDecl, decl: ast.InputDecl, prompted: dict[str, ast.InputDecl],
                  diags: Diagnostics) -> None:
    modality = decl.prompt or ""
    if decl.is_stream:
        diags.error(codes.BAD_PROMPT, f"stream input {decl.name} of node {node.name} cannot take the "
                    "request's prompt: its values come from the stream", decl.span)
    elif decl.role != PROMPT_ROLE[modality]:
        diags.error(codes.BAD_PROMPT, f"a {modality} prompt is `{PROMPT_ROLE[modality]}`, not `{decl.role}` "
                    f"(input {decl.name} of node {node.name})", decl.span)
    elif modality in prompted:
        diags.error(codes.BAD_PROMPT, f"node {node.name} takes the {modality} prompt on two inputs",
                    decl.span, Note("the first one", prompted[modality].span))
    else:
        prompted[modality] = decl


def _check_sequences(spec: ast.Spec, node: ast.NodeDecl, diags: Diagnostics) -> None:
    """MW120 / MW121: guidance labels and kv access against the node's KV sequences."""
    labels = node.kv_sequences.labels if node.kv_sequences is not None else []
    where = f"node {node.name}"

    def unknown(label: str, span: ast.Span, what: str) -> None:
        if node.engine != "kv":
            reason = "a stateless node keeps no KV sequences"
        elif not labels:
            reason = f"{where} declares no `kv_sequences`"
        else:
            reason = f"the sequences of {where} are {', '.join(labels)}"
        diags.error(codes.UNKNOWN_KV_SEQUENCE, f"{what} '{label}' is not a KV sequence: {reason}",
                    name_span(span, label, diags))

    for guidance in node.guidance:
        if guidance.label not in labels:
            unknown(guidance.label, guidance.span, "guidance label")
        elif guidance.label == labels[0]:
            diags.error(codes.UNKNOWN_KV_SEQUENCE,
                        f"guidance label '{guidance.label}' is the first sequence of {where}, which holds the "
                        "whole prompt; guidance labels name the other sequences",
                        name_span(guidance.span, guidance.label, diags))
    flow_walks = {w.name for w in spec.walks
                  if any(call.node == node.name and _takes_flow(node, call) for call in iter_calls(w.body))}
    pools = [c.label for c in node.cross_kv]
    declared: dict[str, ast.KvAccess] = {}
    for access in node.kv_access:
        declared.setdefault(access.walk, access)
        for label in access.reads + access.writes:
            if label not in labels and label not in pools:
                unknown(label, access.span, f"kv {access.walk} names")
        if access.walk in flow_walks and set(access.writes) - set(pools):
            diags.error(codes.KV_ACCESS_MISMATCH, f"walk {access.walk} runs an image flow on {where}, which "
                        "reads the KV context without extending it; write `reads`, not `writes`", access.span)
        missing = [p for p in pools if p not in access.reads + access.writes]
        if missing:
            diags.error(codes.KV_ACCESS_MISMATCH,
                        f"walk {access.walk} leaves cross_kv {', '.join(missing)} of {where} out; its layers "
                        f"cross-attend in every call: write `reads {' '.join(missing)}` (or `writes` where the "
                        "walk fills it)", access.span)
    if node.engine == "kv" and (len(labels) > 1 or pools):
        kept = f"{len(labels)} KV sequences" if len(labels) > 1 else "cross_kv " + ", ".join(pools)
        for walk in spec.walks:
            if node.name in walk_nodes(walk) and walk.name not in declared:
                diags.error(codes.KV_ACCESS_MISMATCH,
                            f"{where} keeps {kept}, so walk {walk.name} must say which it "
                            f"reads or writes: `kv {walk.name} writes ...`", name_span(node.span, node.name, diags))


def _takes_flow(node: ast.NodeDecl, call: ast.Call) -> bool:
    roles = {d.name: d.role for d in node.inputs}
    return any(roles.get(name) == "flow_latents" for name in call.inputs)


# ---------------------------------------------------------------- edges


def _check_call(call: ast.Call, nodes: dict[str, ast.NodeDecl], diags: Diagnostics) -> None:
    node = nodes.get(call.node)
    if node is None:  # an unknown node is resolve's MW101
        return
    outputs = {o.name: o for o in node.outputs}
    for edge in call.edges:
        out = outputs.get(edge.name)
        if out is None:
            known = ", ".join(outputs) or "none"
            diags.error(codes.UNKNOWN_OUTPUT,
                        f"edge '{edge.name}' is not an output of node {node.name}; declare it with "
                        f"`out {edge.name}: ROLE` (outputs: {known})", name_span(edge.span, edge.name, diags))
            continue
        if edge.dest == "client":
            modality = edge.modality or ""
            carried = CLIENT_ROLES.get(modality, ())
            if out.role not in carried:
                roles = " or ".join(f"`{r}`" for r in carried)
                diags.error(codes.CLIENT_MODALITY_MISMATCH,
                            f"`client {modality}` carries {roles}, but output {edge.name} "
                            f"of node {node.name} is `{out.role}`", edge.span,
                            Note(f"{edge.name} is declared `{out.role}` here", out.span))
        elif edge.dest in nodes:
            dest = nodes[edge.dest]
            decl = next((d for d in dest.inputs if d.name == edge.name), None)
            if decl is None or decl.role is None or decl.role == "signal":
                continue
            if decl.role not in FEEDS[out.role]:
                diags.error(codes.ROLE_MISMATCH,
                            f"output {edge.name} of node {node.name} is `{out.role}` but input {edge.name} of "
                            f"node {dest.name} takes `{decl.role}`", edge.span,
                            Note(f"input {edge.name} is declared here", decl.span))


# ---------------------------------------------------------------- where requests enter


def _entry_walks(spec: ast.Spec) -> Iterator[tuple[str, ast.Span]]:
    """(walk, span to blame) for every walk a request may start a partition with: the walks of its
    stages up to the first stage that is not optional, in partitions that streams do not feed;
    and the first walk no partition lists (the implicit partition)."""
    listed: set[str] = set()
    for partition in spec.partitions:
        listed.update(w for stage in partition.stages for w in stage.walks)
        if partition.streams:
            continue
        for stage in partition.stages:
            for sequence in ast.alternatives(stage):
                yield sequence[0], stage.span
            if not stage.is_optional:
                break
    unlisted = [w for w in spec.walks if w.name not in listed]
    if unlisted:
        yield unlisted[0].name, unlisted[0].span


def _check_entries(spec: ast.Spec, nodes: dict[str, ast.NodeDecl], diags: Diagnostics) -> None:
    walks = {w.name: w for w in spec.walks}
    for name, span in _entry_walks(spec):
        walk = walks.get(name)
        if walk is None:  # an unknown walk is resolve's MW103
            continue
        takes_prompt = any(
            decl.prompt is not None
            for call in iter_calls(walk.body) if call.node in nodes
            for decl in nodes[call.node].inputs if decl.name in call.inputs
        )
        if not takes_prompt:
            diags.error(codes.NO_PROMPT_INPUT,
                        f"requests enter with walk {name}, but it calls no input that takes the request's "
                        "prompt; mark one `in NAME: tokens prompt text` (or `media prompt image|audio`)",
                        name_span(span, name, diags))
