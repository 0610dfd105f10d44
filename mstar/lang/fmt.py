"""Print a `Spec` AST in the canonical `.mw` form (what `mstarc fmt` writes).

    format_spec(spec) -> str

Canonical form: 4-space indentation, one construct per line, a blank line between top-level
declarations; the model line, then params, nodes, walks and partitions, each kind in declaration
order. Inside a node: inputs, outputs, prompt_format, kv_sequences, cross_kv, guidance, kv access,
bidirectional, states, sub-models, caps, batching rules, captures, capture replays, combines. A call with one edge
keeps it on its own line; a call with several edges puts each on the next lines, indented. Node
headers longer than 100 characters wrap their arguments, aligned after the `(`.

Comments (the AST's comment fields, see mstar/lang/comments.py) are written back: the comments
above a construct on the lines before it, at its indentation; its trailing comment after its first
line, two spaces after the code; the comments at the end of a block before its `}` (at the end of
the spec, after a blank line). Blank lines of the source are not kept. A call whose single edge
has comments above it, or whose call and edge both have a trailing comment, writes that edge on
the next line. Comments move with their construct when the canonical order moves it.

Properties (tested): `same_meaning(parse(format_spec(tree)), tree)` for every tree the parser can
produce; formatting parsed text again gives the same text; every comment of the text is written, in
the same order when the text's declarations were in canonical order. A tree the language cannot
write (for example a client edge without a modality, a `window` policy with a `context`, or a
comment that does not start with `#` or spans lines) raises ValueError naming the construct.
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
    """The canonical text of `spec`, ending with a newline."""
    blocks = [_line(spec, f"model {spec.model}")]
    if spec.params:
        blocks.append([line for p in spec.params for line in _line(p, f"param {p.name} = {p.value}")])
    blocks.extend(_node(n) for n in spec.nodes)
    blocks.extend(_walk(w) for w in spec.walks)
    if spec.partitions:
        blocks.append([line for p in spec.partitions for line in _partition(p)])
    if spec.comments_end:
        blocks.append(_comment_lines(spec.comments_end))
    return "\n\n".join("\n".join(block) for block in blocks) + "\n"


# ---- comments -----------------------------------------------------------------------------------

def _line(node: ast.AstNode, text: str) -> list[str]:
    """A construct written on one line, with the comments above it and its trailing comment."""
    return _comment_lines(node.comments_before) + [_trailed(text, node.comment_after)]


def _trailed(text: str, comment) -> str:
    return text if comment is None else f"{text}  {_comment(comment)}"


def _comment_lines(comments: list[str]) -> list[str]:
    return [_comment(c) for c in comments]


def _comment(comment: str) -> str:
    if not comment.startswith("#") or "\n" in comment:
        raise ValueError(f"format_spec: comment {comment[:40]!r} must start with `#` and stay on one line")
    return comment.rstrip(" \t\r\f")


def _indented(lines: list[str]) -> list[str]:
    return [INDENT + line for line in lines]


# ---- nodes --------------------------------------------------------------------------------------

def _node(node: ast.NodeDecl) -> list[str]:
    start = f"node {node.name} {node.engine}"
    if node.model_kind is not None:
        if node.engine != "stateless":
            raise ValueError(f"format_spec: node {node.name}: only a stateless node states a model kind")
        start += f" {node.model_kind}"
    flags = (" tp" if node.is_tp else "") + ("" if node.is_async else " no_speculation") + " {"
    header = _wrapped_args(start, [f"{a.name}={_value(a.value)}" for a in node.args], flags)
    # The trailing comment goes on the header's first line: the line the parser attaches it from.
    body: list[str] = []
    for decl in node.inputs:
        body += _line(decl, _input(decl, node.name))
    for out in node.outputs:
        body += _line(out, f"out {out.name}: {out.role}")
    if node.prompt_format is not None:
        body += _line(node.prompt_format, _prompt_format(node.prompt_format))
    if node.kv_sequences is not None:
        if not node.kv_sequences.labels:
            raise ValueError(f"format_spec: node {node.name}: kv_sequences needs at least one label")
        body += _line(node.kv_sequences, "kv_sequences " + " ".join(node.kv_sequences.labels))
    for cross in node.cross_kv:
        body += _line(cross, f"cross_kv {cross.label} from {cross.source} tokens={cross.num_tokens}")
    for guidance in node.guidance:
        body += _line(guidance, f"guidance {guidance.label} drops {guidance.drops} scale={_scale(guidance.scale)}")
    for access in node.kv_access:
        body += _line(access, _kv_access(access, node.name))
    if node.bidirectional is not None:
        if not node.bidirectional.walks:
            raise ValueError(f"format_spec: node {node.name}: bidirectional needs at least one walk")
        body += _line(node.bidirectional, "bidirectional " + " ".join(node.bidirectional.walks))
    for state in node.states:
        body += _line(state, f"state {state.kind}" + (_args(state.args) if state.args else ""))
    for sub in node.submodels:
        if not sub.walks:
            raise ValueError(f"format_spec: node {node.name}: submodel {sub.name} needs at least one walk")
        samples = f" samples {sub.samples} depth={sub.depth}" if sub.samples is not None else ""
        body += _line(sub, f"submodel {sub.name}" + (_args(sub.args) if sub.args else "") + samples + " for "
                      + " ".join(sub.walks))
    for cap in node.caps:
        body += _line(cap, f"cap {cap.walk} {cap.value}")
    for batching in node.batching:
        if not batching.rules:
            raise ValueError(f"format_spec: node {node.name}: batching {batching.walk} needs at least one rule")
        body += _line(batching, f"batching {batching.walk} same " + ", ".join(batching.rules))
    for capture in node.captures:
        body += _line(capture, _capture(capture))
    for replay in node.capture_replays:
        body += _line(replay, f"capture {replay.walk} replays {replay.source}")
    for combine in node.combines:
        body += _combine(combine, node.name)
    return (_comment_lines(node.comments_before) + [_trailed(header[0], node.comment_after)] + header[1:]
            + _indented(body + _comment_lines(node.comments_end)) + ["}"])


def _prompt_format(decl: ast.PromptFormat) -> str:
    # defaults stay quoted (`voice="tara"`): they are text put into the prompt, not names
    args = [f"{a.name}={json.dumps(a.value) if isinstance(a.value, str) else _value(a.value)}" for a in decl.args]
    return " ".join([f"prompt_format {json.dumps(decl.template)}"] + args)


def _input(decl: ast.InputDecl, node: str) -> str:
    text = f"in {decl.name}" + (" stream" if decl.is_stream else "")
    if decl.role is None:
        if decl.prompt is not None:
            raise ValueError(f"format_spec: node {node}: input {decl.name} has a prompt but no role")
        return text
    return text + f": {decl.role}" + (f" prompt {decl.prompt}" if decl.prompt is not None else "")


def _scale(scale: float) -> str:
    if scale != scale or scale in (float("inf"), float("-inf")) or scale < 0:
        raise ValueError(f"format_spec: a guidance scale must be a finite number >= 0, not {scale}")
    return repr(float(scale))


def _kv_access(access: ast.KvAccess, node: str) -> str:
    if not access.reads and not access.writes:
        raise ValueError(f"format_spec: node {node}: kv {access.walk} needs reads or writes")
    text = f"kv {access.walk}"
    if access.reads:
        text += " reads " + " ".join(access.reads)
    if access.writes:
        text += " writes " + " ".join(access.writes)
    return text


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


def _keep(keep: "tuple[int, int] | None") -> str:
    return "" if keep is None else f" keep {keep[0]}..{keep[1]}"


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
    if capture.guidance is not None:
        text += f" {capture.guidance}"
    if capture.labels:
        text += f" labels=[{', '.join(capture.labels)}]"
    if capture.is_eager_above:
        text += " eager_above"
    if capture.is_piecewise:
        text += " piecewise"
    if capture.unroll_prompts:
        text += f" unroll_prompts={capture.unroll_prompts}"
    return text


def _combine(combine: ast.CombineDecl, node_name: str) -> list[str]:
    if not combine.walks:
        raise ValueError(f"format_spec: node {node_name}: combine {combine.name} needs at least one walk")
    body: list[str] = []
    if combine.cap is not None:
        body += _comment_lines(combine.cap_comments_before)
        body.append(_trailed(f"cap {combine.cap}", combine.cap_comment_after))
    for rows in combine.rows:
        body += _line(rows, f"rows {rows.walk} <= {rows.limit}")
    if combine.capture is not None:
        body += _line(combine.capture, _capture(combine.capture))
    if combine.attention is not None:
        body += _comment_lines(combine.attention_comments_before)
        body.append(_trailed(f"attention {combine.attention}", combine.attention_comment_after))
    header = f"combine {combine.name} = " + " + ".join(combine.walks) + " {"
    return _line(combine, header) + _indented(body + _comment_lines(combine.comments_end)) + ["}"]


# ---- walks --------------------------------------------------------------------------------------

def _walk(walk: ast.Walk) -> list[str]:
    return _block(walk, f"walk {walk.name}", "")


def _section(section) -> list[str]:
    if isinstance(section, ast.Call):
        return _call(section)
    if isinstance(section, ast.Loop):
        return _loop(section)
    keyword = "parallel" if isinstance(section, ast.Parallel) else "sequential"
    return _block(section, keyword, "")


def _block(block, header: str, closing_suffix: str) -> list[str]:
    """A walk or section: `header {`, its sections indented, `}` and the suffix."""
    body = [line for section in block.body for line in _section(section)]
    closing = ["}" + closing_suffix]
    return _line(block, header + " {") + _indented(body + _comment_lines(block.comments_end)) + closing


def _call(call: ast.Call) -> list[str]:
    head = f"{call.node}(" + ", ".join(call.inputs) + ")"
    if not call.edges:
        return _line(call, head)
    (first, *others) = call.edges
    # One edge shares the call's line unless its comments need lines of their own (see the module
    # docstring); the parser then gives a trailing comment on that line to the call.
    can_share_line = not first.comments_before and (call.comment_after is None or first.comment_after is None)
    if not others and can_share_line:
        comment = call.comment_after if call.comment_after is not None else first.comment_after
        return _comment_lines(call.comments_before) + [_trailed(f"{head} {_edge(first)}", comment)]
    edges = [line for edge in call.edges for line in _line(edge, _edge(edge))]
    return _line(call, head) + _indented(edges)


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
    if loop.count is not None:
        header += f" count={loop.count}"
    if loop.has_stop:
        header += " stop"
    suffix = ""
    if loop.outputs:
        suffix += " outputs " + ", ".join(loop.outputs)
    if loop.accumulate:
        suffix += " accumulate " + ", ".join(loop.accumulate)
    return _block(loop, header, suffix)


# ---- partitions ---------------------------------------------------------------------------------

def _partition(partition: ast.Partition) -> list[str]:
    text = f"partition {partition.name} ="
    if partition.stages:
        text += " " + " -> ".join(_stage(s, partition.name) for s in partition.stages)
    if partition.repeat is not None:
        text += f" repeat while {partition.repeat.value} max={partition.repeat.max_rounds}"
    streams = [line for stream in partition.streams
               for line in _line(stream, f"<- {stream.partition}.{stream.edge} {_policy(stream.policy)}"
                                 + _keep(stream.keep))]
    return _line(partition, text) + _indented(streams)


def _stage(stage: ast.Stage, partition: str) -> str:
    if not stage.walks:
        raise ValueError(f"format_spec: partition {partition}: a stage needs at least one walk")
    if stage.sequence_lengths and (sum(stage.sequence_lengths) != len(stage.walks)
                                   or min(stage.sequence_lengths) < 1 or max(stage.sequence_lengths) < 2):
        raise ValueError(f"format_spec: partition {partition}: stage sequence lengths {stage.sequence_lengths} "
                         f"do not split its {len(stage.walks)} walks into sequences")
    if len(stage.walks) == 1:
        return stage.walks[0] + ("?" if stage.is_optional else "")
    choices = " | ".join(" -> ".join(seq) for seq in ast.alternatives(stage))
    if stage.sequence_lengths:
        return f"({choices})" + ("?" if stage.is_optional else "")
    return f"({choices})?" if stage.is_optional else choices


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
