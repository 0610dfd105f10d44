"""Keep the `#` comments of a parsed spec on its AST, so that `mstarc fmt` writes them back.

    Anchor(line, col, node, slot)              a place a comment can belong to
    attach_comments(spec, text, anchors)       fills the comment fields of `spec` in place

In: the Spec the builder made from `text`, and the anchors the builder recorded that the tree
cannot show (the `}` of every block, the `cap` / `attention` lines of a combine). Out: nothing;
the comment fields of the tree (see ast.AstNode) are set.

Where a comment goes:
- A comment after code on its line goes to the first construct that starts on that line (its
  `comment_after`). The constructs are the ones the formatter starts on a line of their own:
  the model line (the Spec), params, node statements, combine settings, walks, sections, edges,
  partitions and stream sources; never an argument, a stage or a chunk policy.
- Any other comment (a full-line one, or one ending a line where no construct starts, such as
  `}  # done`) goes above the next construct or `}` that follows it: `comments_before` of that
  construct, `comments_end` of the block that `}` closes, or `comments_end` of the Spec at the
  end of the file.
- Blank lines are not kept: the formatter decides where blank lines go.

Comments are found with a regular expression rather than from Lark's tokens: `attach_comments`
only runs on text that parsed, where `#` occurs only in comments and quoted strings, and the
expression skips strings exactly as the grammar's STRING terminal reads them.
"""
from __future__ import annotations

import re
from bisect import bisect_left, bisect_right
from typing import NamedTuple, Optional

from mstar.lang import ast

_COMMENT_OR_STRING = re.compile(r'#[^\n]*|"(?:[^"\\\n]|\\.)*"')
# The grammar's whitespace (WS) that may end a comment's line; not kept.
_SPACE = " \t\r\f"

# The fields holding each class's comment-carrying children (the constructs named above).
_CHILDREN = {
    ast.Spec: ("params", "nodes", "walks", "partitions"),
    ast.NodeDecl: ("inputs", "outputs", "prompt_format", "kv_sequences", "cross_kv", "guidance", "kv_access",
                   "bidirectional", "states", "submodels", "caps", "batching", "captures", "capture_replays",
                   "combines"),
    ast.CombineDecl: ("rows", "capture"),
    ast.Walk: ("body",),
    ast.Parallel: ("body",),
    ast.Sequential: ("body",),
    ast.Loop: ("body",),
    ast.Call: ("edges",),
    ast.Partition: ("streams",),
}


class Anchor(NamedTuple):
    """A place comments belong to, at the 1-based (line, col) of its first token.

    slot: "start" (the construct `node` itself), "end" (the `}` closing block `node`, or the end of
    the file for the Spec), "cap" / "attention" (that setting's line in combine `node`).
    """

    line: int
    col: int
    node: ast.AstNode
    slot: str


def attach_comments(spec: ast.Spec, text: str, anchors: list[Anchor]) -> None:
    """Fill the comment fields of `spec` (parsed from `text`) from the comments of `text`."""
    comments = [m for m in _COMMENT_OR_STRING.finditer(text) if m.group().startswith("#")]
    if not comments:
        return
    line_starts = [0] + [m.end() for m in re.finditer("\n", text)]
    everything = sorted(anchors + _construct_anchors(spec), key=lambda a: (a.line, a.col))
    everything.append(Anchor(len(line_starts) + 1, 1, spec, "end"))
    keys = [(a.line, a.col) for a in everything]
    above: dict[int, list[str]] = {}  # index in `everything` -> its full-line comments
    for comment in comments:
        line = bisect_right(line_starts, comment.start())
        line_start = line_starts[line - 1]
        col = comment.start() - line_start + 1
        owner = None
        if text[line_start:comment.start()].strip(_SPACE):
            owner = _first_start_on_line(everything, keys, line, col)
        if owner is not None:
            _set_after(owner, _clean(comment.group()))
        else:
            above.setdefault(bisect_right(keys, (line, col)), []).append(_clean(comment.group()))
    for index, group in above.items():
        _set_before(everything[index], group)


def _construct_anchors(spec: ast.Spec) -> list[Anchor]:
    """A "start" anchor for the Spec and every construct below it that takes comments."""
    found: list[Anchor] = []
    pending: list[ast.AstNode] = [spec]
    while pending:
        node = pending.pop()
        found.append(Anchor(node.span.line, node.span.col, node, "start"))
        for field in _CHILDREN.get(type(node), ()):
            value = getattr(node, field)
            if isinstance(value, list):
                pending.extend(value)
            elif value is not None:
                pending.append(value)
    return found


def _first_start_on_line(anchors: list[Anchor], keys: list[tuple[int, int]], line: int,
                         col: int) -> Optional[Anchor]:
    """The first anchor other than a `}` on `line` before column `col`, or None."""
    index = bisect_left(keys, (line, 0))
    while index < len(anchors) and keys[index] < (line, col):
        if anchors[index].slot != "end":
            return anchors[index]
        index += 1
    return None


def _clean(comment: str) -> str:
    return comment.rstrip(_SPACE)


def _set_after(anchor: Anchor, comment: str) -> None:
    if anchor.slot == "start":
        anchor.node.comment_after = comment
    else:
        setattr(anchor.node, f"{anchor.slot}_comment_after", comment)


def _set_before(anchor: Anchor, comments: list[str]) -> None:
    if anchor.slot == "start":
        anchor.node.comments_before = comments
    else:
        # The slot names the field: blocks (an anchor of slot "end") have `comments_end`.
        field = "comments_end" if anchor.slot == "end" else f"{anchor.slot}_comments_before"
        setattr(anchor.node, field, comments)
