"""Build the AST (mstar/lang/ast.py) from a Lark parse tree of grammar/mw.lark.

In: a Lark tree whose rules are named after the AST classes (snake_case), made with
`propagate_positions=True`, and a Diagnostics collection. Out: AST nodes, each with the span of
its rule. Problems the grammar cannot see but the AST cannot hold (a setting given twice, a capture
without `batch=`, a number out of range) become MW020-MW022 diagnostics; the builder goes on so one
run reports them all, and the caller drops the tree when any error was added.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any, Optional

from lark import Token, Transformer, v_args

from mstar.lang import ast
from mstar.lang import codes
from mstar.lang.diagnostics import Diagnostics

# Numbers beyond a signed 64-bit integer cannot be meant; refusing them keeps later passes and the
# JSON plan free of huge integers.
MAX_INT = 2**63 - 1


@dataclass(frozen=True)
class _Setting:
    """An option or statement that fills one field of its parent (`cap 64`, `batch=[...]`)."""

    key: str
    value: Any
    span: ast.Span


class AstBuilder(Transformer):
    """Lark transformer: one method per grammar rule, each returning an AST node or a part of one."""

    def __init__(self, file: str, diags: Diagnostics):
        super().__init__()
        self.file = file
        self.diags = diags

    # ---- helpers ----------------------------------------------------------------------------

    def _span(self, meta) -> ast.Span:
        if getattr(meta, "empty", True):
            return ast.Span(file=self.file)
        return ast.Span(file=self.file, line=meta.line, col=meta.column,
                        end_line=meta.end_line, end_col=meta.end_column)

    def _token_span(self, token: Token) -> ast.Span:
        return ast.Span(file=self.file, line=token.line, col=token.column,
                        end_line=token.end_line, end_col=token.end_column)

    def _int(self, token: Token) -> int:
        # Python refuses int() of more than 4300 digits; anything past 64 bits is refused anyway.
        text = str(token)
        if len(text.lstrip("+-")) > 19 or abs(int(text)) > MAX_INT:
            self.diags.error(codes.NUMBER_OUT_OF_RANGE,
                             f"number `{text[:30]}` is out of range (at most {MAX_INT})",
                             self._token_span(token))
            return 0
        return int(text)

    def _float(self, token: Token) -> float:
        value = float(str(token))
        if not math.isfinite(value):
            self.diags.error(codes.NUMBER_OUT_OF_RANGE,
                             f"number `{str(token)[:30]}` is out of range for a decimal number",
                             self._token_span(token))
            return 0.0
        return value

    def _settings(self, items: list, owner: str) -> dict[str, _Setting]:
        """Settings by key; a key given twice is reported and the first one kept."""
        found: dict[str, _Setting] = {}
        for item in items:
            if not isinstance(item, _Setting):
                continue
            if item.key in found:
                self.diags.error(codes.DUPLICATE_SETTING,
                                 f"`{item.key}` is given twice in this {owner}",
                                 item.span)
                continue
            found[item.key] = item
        return found

    @staticmethod
    def _names(children: list) -> list[str]:
        return [str(c) for c in children if isinstance(c, Token) and c.type == "NAME"]

    # ---- top level --------------------------------------------------------------------------

    @v_args(meta=True)
    def spec(self, meta, children):
        model = children[0]
        items = children[1:]
        return ast.Spec(
            span=self._span(meta),
            model=model.value,
            params=[i for i in items if isinstance(i, ast.Param)],
            nodes=[i for i in items if isinstance(i, ast.NodeDecl)],
            walks=[i for i in items if isinstance(i, ast.Walk)],
            partitions=[i for i in items if isinstance(i, ast.Partition)],
        )

    def chunk(self, children):
        return children[0]

    @v_args(meta=True)
    def model_decl(self, meta, children):
        return _Setting("model", str(children[0]), self._span(meta))

    @v_args(meta=True)
    def param(self, meta, children):
        return ast.Param(span=self._span(meta), name=str(children[0]), value=self._int(children[1]))

    # ---- nodes ------------------------------------------------------------------------------

    @v_args(meta=True)
    def node_decl(self, meta, children):
        name, engine, arg_list, *rest = children
        flags = [c for c in rest if isinstance(c, Token)]
        stmts = [c for c in rest if not isinstance(c, Token)]
        kv_sequences = [s for s in stmts if isinstance(s, ast.KvSequences)]
        for extra in kv_sequences[1:]:
            self.diags.error(codes.DUPLICATE_SETTING,
                             "`kv_sequences` is given twice in this node", extra.span)
        return ast.NodeDecl(
            span=self._span(meta),
            name=str(name),
            engine=engine,
            args=arg_list or [],
            is_tp=any(f.type == "TP" for f in flags),
            is_async=not any(f.type == "NO_SPECULATION" for f in flags),
            kv_sequences=kv_sequences[0] if kv_sequences else None,
            states=[s for s in stmts if isinstance(s, ast.StateDecl)],
            inputs=[s for s in stmts if isinstance(s, ast.InputDecl)],
            caps=[s for s in stmts if isinstance(s, ast.CapDecl)],
            captures=[s for s in stmts if isinstance(s, ast.CaptureDecl)],
            combines=[s for s in stmts if isinstance(s, ast.CombineDecl)],
        )

    def engine(self, children):
        return str(children[0])

    def node_flag(self, children):
        return children[0]

    def arg_list(self, children):
        return [c for c in children if c is not None]

    @v_args(meta=True)
    def arg(self, meta, children):
        return ast.Arg(span=self._span(meta), name=str(children[0]), value=children[1])

    def int_value(self, children):
        return self._int(children[0])

    def float_value(self, children):
        return self._float(children[0])

    def name_value(self, children):
        return str(children[0])

    def string_value(self, children):
        token = children[0]
        try:
            return json.loads(str(token), strict=False)
        except ValueError as error:
            self.diags.error(codes.INVALID_STRING,
                             f"invalid quoted string: {error.msg if hasattr(error, 'msg') else error}; "
                             f"strings use JSON escapes such as \\\" and \\n",
                             self._token_span(token))
            return ""

    def list_value(self, children):
        return [self._int(c) for c in children if c is not None]

    @v_args(meta=True)
    def input_decl(self, meta, children):
        return ast.InputDecl(span=self._span(meta), name=str(children[0]),
                             is_stream=children[1] is not None)

    @v_args(meta=True)
    def kv_sequences(self, meta, children):
        return ast.KvSequences(span=self._span(meta), labels=self._names(children))

    @v_args(meta=True)
    def state_decl(self, meta, children):
        return ast.StateDecl(span=self._span(meta), kind=str(children[0]), args=children[1] or [])

    @v_args(meta=True)
    def cap_decl(self, meta, children):
        return ast.CapDecl(span=self._span(meta), walk=str(children[0]),
                           value=self._int(children[1]))

    @v_args(meta=True)
    def capture_decl(self, meta, children):
        walk, family, *opts = children
        span = self._span(meta)
        settings = self._settings(opts, "capture")
        if "batch" not in settings:
            self.diags.error(codes.CAPTURE_WITHOUT_BATCH,
                             "this capture has no `batch=[...]` list of batch sizes", span)
        return ast.CaptureDecl(
            span=span,
            walk=str(walk) if walk is not None else None,
            family=family,
            batch=settings["batch"].value if "batch" in settings else [],
            tokens=settings["tokens"].value if "tokens" in settings else [],
            tokens_per_row=settings["tokens_per_row"].value if "tokens_per_row" in settings else 1,
        )

    def family(self, children):
        return str(children[0])

    @v_args(meta=True)
    def batch_opt(self, meta, children):
        return _Setting("batch", children[0], self._span(meta))

    @v_args(meta=True)
    def tokens_opt(self, meta, children):
        return _Setting("tokens", children[0], self._span(meta))

    @v_args(meta=True)
    def tokens_per_row_opt(self, meta, children):
        return _Setting("tokens_per_row", self._int(children[0]), self._span(meta))

    def int_list(self, children):
        return [self._int(c) for c in children if c is not None]

    @v_args(meta=True)
    def combine_decl(self, meta, children):
        name = str(children[0])
        walks = self._names(children[1:])
        stmts = [c for c in children[1:] if not isinstance(c, Token)]
        captures = [s for s in stmts if isinstance(s, ast.CaptureDecl)]
        for extra in captures[1:]:
            self.diags.error(codes.DUPLICATE_SETTING,
                             "`capture` is given twice in this combine", extra.span)
        settings = self._settings(stmts, "combine")
        return ast.CombineDecl(
            span=self._span(meta),
            name=name,
            walks=walks,
            cap=settings["cap"].value if "cap" in settings else None,
            rows=[s for s in stmts if isinstance(s, ast.RowsLimit)],
            capture=captures[0] if captures else None,
            attention=settings["attention"].value if "attention" in settings else None,
        )

    @v_args(meta=True)
    def combine_cap(self, meta, children):
        return _Setting("cap", self._int(children[0]), self._span(meta))

    @v_args(meta=True)
    def rows_limit(self, meta, children):
        return ast.RowsLimit(span=self._span(meta), walk=str(children[0]),
                             limit=self._int(children[2]))

    @v_args(meta=True)
    def attention(self, meta, children):
        return _Setting("attention", children[0], self._span(meta))

    def route(self, children):
        return str(children[0])

    # ---- walks ------------------------------------------------------------------------------

    @v_args(meta=True)
    def walk(self, meta, children):
        return ast.Walk(span=self._span(meta), name=str(children[0]), body=children[1:])

    @v_args(meta=True)
    def call(self, meta, children):
        node = children[0]
        rest = children[1:]
        return ast.Call(
            span=self._span(meta),
            node=str(node),
            inputs=self._names(rest),
            edges=[c for c in rest if isinstance(c, ast.Edge)],
        )

    @v_args(meta=True)
    def edge(self, meta, children):
        _arrow, name, (dest, modality), *flags = children
        kinds = {f.type for f in flags}
        return ast.Edge(
            span=self._span(meta),
            name=str(name),
            dest=dest,
            is_persist="PERSIST" in kinds,
            is_stream="STREAM" in kinds,
            is_device="DEVICE" in kinds,
            is_count_tokens="COUNT_TOKENS" in kinds,
            modality=modality,
        )

    def node_dest(self, children):
        return (str(children[0]), None)

    def client_dest(self, children):
        return ("client", str(children[1]))

    def edge_flag(self, children):
        return children[0]

    @v_args(meta=True)
    def parallel(self, meta, children):
        return ast.Parallel(span=self._span(meta), body=children)

    @v_args(meta=True)
    def sequential(self, meta, children):
        return ast.Sequential(span=self._span(meta), body=children)

    @v_args(meta=True)
    def loop(self, meta, children):
        name, max_iters, stop, *rest = children
        outputs, accumulate = rest[-2], rest[-1]
        return ast.Loop(
            span=self._span(meta),
            name=str(name) if name is not None else None,
            max_iters=max_iters,
            has_stop=stop is not None,
            body=rest[:-2],
            outputs=outputs or [],
            accumulate=accumulate or [],
        )

    def max_number(self, children):
        return self._int(children[0])

    def max_param(self, children):
        return str(children[0])

    def loop_outputs(self, children):
        return self._names(children)

    def loop_accumulate(self, children):
        return self._names(children)

    # ---- partitions -------------------------------------------------------------------------

    @v_args(meta=True)
    def partition(self, meta, children):
        rest = children[1:]
        return ast.Partition(
            span=self._span(meta),
            name=str(children[0]),
            stages=[c for c in rest if isinstance(c, ast.Stage)],
            streams=[c for c in rest if isinstance(c, ast.StreamSource)],
        )

    @v_args(meta=True)
    def single_stage(self, meta, children):
        return ast.Stage(span=self._span(meta), walks=[str(children[0])],
                         is_optional=children[1] is not None)

    @v_args(meta=True)
    def alt_stage(self, meta, children):
        return ast.Stage(span=self._span(meta), walks=self._names(children))

    @v_args(meta=True)
    def group_stage(self, meta, children):
        return ast.Stage(span=self._span(meta), walks=self._names(children),
                         is_optional=children[-1] is not None)

    @v_args(meta=True)
    def stream_source(self, meta, children):
        return ast.StreamSource(span=self._span(meta), partition=str(children[0]),
                                edge=str(children[1]), policy=children[2])

    @v_args(meta=True)
    def window(self, meta, children):
        stride: Optional[Token] = children[1]
        return ast.ChunkPolicy(span=self._span(meta), kind="window", size=self._int(children[0]),
                               stride=self._int(stride) if stride is not None else None)

    @v_args(meta=True)
    def left_context(self, meta, children):
        return ast.ChunkPolicy(span=self._span(meta), kind="left_context",
                               size=self._int(children[0]), context=self._int(children[1]))

    @v_args(meta=True)
    def fixed(self, meta, children):
        return ast.ChunkPolicy(span=self._span(meta), kind="fixed", size=self._int(children[0]),
                               is_continue_after_done=children[1] is not None)
