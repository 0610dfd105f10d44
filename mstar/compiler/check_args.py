"""Pass 2, second half: node and state arguments against the runtime's registry (node_args.py).

In:  a parsed `Spec` whose names resolved, and the run's `Diagnostics`.
Out: nothing; adds MW107 (an argument given twice), MW109 (an argument the engine does not read,
     with a "did you mean" and the known names), MW110 (a value of the wrong kind), MW111 (a
     `state recurrent` argument missing) and MW112 (dims that describe no model: query heads not
     a multiple of KV heads, recurrent state whose layer count differs from the layer pattern's
     linear-attention layers, an odd head_dim, state on a stateless node, ...). A node's model
     kind is stated in the language, not an argument (check_roles.py, MW113).
     MW123: dims past what the runtime can allocate, with the memory they imply
     (mstar/compiler/memory_bounds.py), checked before MW112 so that no later pass builds
     anything per layer of a billion-layer node.

Without this pass a typo in a dim name silently falls back to the runtime's default, and a value
such as `layers=abc` only fails when the plan is lowered or run.
"""
from __future__ import annotations

import math
from typing import Optional

from mstar.compiler import codes
from mstar.compiler.memory_bounds import MAX_DIM, MAX_LAYERS, MAX_NODE_BYTES, format_bytes, weight_bytes
from mstar.plan.node_args import (
    DEPTH_SUBMODEL_ARGS, ENGINE_ARGS, RECURRENT_ARGS, SUBMODEL_ARGS, ArgKind, layer_is_full, value_fits,
)
from mstar.compiler.resolve import name_span, suggestion
from mstar.lang import ast
from mstar.lang.diagnostics import Diagnostics, Note


def run(spec: ast.Spec, diags: Diagnostics) -> None:
    for node in spec.nodes:
        header_ok = _check_args(node.args, ENGINE_ARGS[node.engine], f"a {node.engine} node",
                                diags)
        states_ok = True
        for index, state in enumerate(node.states):
            states_ok &= _check_state(node, state, diags)
            if index > 0:
                diags.error(codes.DUPLICATE_NAME, f"node {node.name} declares state twice",
                            state.span, Note("first declared here", node.states[0].span))
                states_ok = False
        for sub in node.submodels:
            if sub.samples is None:
                header_ok &= _check_args(sub.args, SUBMODEL_ARGS, f"sub-model {sub.name}", diags)
            else:
                header_ok &= _check_args(sub.args, DEPTH_SUBMODEL_ARGS, f"depth model {sub.name}", diags)
            header_ok &= _submodel_within_bounds(node, sub, diags)
        if header_ok and states_ok and _within_bounds(node, diags):
            _check_consistency(node, diags)


def _check_args(args: list[ast.Arg], registry: dict[str, ArgKind], what: str,
                diags: Diagnostics) -> bool:
    """MW107 / MW109 / MW110 on one argument list; True when it has none of them."""
    ok = True
    first: dict[str, ast.Arg] = {}
    for arg in args:
        if arg.name in first:
            diags.error(codes.DUPLICATE_NAME, f"argument '{arg.name}' is given twice",
                        name_span(arg.span, arg.name, diags), Note("first given here", first[arg.name].span))
            ok = False
            continue
        first[arg.name] = arg
        kind = registry.get(arg.name)
        if kind is None:
            diags.error(codes.UNKNOWN_ARG,
                        f"'{arg.name}' is not an argument of {what}{suggestion(arg.name, registry)}",
                        name_span(arg.span, arg.name, diags),
                        Note(f"known arguments: {', '.join(sorted(registry))}", None))
            ok = False
        elif not value_fits(kind, arg.value):
            diags.error(codes.BAD_ARG_VALUE,
                        f"{arg.name}={_show(arg.value)} must be {kind.describe}", arg.span)
            ok = False
    return ok


def _within_bounds(node: ast.NodeDecl, diags: Diagnostics) -> bool:
    """MW123: dims the runtime could not allocate (a count past MAX_DIM, layers past MAX_LAYERS,
    weights past MAX_NODE_BYTES), stating the memory the dims imply; True when none."""
    args = ast.values_by_name(node.args)
    state_args = ast.values_by_name(node.states[0].args) if node.states else None
    implied = weight_bytes(node.engine, args, state_args)
    memory = (f"its dims imply at least {format_bytes(implied)} of weights and state "
              f"(at most {format_bytes(MAX_NODE_BYTES)} per node)")
    for arg in node.args + [a for state in node.states for a in state.args]:
        values = arg.value if isinstance(arg.value, list) else [arg.value]
        largest = max((v for v in values if isinstance(v, int) and not isinstance(v, bool)), default=0)
        limit = MAX_LAYERS if arg.name == "layers" else MAX_DIM
        if largest > limit:
            what = "layers" if arg.name == "layers" else "any count or size"
            diags.error(codes.DIMS_TOO_LARGE,
                        f"node {node.name}: {arg.name}={_show_big(largest)} is more than the runtime "
                        f"can allocate ({what}: at most {limit}); {memory}", arg.span)
            return False
    if implied > MAX_NODE_BYTES:
        target = next((a for a in node.args if a.name == "layers"), node)
        diags.error(codes.DIMS_TOO_LARGE, f"node {node.name}: {memory}", target.span)
        return False
    return True


