"""Print a `Spec` AST in the canonical `.mw` form (what `mstarc fmt` writes).

    format_spec(spec) -> str

Canonical form: 4-space indentation, one construct per line, a blank line between top-level
declarations; the model line, then params, nodes, walks and partitions, each kind in declaration
order. Inside a node: inputs, kv_sequences, states, caps, captures, combines. A call with one edge
keeps it on its own line; a call with several edges puts each on the next lines, indented. Node
headers longer than 100 characters wrap their arguments, aligned after the `(`. Comments are not
part of the AST and are not kept.

Property (tested): `same_meaning(parse(format_spec(tree)), tree)` for every tree the parser can
produce. A tree the language cannot write (for example a client edge without a modality, or a
`window` policy with a `context`) raises ValueError naming the construct.
"""
from __future__ import annotations

import json
import re

from mstar.lang import ast

INDENT = "    "
# Node headers longer than this are wrapped after a comma of the argument list.
WIDTH = 100
_BARE_WORD = re.compile(r"\A[A-Za-z_][A-Za-z0-9_]*\Z")


def format_spec(spec: ast.Spec) -> str:
    blocks = [f"model {spec.model}"]
    if spec.params:
        blocks.append("\n".join(f"param {p.name} = {p.value}" for p in spec.params))
    blocks.extend(_node(n) for n in spec.nodes)
    blocks.extend(_walk(w) for w in spec.walks)
    if spec.partitions:
        blocks.append("\n".join(_partition(p) for p in spec.partitions))
    return "\n\n".join(blocks) + "\n"


# ---- nodes --------------------------------------------------------------------------------------

def _node(node: ast.NodeDecl) -> str:
    start = f"node {node.name} {node.engine}"
    flags = (" tp" if node.is_tp else "") + ("" if node.is_async else " no_speculation") + " {"
    lines = _wrapped_args(start, [f"{a.name}={_value(a.value)}" for a in node.args], flags)
    for decl in node.inputs:
        lines.append(INDENT + f"in {decl.name}" + (" stream" if decl.is_stream else ""))
    if node.kv_sequences is not None:
        if not node.kv_sequences.labels:
            raise ValueError(f"format_spec: node {node.name}: kv_sequences needs at least one label")
        lines.append(INDENT + "kv_sequences " + " ".join(node.kv_sequences.labels))
    for state in node.states:
        lines.append(INDENT + f"state {state.kind}" + (_args(state.args) if state.args else ""))
    for cap in node.caps:
        lines.append(INDENT + f"cap {cap.walk} {cap.value}")
    for capture in node.captures:
        lines.append(INDENT + _capture(capture))
    for combine in node.combines:
        lines.extend(INDENT + line for line in _combine(combine, node.name))
    lines.append("}")
    return "\n".join(lines)


def _wrapped_args(start: str, args: list[str], end: str) -> list[str]:
    """`start(a, b, ...)end`, filled greedily into lines of at most WIDTH, aligned after `(`."""
    if not args:
        return [start + end]
    one_line = start + "(" + ", ".join(args) + ")" + end
    if len(one_line) <= WIDTH:
        return [one_line]
    pad = " " * (len(start) + 1)
    lines = [start + "(" + args[0]]
    for arg in args[1:]:
        if len(lines[-1]) + len(arg) + 2 <= WIDTH:
            lines[-1] += ", " + arg
        else:
            lines[-1] += ","
            lines.append(pad + arg)
    lines[-1] += ")" + end
    return lines


def _args(args: list[ast.Arg]) -> str:
    return "(" + ", ".join(f"{a.name}={_value(a.value)}" for a in args) + ")"


def _value(value: ast.ArgValue) -> str:
    if isinstance(value, bool):
        raise ValueError("format_spec: a true/false argument value cannot be written in .mw")
    if isinstance(value, list):
        return "[" + ", ".join(str(v) for v in value) + "]"
    if isinstance(value, str):
        return value if _BARE_WORD.match(value) else json.dumps(value)
    return repr(value)


def _ints(values: list[int]) -> str:
    return "[" + ", ".join(str(v) for v in values) + "]"


def _capture(capture: ast.CaptureDecl) -> str:
    text = "capture "
    if capture.walk is not None:
        text += capture.walk + " "
    text += f"{capture.family} batch={_ints(capture.batch)}"
    if capture.tokens:
        text += f" tokens={_ints(capture.tokens)}"
    if capture.tokens_per_row != 1:
        text += f" tokens_per_row={capture.tokens_per_row}"
    return text


