"""Pass 5c, cross-attention KV pools: `cross_kv LABEL from INPUT tokens=N` on a kv node.

In:  a `Spec` that passed every other check (run from check_roles, after its own checks), and the
     run's `Diagnostics`.
Out: nothing; adds
     MW130 a cross_kv pool the node cannot hold: on a stateless node, filled from an input that does
           not carry another model's states (`hidden` / `embeddings`, not a stream or a prompt),
           `tokens=0`, or on a decoder whose style has no cross-attention layers (and a `whisper`
           decoder, which cross-attends in every layer, without a pool);
     MW131 a pool no walk fills (no `kv W writes ... LABEL`);
     MW132 a fill that disagrees with the walk's call: the walk writes the pool but its call of
           the node does not take the pool's input, or it passes that input without filling;
     MW133 a walk that only reads a pool (its `kv` line does not also write it) before any walk of
           its partition fills it (an earlier stage).
MW121 (check_roles) covers a walk whose `kv` line leaves a pool of the node out.

A pool is filled once per request by the walk that writes it (the decoder's projections of the
encoder's states, per layer) and attended over by every later call of the node; its states never
enter the node's self-attention KV sequences (docs/language.md "Cross-attention KV").
"""
from __future__ import annotations

from typing import Iterator

from mstar.compiler import codes
from mstar.compiler.resolve import iter_calls, name_span
from mstar.lang import ast
from mstar.lang.diagnostics import Diagnostics, Note

# Decoder styles (node arg `style`) whose layers cross-attend over a pool.
CROSS_STYLES = frozenset({"whisper"})
STATE_ROLES = frozenset({"hidden", "embeddings"})


def run(spec: ast.Spec, diags: Diagnostics) -> None:
    for node in spec.nodes:
        _check_declaration(node, diags)
        if node.engine != "kv" or not node.cross_kv:
            continue
        access = {a.walk: a for a in node.kv_access}
        for cross in node.cross_kv:
            if not any(cross.label in a.writes for a in node.kv_access):
                diags.error(codes.CROSS_KV_NEVER_FILLED,
                            f"no walk fills cross_kv {cross.label} of node {node.name}: write "
                            f"`kv WALK writes ... {cross.label}` for the walk whose call passes {cross.source}",
                            name_span(cross.span, cross.label, diags))
        for walk in spec.walks:
            _check_fills(walk, node, access.get(walk.name), diags)
        _check_order(spec, node, diags)


def _check_declaration(node: ast.NodeDecl, diags: Diagnostics) -> None:
    style = next((a.value for a in node.args if a.name == "style"), None)
    if node.engine == "kv" and style in CROSS_STYLES and not node.cross_kv:
        diags.error(codes.CROSS_KV_BAD, f"a {style} decoder cross-attends in every layer: declare the pool of node "
                    f"{node.name} with `cross_kv LABEL from INPUT tokens=N`", name_span(node.span, node.name, diags))
    inputs = {d.name: d for d in node.inputs}
    for cross in node.cross_kv:
        source = inputs.get(cross.source)  # an unknown input is resolve's MW102
        if node.engine != "kv":
            reason = "a stateless node keeps no KV; declare the pool on the kv node that attends over it"
        elif style not in CROSS_STYLES:
            reason = (f"the decoder's style ({style or 'llama'}) has no cross-attention layers; "
                      f"write style={'|'.join(sorted(CROSS_STYLES))} in the node header")
        elif cross.num_tokens < 1:
            reason = "tokens= must be at least 1 (the most states one request fills it with)"
        elif source is not None and (source.role not in STATE_ROLES or source.is_stream or source.prompt):
            kind = ("a stream input" if source.is_stream else "the request's prompt" if source.prompt
                    else f"`{source.role}`")
            reason = (f"its input {source.name} is {kind}; a pool is filled from another model's states "
                      f"(`hidden` or `embeddings`, not a stream or a prompt)")
        else:
            continue
        diags.error(codes.CROSS_KV_BAD, f"cross_kv {cross.label} of node {node.name}: {reason}", cross.span)


def _check_fills(walk: ast.Walk, node: ast.NodeDecl, access: ast.KvAccess | None, diags: Diagnostics) -> None:
    """MW132: a walk fills a pool exactly when its calls of the node pass the pool's input."""
    calls = [c for c in iter_calls(walk.body) if c.node == node.name]
    if not calls or access is None:  # a missing kv line is MW121
        return
    for cross in node.cross_kv:
        passing = [c for c in calls if cross.source in c.inputs]
        if cross.label in access.writes and not passing:
            diags.error(codes.CROSS_KV_FILL_MISMATCH,
                        f"walk {walk.name} fills cross_kv {cross.label} of node {node.name} from {cross.source}, "
                        f"but its call of {node.name} does not take {cross.source}",
                        name_span(calls[0].span, node.name, diags), Note("the fill", access.span))
        elif passing and cross.label not in access.writes:
            diags.error(codes.CROSS_KV_FILL_MISMATCH,
                        f"walk {walk.name} passes {cross.source} to node {node.name}, where it only fills "
                        f"cross_kv {cross.label}; write `kv {walk.name} writes ... {cross.label}`",
                        name_span(passing[0].span, cross.source, diags), Note("the walk's kv line", access.span))


def _check_order(spec: ast.Spec, node: ast.NodeDecl, diags: Diagnostics) -> None:
    """MW133: a walk that reads a pool runs after a walk of its partition that fills it."""
    for walk, earlier in _walk_orders(spec):
        access = next((a for a in node.kv_access if a.walk == walk), None)
        if access is None:
            continue
        for label in access.reads:
            cross = next((c for c in node.cross_kv if c.label == label), None)
            if cross is None or label in access.writes:  # a walk that fills the pool itself does not only read it
                continue
            fillers = [a.walk for a in node.kv_access if label in a.writes]
            if fillers and not set(fillers) & earlier:  # no filler at all is MW131
                diags.error(codes.CROSS_KV_READ_BEFORE_FILL,
                            f"walk {walk} reads cross_kv {label} of node {node.name}, but no earlier walk of its "
                            f"partition fills it (filled by {', '.join(fillers)}); run the filling walk at an "
                            "earlier stage",
                            name_span(access.span, label, diags), Note("the pool", cross.span))


def _walk_orders(spec: ast.Spec) -> Iterator[tuple[str, set[str]]]:
    """(walk, walks at earlier stages of its partition) for every walk a partition lists,
    then for unlisted walks (the implicit partition) their declaration order."""
    listed: set[str] = set()
    for partition in spec.partitions:
        earlier: set[str] = set()
        for stage in partition.stages:
            for name in stage.walks:
                yield name, set(earlier)
            earlier.update(stage.walks)
        listed.update(w for stage in partition.stages for w in stage.walks)
    earlier = set()
    for walk in spec.walks:
        if walk.name not in listed:
            yield walk.name, set(earlier)
            earlier.add(walk.name)