def _submodel_within_bounds(node: ast.NodeDecl, sub: ast.SubModelDecl, diags: Diagnostics) -> bool:
    """MW123 for a sub-model's own numbers (MAX_DIM, MAX_LAYERS), as for the node's."""
    for arg in sub.args:
        value = arg.value
        limit = MAX_LAYERS if arg.name == "layers" else MAX_DIM
        if isinstance(value, int) and not isinstance(value, bool) and value > limit:
            diags.error(codes.DIMS_TOO_LARGE,
                        f"node {node.name}: sub-model {sub.name}: {arg.name}={_show_big(value)} is more than the "
                        f"runtime can allocate (at most {limit})", arg.span)
            return False
    return True


def _show_big(value: int) -> str:
    text = str(value) if value < 10**30 else f"about 10**{len(str(value)) - 1}"
    return text


def _check_state(node: ast.NodeDecl, state: ast.StateDecl, diags: Diagnostics) -> bool:
    ok = _check_args(state.args, RECURRENT_ARGS, f"state {state.kind}", diags)
    missing = [name for name in RECURRENT_ARGS if name not in {a.name for a in state.args}]
    if missing:
        diags.error(codes.MISSING_STATE_ARG,
                    f"state {state.kind} of node {node.name} needs {', '.join(missing)} "
                    f"(its slot size is layers x heads x key_dim x value_dim)", state.span)
        ok = False
    if node.engine != "kv":
        diags.error(codes.DIMS_INCONSISTENT,
                    f"state {state.kind} on stateless node {node.name}: only a kv node keeps "
                    "per-request state", state.span)
        ok = False
    return ok


def _check_consistency(node: ast.NodeDecl, diags: Diagnostics) -> None:
    """MW112: combinations the runtime's models cannot build. Runs on well-typed arguments only."""
    args = {a.name: a for a in node.args}
    value = {name: a.value for name, a in args.items()}
    ints = {name: v for name, v in value.items() if isinstance(v, int)}  # well typed: the INT arguments

    def problem(message: str, arg_name: str, other: Optional[ast.AstNode] = None) -> None:
        notes = [Note("the state declaration", other.span)] if other is not None else []
        # an absent argument (a default) is blamed on `layers`, else on the whole node
        target = args.get(arg_name) or args.get("layers") or node
        diags.error(codes.DIMS_INCONSISTENT, f"node {node.name}: {message}", target.span, *notes)

    if node.engine == "kv":
        kv, qo = ints.get("kv_heads", 1), ints.get("qo_heads")
        if qo is not None and qo % kv:
            problem(f"qo_heads={qo} is not a multiple of kv_heads={kv}", "qo_heads")
        state = node.states[0] if node.states else None
        linear_heads = _state_arg(state, "heads") if state else ints.get("linear_heads", 2)
        value_heads = ints.get("linear_value_heads")
        if value_heads is not None and value_heads % linear_heads:
            problem(f"linear_value_heads={value_heads} is not a multiple of the {linear_heads} "
                    "linear q/k heads", "linear_value_heads")
        # well typed: the pattern is a valid one (None only for an invalid pattern)
        flags = layer_is_full(value.get("layer_pattern"), ints.get("layers", 2), state is not None) or ()
        num_linear = sum(not f for f in flags)
        if state is not None and _state_arg(state, "layers") != num_linear:
            problem(f"state recurrent declares {_state_arg(state, 'layers')} layers but the layer "
                    f"pattern has {num_linear} linear-attention layers", "layer_pattern", state)
        elif state is None and num_linear:
            problem(f"the layer pattern has {num_linear} linear-attention layers but the node "
                    "declares no `state recurrent(...)` to keep their per-request state",
                    "layer_pattern")
        _check_head_dims(node, diags)
        vocab = ints.get("vocab")
        for name in ("stop_token", "stop_tokens"):
            ids = value.get(name)
            ids = [ids] if isinstance(ids, int) else ids if isinstance(ids, list) else []
            outside = [t for t in ids if vocab is not None and t >= vocab]
            if outside:
                problem(f"{name} {outside[0]} is outside the vocabulary (vocab={vocab})", name)
    else:
        hidden, heads = ints.get("hidden"), ints.get("heads")
        if hidden is not None and heads is not None and hidden % heads:
            problem(f"hidden={hidden} is not a multiple of heads={heads}", "hidden")
    latent = ints.get("latent_tokens")
    if latent is not None and math.isqrt(latent) ** 2 != latent:
        problem(f"latent_tokens={latent} is not a square grid", "latent_tokens")


def _check_head_dims(node: ast.NodeDecl, diags: Diagnostics) -> None:
    """An odd head_dim (the node's, or a depth model's own) describes no model the runtime runs:
    RoPE rotates a head's dims in pairs (the first half with the second), and `--dims spec` failed
    every step with a size mismatch."""
    odd = [(arg, "") for arg in node.args if arg.name == "head_dim"]
    odd += [(arg, f"depth model {sub.name}: ") for sub in node.submodels for arg in sub.args if arg.name == "head_dim"]
    for arg, where in odd:
        if isinstance(arg.value, int) and arg.value % 2:
            diags.error(codes.DIMS_INCONSISTENT,
                        f"node {node.name}: {where}head_dim={arg.value} is odd; RoPE rotates a head's dims in "
                        "pairs, so the runtime runs even head dims only", arg.span)


def _state_arg(state: ast.StateDecl, name: str) -> int:
    return next(a.value for a in state.args if a.name == name and isinstance(a.value, int))  # all INT


def _show(value) -> str:
    if isinstance(value, str):
        return value if value.isidentifier() else repr(value)
    return str(value).replace(" ", "")