def _combine(combine: ast.CombineDecl, node_name: str) -> list[str]:
    if not combine.walks:
        raise ValueError(f"format_spec: node {node_name}: combine {combine.name} needs at least one walk")
    lines = [f"combine {combine.name} = " + " + ".join(combine.walks) + " {"]
    if combine.cap is not None:
        lines.append(INDENT + f"cap {combine.cap}")
    for rows in combine.rows:
        lines.append(INDENT + f"rows {rows.walk} <= {rows.limit}")
    if combine.capture is not None:
        lines.append(INDENT + _capture(combine.capture))
    if combine.attention is not None:
        lines.append(INDENT + f"attention {combine.attention}")
    lines.append("}")
    return lines


# ---- walks --------------------------------------------------------------------------------------

def _walk(walk: ast.Walk) -> str:
    lines = [f"walk {walk.name} {{"]
    for section in walk.body:
        lines.extend(INDENT + line for line in _section(section))
    lines.append("}")
    return "\n".join(lines)


def _section(section) -> list[str]:
    if isinstance(section, ast.Call):
        return _call(section)
    if isinstance(section, ast.Loop):
        return _loop(section)
    keyword = "parallel" if isinstance(section, ast.Parallel) else "sequential"
    return _block(keyword, section.body, "")


def _block(header: str, body: list, closing_suffix: str) -> list[str]:
    lines = [header + " {"]
    for section in body:
        lines.extend(INDENT + line for line in _section(section))
    lines.append("}" + closing_suffix)
    return lines


def _call(call: ast.Call) -> list[str]:
    head = f"{call.node}(" + ", ".join(call.inputs) + ")"
    edges = [_edge(e) for e in call.edges]
    if len(edges) == 1:
        return [f"{head} {edges[0]}"]
    return [head] + [INDENT + e for e in edges]


def _edge(edge: ast.Edge) -> str:
    if edge.dest == "client":
        if edge.modality is None:
            raise ValueError(f"format_spec: edge {edge.name} to client needs a modality")
        text = f"-> {edge.name}: client {edge.modality}"
    else:
        if edge.modality is not None:
            raise ValueError(f"format_spec: edge {edge.name}: only a client edge has a modality")
        text = f"-> {edge.name}: {edge.dest}"
    flags = [("persist", edge.is_persist), ("stream", edge.is_stream), ("device", edge.is_device),
             ("count_tokens", edge.is_count_tokens)]
    return text + "".join(f" {word}" for word, is_set in flags if is_set)


def _loop(loop: ast.Loop) -> list[str]:
    header = "loop " + (f"{loop.name} " if loop.name is not None else "") + f"max={loop.max_iters}"
    if loop.has_stop:
        header += " stop"
    suffix = ""
    if loop.outputs:
        suffix += " outputs " + ", ".join(loop.outputs)
    if loop.accumulate:
        suffix += " accumulate " + ", ".join(loop.accumulate)
    return _block(header, loop.body, suffix)


# ---- partitions ---------------------------------------------------------------------------------

def _partition(partition: ast.Partition) -> str:
    text = f"partition {partition.name} ="
    if partition.stages:
        text += " " + " -> ".join(_stage(s, partition.name) for s in partition.stages)
    for stream in partition.streams:
        text += f"\n{INDENT}<- {stream.partition}.{stream.edge} {_policy(stream.policy)}"
    return text


def _stage(stage: ast.Stage, partition: str) -> str:
    if not stage.walks:
        raise ValueError(f"format_spec: partition {partition}: a stage needs at least one walk")
    if len(stage.walks) == 1:
        return stage.walks[0] + ("?" if stage.is_optional else "")
    alternatives = " | ".join(stage.walks)
    return f"({alternatives})?" if stage.is_optional else alternatives


def _policy(policy: ast.ChunkPolicy) -> str:
    if policy.kind == "window" and policy.context is None and not policy.is_continue_after_done:
        stride = f", stride={policy.stride}" if policy.stride is not None else ""
        return f"window({policy.size}{stride})"
    if (policy.kind == "left_context" and policy.context is not None and policy.stride is None
            and not policy.is_continue_after_done):
        return f"left_context(chunk={policy.size}, context={policy.context})"
    if policy.kind == "fixed" and policy.stride is None and policy.context is None:
        flag = ", continue_after_done" if policy.is_continue_after_done else ""
        return f"fixed({policy.size}{flag})"
    raise ValueError(f"format_spec: a {policy.kind} chunk policy with these fields cannot be written in .mw")
