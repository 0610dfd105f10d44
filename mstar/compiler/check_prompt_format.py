"""Pass 5c: a node's `prompt_format` and a stream's `keep` range, checked.

In:  a `Spec` that passed check_roles, and the run's `Diagnostics`.
Out: nothing; adds
     MW140 a prompt_format that cannot frame a text prompt: on a node without a text prompt input,
           a template without `{prompt}` or with a field that is not a plain name (`{a.b}`,
           `{0}`, `{x!r}`, `{x:>4}`), a malformed template, `before`/`after` that are not token
           lists inside the node's vocabulary, a default that is not text or names no field;
     MW141 a `keep LOW..HIGH` range that is empty (LOW > HIGH, or LOW at or past the producing
           node's vocab: no token passes, so the consumer never gets a chunk) or on a stream whose
           edge does not carry tokens (only token ids are compared against the range).

The runtime reads the lowered forms (`NodePlan.prompt_format`, `StreamPlan.keep`); what they do is
in docs/language.md "Prompt formats" and "Partitions".
"""
from __future__ import annotations

import string
from typing import Optional

from mstar.compiler import codes
from mstar.compiler.resolve import iter_calls
from mstar.lang import ast
from mstar.lang.diagnostics import Diagnostics
from mstar.plan.request_fields import REQUEST_FIELDS

# The template field the request's text fills; every other field is a request field or a default.
PROMPT_FIELD = "prompt"
TOKEN_LIST_ARGS = ("before", "after")


def run(spec: ast.Spec, diags: Diagnostics) -> None:
    for node in spec.nodes:
        if node.prompt_format is not None:
            _check_format(node, node.prompt_format, diags)
    for partition in spec.partitions:
        for source in partition.streams:
            if source.keep is not None:
                _check_keep(spec, source, diags)


def template_fields(template: str) -> Optional[list[str]]:
    """The template's field names in order of first use, or None when it is not a plain template
    (malformed braces, positional or dotted fields, conversions or format specs)."""
    fields: list[str] = []
    try:
        parsed = list(string.Formatter().parse(template))
    except ValueError:
        return None
    for _, name, spec, conversion in parsed:
        if name is None:
            continue
        if not name.isidentifier() or spec or conversion:
            return None
        if name not in fields:
            fields.append(name)
    return fields


def _check_format(node: ast.NodeDecl, decl: ast.PromptFormat, diags: Diagnostics) -> None:
    def refuse(message: str, span: ast.Span = decl.span) -> None:
        diags.error(codes.BAD_PROMPT_FORMAT, message, span)

    if not any(i.prompt == "text" for i in node.inputs):
        refuse(f"prompt_format on node {node.name}, which takes no text prompt "
               "(write it on the node with `in NAME: tokens prompt text`)")
        return
    fields = template_fields(decl.template)
    if fields is None:
        refuse("prompt_format's template must use plain named fields such as `{prompt}` or `{voice}` "
               "(no positional, dotted or formatted fields; write `{{` and `}}` for literal braces)")
        return
    if PROMPT_FIELD not in fields:
        refuse("prompt_format's template has no `{prompt}`: the request's text would be dropped")
    taken = [field for field in fields if field != PROMPT_FIELD and field in REQUEST_FIELDS]
    if taken:
        refuse(f"prompt_format's field `{taken[0]}` is named like a request's own field (a prompts line's or the "
               f"speech body's `{taken[0]}`), so a request's `{taken[0]}` would be read both ways; name it otherwise")
    vocab = next((a.value for a in node.args if a.name == "vocab" and isinstance(a.value, int)), None)
    for arg in decl.args:
        if arg.name in TOKEN_LIST_ARGS:
            _check_tokens(arg, vocab, refuse)
        elif arg.name == PROMPT_FIELD or arg.name not in fields:
            refuse(f"prompt_format: `{arg.name}` is no field of the template to give a default to "
                   f"(fields: {', '.join(f for f in fields if f != PROMPT_FIELD) or 'none'}; "
                   "token lists: before, after)", arg.span)
        elif not isinstance(arg.value, str):
            refuse(f"prompt_format: the default of `{arg.name}` must be text, e.g. {arg.name}=\"tara\"", arg.span)


def _check_tokens(arg: ast.Arg, vocab: Optional[int], refuse) -> None:
    if not isinstance(arg.value, list):
        refuse(f"prompt_format: `{arg.name}` is a list of token ids, e.g. {arg.name}=[128259]", arg.span)
        return
    bad = [t for t in arg.value if t < 0 or (vocab is not None and t >= vocab)]
    if bad:
        refuse(f"prompt_format: token {bad[0]} of `{arg.name}` is outside the vocabulary "
               f"(0..{vocab - 1 if vocab is not None else '?'})", arg.span)


def _check_keep(spec: ast.Spec, source: ast.StreamSource, diags: Diagnostics) -> None:
    low, high = source.keep or (0, 0)
    if low > high:
        diags.error(codes.BAD_KEEP_RANGE,
                    f"keep {low}..{high} keeps nothing: the range's low end is above its high end", source.span)
        return
    producer = _edge_producer(spec, source.edge)
    if producer is None:
        return
    role = next((o.role for o in producer.outputs if o.name == source.edge), None)
    if role is not None and role != "tokens":
        diags.error(codes.BAD_KEEP_RANGE, f"keep compares token ids, but stream edge {source.edge} carries `{role}`",
                    source.span)
        return
    vocab = next((a.value for a in producer.args if a.name == "vocab" and isinstance(a.value, int)), None)
    if vocab is not None and low >= vocab:  # no token passes: the consumer never gets a chunk
        diags.error(codes.BAD_KEEP_RANGE, f"keep {low}..{high} keeps nothing: node {producer.name} samples ids "
                    f"0..{vocab - 1} (vocab={vocab})", source.span)


def _edge_producer(spec: ast.Spec, edge: str) -> Optional[ast.NodeDecl]:
    """The node whose calls put stream edge `edge` on a stream (None when it cannot be told)."""
    nodes = {n.name: n for n in spec.nodes}
    for walk in spec.walks:
        for call in iter_calls(walk.body):
            node = nodes.get(call.node)
            if node is not None and any(e.name == edge and e.is_stream for e in call.edges):
                return node
    return None
