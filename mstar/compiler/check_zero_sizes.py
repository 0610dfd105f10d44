"""Part of pass 5: step sizes of no rows or tokens (caps, rows limits, capture lists).

In:  one node of a `Spec` that passed resolve and check_graph, the run's `Diagnostics`.
Out: whether the node's sizes are all usable; adds
- MW432: `cap WALK 0`, a combined walk's `cap 0` or `rows WALK <= 0`: a step (or a walk's part
  of a mixed step) that may hold no rows.
- MW433: a capture whose lists name no graph the runtime can key: `batch=[]`, a batch size 0 or one
  listed twice; a packed capture without token buckets (`tokens=` left out or `[]`), with a bucket
  of 0 tokens or one listed twice; a batched capture with `tokens=[...]` (its tokens are its batch
  sizes x `tokens_per_row`, so the list would be ignored) or with `tokens_per_row=0`.
`load_plan` refuses a plan with any of these (plan/references.py: a mixture cap below 1, a rows
limit below 1, batch sizes or token buckets that are not positive and distinct), so mstarc refuses
the spec instead. Checked before MW411 and the later capture checks, which take the largest batch
size of a capture; `check_combine` runs those only when these pass. (Lists in another order are
fine: lowering sorts them.)
"""
from __future__ import annotations

import re
from collections import Counter
from typing import Optional

from mstar.compiler import codes
from mstar.lang import ast
from mstar.lang.diagnostics import Diagnostics


def check_node(node: ast.NodeDecl, diags: Diagnostics) -> bool:
    """MW432 and MW433 for one node; True when it has none."""
    rows_ok = _check_rows(node, diags)
    captures = [*node.captures, *(c.capture for c in node.combines if c.capture is not None)]
    return all([rows_ok, *(_check_capture(node, capture, diags) for capture in captures)])


def _check_rows(node: ast.NodeDecl, diags: Diagnostics) -> bool:
    """MW432: caps and rows limits of at least one row."""
    ok = True
    for cap in node.caps:
        if cap.value < 1:
            ok = False
            diags.error(codes.ZERO_ROWS,
                        f"cap {cap.walk} {cap.value} lets a step of {cap.walk} on {node.name} hold no rows, so "
                        f"none would ever run: give a cap of at least 1, or leave the line out (the walk's "
                        f"largest captured batch size, else the deployment's row limit, is then its cap)", cap.span)
    for combine in node.combines:
        if combine.cap is not None and combine.cap < 1:
            ok = False
            diags.error(codes.ZERO_ROWS,
                        f"cap {combine.cap} lets a mixed step of {combine.name} on {node.name} hold no rows: give "
                        f"a cap of at least 1, or leave the line out (a mixed step then takes the smallest cap of "
                        f"the walks in it)", combine.cap_span or combine.span)
        for rows in combine.rows:
            if rows.limit < 1:
                ok = False
                diags.error(codes.ZERO_ROWS,
                            f"rows {rows.walk} <= {rows.limit} lets a mixed step of {combine.name} on {node.name} "
                            f"hold no {rows.walk} rows: give a limit of at least 1, or leave {rows.walk} out of "
                            f"{combine.name} to never mix its rows with the others'", rows.span)
    return ok


def _check_capture(node: ast.NodeDecl, capture: ast.CaptureDecl, diags: Diagnostics) -> bool:
    """MW433 for one capture line (module docstring); True when it has none."""
    problems: list[tuple[str, str]] = []  # (message, the option it is about)
    batch_problem = _list_problem(capture.batch, "batch size", "rows")
    if batch_problem is not None:
        problems.append((f"batch={_text(capture.batch)}: {batch_problem}", "batch"))
    if capture.family == "packed":
        if not capture.tokens:
            problems.append(("a packed capture keys its graphs by batch size and token bucket, but this one "
                             "lists no token buckets: give them with `tokens=[...]`, e.g. `tokens=[64, 128, 256]`",
                             "tokens"))
        else:
            tokens_problem = _list_problem(capture.tokens, "token bucket", "tokens")
            if tokens_problem is not None:
                problems.append((f"tokens={_text(capture.tokens)}: {tokens_problem}", "tokens"))
    else:
        if capture.tokens:
            problems.append((f"a batched capture has no token buckets (its tokens are each batch size x "
                             f"tokens_per_row), so tokens={_text(capture.tokens)} would be ignored: leave it "
                             f"out, or make the capture `packed`", "tokens"))
        if capture.tokens_per_row < 1:
            problems.append(("tokens_per_row=0 captures rows of no tokens: give at least 1 (left out, it is 1)",
                             "tokens_per_row"))
    for message, option in problems:
        diags.error(codes.BAD_CAPTURE_SIZES, f"node {node.name}: {message}",
                    _option_span(capture.span, option, diags))
    return not problems


def _list_problem(values: list[int], what: str, unit: str) -> Optional[str]:
    """What is wrong with a list of batch sizes or token buckets, or None."""
    if not values:
        return (f"no {what}s, so no graph would be captured: list at least one, e.g. `[1, 2, 4]`, or leave "
                "the capture out (its steps then run eagerly)")
    if 0 in values:
        rest = sorted(set(values) - {0})
        return f"a {what} of 0 holds no {unit}: {what}s are at least 1" + (f" (write {_text(rest)})" if rest else "")
    # (by counts: `values.count` a value was quadratic, 35 s for a 65,536-entry list)
    repeated = sorted(v for v, n in Counter(values).items() if n > 1)
    if repeated:
        return (f"{what} {repeated[0]} is listed twice; each {what} is one graph, so list it once "
                f"(write {_text(sorted(set(values)))})")
    return None


def _text(values: list[int]) -> str:
    return "[" + ", ".join(map(str, values)) + "]"


def _option_span(span: ast.Span, option: str, diags: Diagnostics) -> ast.Span:
    """The span of `option=...` (its `[...]` list or number) inside a capture's span, else the span."""
    text = diags.sources.get(span.file)
    if text is None:
        return span
    pattern = re.compile(rf"(?<!\w){re.escape(option)}\s*=\s*(\[[^\]]*\]|\d+)")
    lines = text.splitlines()
    for line_no in range(span.line, min(span.end_line, len(lines)) + 1):
        line = lines[line_no - 1]
        start = span.col - 1 if line_no == span.line else 0
        stop = span.end_col - 1 if line_no == span.end_line else len(line)
        match = pattern.search(line, start, max(start, stop))
        if match is not None:
            return ast.Span(file=span.file, line=line_no, col=match.start() + 1, end_line=line_no,
                            end_col=match.end() + 1)
    return span
