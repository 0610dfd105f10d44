"""Build the AST (mstar/lang/ast.py) from a Lark parse tree of grammar/mw.lark.

In: a Lark tree whose rules are named after the AST classes (snake_case), made with
`keep_all_tokens=True` and `maybe_placeholders=True`, and a Diagnostics collection. Out: AST nodes,
each with the span of its rule, from its first to its last token (keywords and braces included).
Spans are computed here from the tokens rather than by Lark's `propagate_positions`, which costs
more than the whole rest of the parse.

Problems the grammar cannot see but the AST cannot hold (a setting given twice, a capture without
`batch=`, a number out of range, a bad string escape) become MW020-MW023 diagnostics; the builder
goes on so one run reports them all, and the caller drops the tree when any error was added.

Comments: the builder records in `anchors` the places comments may belong to that the tree does not
show (the `}` of each block, the `cap` / `attention` lines of a combine); mstar/lang/comments.py
uses them with the tree to attach the source's comments.
"""
from __future__ import annotations

import difflib
import json
import math
from dataclasses import dataclass
from typing import Any, Iterable, Optional

from lark import Token, Transformer

from mstar.lang import ast
from mstar.lang import codes
from mstar.lang.comments import Anchor
from mstar.lang.diagnostics import Diagnostics

# Numbers beyond a signed 64-bit integer cannot be meant; refusing them keeps later passes and the
# JSON plan free of huge integers.
MAX_INT = 2**63 - 1


@dataclass(frozen=True)
class _Part:
    """A piece of a rule that is not an AST node itself (`cap 64`, `batch=[...]`, an engine kind)."""

    key: str
    value: Any
    span: ast.Span


def _names(children: Iterable) -> list[str]:
    return [str(c) for c in children if isinstance(c, Token) and c.type == "NAME"]


def _has_token(children: Iterable, type_name: str) -> bool:
    return any(isinstance(c, Token) and c.type == type_name for c in children)


def _of(children: Iterable, cls) -> list:
    return [c for c in children if isinstance(c, cls)]


def _part(children: Iterable, key: str) -> Optional[_Part]:
    return next((c for c in children if isinstance(c, _Part) and c.key == key), None)


class AstBuilder(Transformer):
    """Lark transformer: one method per grammar rule, each returning an AST node or a `_Part`."""

    def __init__(self, file: str, diags: Diagnostics):
        super().__init__(visit_tokens=False)
        self.file = file
        self.diags = diags
        self.anchors: list[Anchor] = []

    # ---- spans and numbers --------------------------------------------------------------------

    def _span(self, children: list) -> ast.Span:
        """From the start of the first positioned child to the end of the last one."""
        first = next((c for c in children if c is not None), None)
        last = next((c for c in reversed(children) if c is not None), None)
        if first is None or last is None:
            return ast.Span(file=self.file)
        # Lark types a token's position Optional (for hand-made tokens); its lexer sets every one.
        if isinstance(first, Token):
            line, col = first.line or 1, first.column or 1
        else:
            line, col = first.span.line, first.span.col
        if isinstance(last, Token):
            end_line, end_col = last.end_line or line, last.end_column or col
        else:
            end_line, end_col = last.span.end_line, last.span.end_col
        return ast.Span(file=self.file, line=line, col=col, end_line=end_line, end_col=end_col)

    def _token_span(self, token: Token) -> ast.Span:
        return self._span([token])

    def _int(self, token: Token) -> int:
        # Python refuses int() of more than 4300 digits; anything past 64 bits is refused anyway.
        text = str(token)
        if len(text.lstrip("+-")) > 19 or abs(int(text)) > MAX_INT:
            self.diags.error(codes.NUMBER_OUT_OF_RANGE,
                             f"number `{text[:30]}` is out of range (at most {MAX_INT})",
                             self._token_span(token))
            return 0
        return int(text)

    def _ints(self, children: list) -> list[int]:
        return [self._int(c) for c in children
                if isinstance(c, Token) and c.type in ("INT", "SIGNED_INT")]

    def _settings(self, parts: list[_Part], owner: str) -> dict[str, _Part]:
        """Settings by key; a key given twice is reported and the first one kept."""
        found: dict[str, _Part] = {}
        for item in parts:
            if item.key in found:
                self.diags.error(codes.DUPLICATE_SETTING, f"`{item.key}` is given twice in this {owner}",
                                 item.span)
                continue
            found[item.key] = item
        return found

    def _one(self, items: list, what: str, owner: str):
        """The first of `items` (or None); any further one is reported as given twice."""
        for extra in items[1:]:
            self.diags.error(codes.DUPLICATE_SETTING, f"`{what}` is given twice in this {owner}", extra.span)
        return items[0] if items else None

    def _word(self, token: Token, allowed: tuple[str, ...], what: str) -> Optional[str]:
        """`token` when it is one of `allowed`, else None after an MW018 naming the choices."""
        word = str(token)
        if word in allowed:
            return word
        close = difflib.get_close_matches(word, allowed, n=1, cutoff=0.6)
        hint = f"; did you mean '{close[0]}'?" if close else ""
        self.diags.error(codes.UNKNOWN_ROLE_WORD,
                         f"unknown {what} `{word[:40]}` (one of {', '.join(allowed)}){hint}",
                         self._token_span(token))
        return None

    def _closed(self, node: ast.AstNode, children: list) -> ast.AstNode:
        """`node` (a block), after recording its closing `}` as the anchor of its end comments."""
        brace = next(c for c in reversed(children) if isinstance(c, Token) and c.type == "RBRACE")
        self.anchors.append(Anchor(brace.line or 1, brace.column or 1, node, "end"))
        return node

    # ---- top level --------------------------------------------------------------------------

    def spec(self, children):
        return ast.Spec(
            span=self._span(children),
            model=_part(children, "model").value,
            params=_of(children, ast.Param),
            nodes=_of(children, ast.NodeDecl),
            walks=_of(children, ast.Walk),
            partitions=_of(children, ast.Partition),
        )

    def chunk(self, children):
        return children[0]

    def model_decl(self, children):
        return _Part("model", _names(children)[0], self._span(children))

    def param(self, children):
        return ast.Param(span=self._span(children), name=_names(children)[0],
                         value=self._ints(children)[0])

    # ---- nodes ------------------------------------------------------------------------------

    def node_decl(self, children):
        arg_list = _part(children, "args")
        flags = {p.value for p in children if isinstance(p, _Part) and p.key == "flag"}
        return self._closed(ast.NodeDecl(
            span=self._span(children),
            name=_names(children)[0],
            engine=_part(children, "engine").value[0],
            model_kind=_part(children, "engine").value[1],
            args=arg_list.value if arg_list is not None else [],
            is_tp="TP" in flags,
            is_async="NO_SPECULATION" not in flags,
            kv_sequences=self._one(_of(children, ast.KvSequences), "kv_sequences", "node"),
            cross_kv=_of(children, ast.CrossKv),
            guidance=_of(children, ast.GuidanceDecl),
            kv_access=_of(children, ast.KvAccess),
            bidirectional=self._one(_of(children, ast.Bidirectional), "bidirectional", "node"),
            states=_of(children, ast.StateDecl),
            submodels=_of(children, ast.SubModelDecl),
            inputs=_of(children, ast.InputDecl),
            outputs=_of(children, ast.OutputDecl),
            caps=_of(children, ast.CapDecl),
            batching=_of(children, ast.BatchingDecl),
            captures=_of(children, ast.CaptureDecl),
            capture_replays=_of(children, ast.CaptureReplay),
            combines=_of(children, ast.CombineDecl),
            prompt_format=self._one(_of(children, ast.PromptFormat), "prompt_format", "node"),
        ), children)

    def engine(self, children):
        kind = children[1] if len(children) > 1 else None
        model_kind = None if kind is None else self._word(kind, ast.MODEL_KINDS, "model kind")
        return _Part("engine", (str(children[0]), model_kind), self._span(children))

    def node_flag(self, children):
        return _Part("flag", children[0].type, self._span(children))

    def arg_list(self, children):
        return _Part("args", _of(children, ast.Arg), self._span(children))

    def arg(self, children):
        return ast.Arg(span=self._span(children), name=str(children[0]), value=children[2].value)

    def int_value(self, children):
        return _Part("value", self._int(children[0]), self._span(children))

    def float_value(self, children):
        token = children[0]
        value = float(str(token))
        if not math.isfinite(value):
            self.diags.error(codes.NUMBER_OUT_OF_RANGE,
                             f"number `{str(token)[:30]}` is out of range for a decimal number",
                             self._token_span(token))
            value = 0.0
        return _Part("value", value, self._span(children))

    def name_value(self, children):
        return _Part("value", str(children[0]), self._span(children))

    def string_value(self, children):
        return _Part("value", self._string(children[0]), self._span(children))

    def _string(self, token: Token) -> str:
        try:
            value = json.loads(str(token), strict=False)
        except ValueError as error:
            reason = getattr(error, "msg", str(error))
            self.diags.error(codes.INVALID_STRING,
                             f"invalid quoted string: {reason}; strings use JSON escapes such as \\\" and \\n",
                             self._token_span(token))
            value = ""
        if any("\ud800" <= char <= "\udfff" for char in value):  # JSON takes "\ud800" alone: compile crashed
            self.diags.error(codes.INVALID_STRING,
                             "invalid quoted string: an unpaired surrogate escape (\\udXXX) is not a character; "
                             "write the character itself or both halves of its pair", self._token_span(token))
            value = ""
        return value

    def prompt_format(self, children):
        template = next(c for c in children if isinstance(c, Token) and c.type == "STRING")
        return ast.PromptFormat(span=self._span(children), template=self._string(template),
                                args=_of(children, ast.Arg))

    def list_value(self, children):
        return _Part("value", self._ints(children), self._span(children))

    def input_decl(self, children):
        words = [c for c in children if isinstance(c, Token) and c.type == "NAME"]
        role = self._word(words[1], ast.INPUT_ROLES, "input role") if len(words) > 1 else None
        prompt = self._word(words[2], ast.MODALITIES, "prompt modality") if len(words) > 2 else None
        return ast.InputDecl(span=self._span(children), name=str(words[0]),
                             is_stream=_has_token(children, "STREAM"), role=role, prompt=prompt)

    def output_decl(self, children):
        words = [c for c in children if isinstance(c, Token) and c.type == "NAME"]
        role = self._word(words[1], ast.OUTPUT_ROLES, "output role") or "tokens"
        return ast.OutputDecl(span=self._span(children), name=str(words[0]), role=role)

    def guidance_decl(self, children):
        words = [c for c in children if isinstance(c, Token) and c.type == "NAME"]
        number = next(c for c in children if isinstance(c, Token) and c.type in ("SIGNED_INT", "SIGNED_FLOAT"))
        scale = self._int(number) if number.type == "SIGNED_INT" else float(str(number))
        if not math.isfinite(scale) or scale < 0:
            self.diags.error(codes.NUMBER_OUT_OF_RANGE,
                             f"guidance scale `{str(number)[:30]}` must be a finite number >= 0",
                             self._token_span(number))
            scale = 1.0
        drops = self._word(words[1], ast.MODALITIES, "dropped modality") or "text"
        return ast.GuidanceDecl(span=self._span(children), label=str(words[0]), drops=drops, scale=float(scale))

    def kv_access(self, children):
        # children: KV, NAME, then `reads` NAME+ and/or `writes` NAME+
        walk, reads, writes = str(children[1]), [], []
        current = None
        for child in children[2:]:
            if isinstance(child, Token) and child.type in ("_READS", "_WRITES"):
                current = reads if child.type == "_READS" else writes
            elif isinstance(child, Token) and child.type == "NAME" and current is not None:
                current.append(str(child))
        return ast.KvAccess(span=self._span(children), walk=walk, reads=reads, writes=writes)

    def cross_kv(self, children):
        label, source = _names(children)[:2]
        return ast.CrossKv(span=self._span(children), label=label, source=source,
                           num_tokens=self._ints(children)[0])

    def kv_sequences(self, children):
        return ast.KvSequences(span=self._span(children), labels=_names(children))

    def bidirectional(self, children):
        return ast.Bidirectional(span=self._span(children), walks=_names(children))

    def state_decl(self, children):
        arg_list = _part(children, "args")
        return ast.StateDecl(span=self._span(children), kind=str(children[1]),
                             args=arg_list.value if arg_list is not None else [])

    def submodel_decl(self, children):
        names = _names(children)
        arg_list = _part(children, "args")
        samples = _part(children, "samples")
        name, depth = samples.value if samples is not None else (None, 0)
        return ast.SubModelDecl(span=self._span(children), name=names[0], walks=names[1:],
                                args=arg_list.value if arg_list is not None else [], samples=name, depth=depth)

    def submodel_samples(self, children):
        return _Part("samples", (_names(children)[0], self._ints(children)[0]), self._span(children))

    def cap_decl(self, children):
        return ast.CapDecl(span=self._span(children), walk=_names(children)[0],
                           value=self._ints(children)[0])

    def batching_decl(self, children):
        words = [c for c in children if isinstance(c, Token) and c.type == "NAME"]
        rules = [self._word(word, ast.BATCH_RULES, "batching rule") for word in words[1:]]
        return ast.BatchingDecl(span=self._span(children), walk=str(words[0]),
                                rules=[rule for rule in rules if rule is not None])

    def capture_decl(self, children):
        span = self._span(children)
        options = [c for c in children if isinstance(c, _Part) and c.key != "family"]
        settings = self._settings(options, "capture")
        if "batch" not in settings:
            self.diags.error(codes.CAPTURE_WITHOUT_BATCH,
                             "this capture has no `batch=[...]` list of batch sizes", span)
        walks = _names(children)
        return ast.CaptureDecl(
            span=span,
            walk=walks[0] if walks else None,
            family=_part(children, "family").value,
            batch=settings["batch"].value if "batch" in settings else [],
            tokens=settings["tokens"].value if "tokens" in settings else [],
            tokens_per_row=settings["tokens_per_row"].value if "tokens_per_row" in settings else 1,
            guidance=settings["guidance"].value if "guidance" in settings else None,
            labels=settings["labels"].value if "labels" in settings else [],
            is_eager_above="eager_above" in settings,
            is_piecewise="piecewise" in settings,
            unroll_prompts=settings["unroll_prompts"].value if "unroll_prompts" in settings else 0,
        )

    def capture_replay(self, children):
        walk, source = _names(children)
        return ast.CaptureReplay(span=self._span(children), walk=walk, source=source)

    def family(self, children):
        return _Part("family", str(children[0]), self._span(children))

    def batch_opt(self, children):
        return _Part("batch", children[-1].value, self._span(children))

    def tokens_opt(self, children):
        return _Part("tokens", children[-1].value, self._span(children))

    def guidance_opt(self, children):
        # `guided` and `unguided` are one setting: both on one line is a setting given twice
        return _Part("guidance", str(children[0]), self._span(children))

    def labels_opt(self, children):
        return _Part("labels", _names(children), self._span(children))

    def eager_above_opt(self, children):
        return _Part("eager_above", True, self._span(children))

    def piecewise_opt(self, children):
        return _Part("piecewise", True, self._span(children))

    def tokens_per_row_opt(self, children):
        return _Part("tokens_per_row", self._ints(children)[0], self._span(children))

    def unroll_prompts_opt(self, children):
        return _Part("unroll_prompts", self._ints(children)[0], self._span(children))

    def int_list(self, children):
        return _Part("ints", self._ints(children), self._span(children))

    def combine_decl(self, children):
        names = _names(children)
        settings = self._settings(
            [c for c in children if isinstance(c, _Part) and c.key in ("cap", "attention")], "combine")
        combine = ast.CombineDecl(
            span=self._span(children),
            name=names[0],
            walks=names[1:],
            cap=settings["cap"].value if "cap" in settings else None,
            rows=_of(children, ast.RowsLimit),
            capture=self._one(_of(children, ast.CaptureDecl), "capture", "combine"),
            attention=settings["attention"].value if "attention" in settings else None,
            cap_span=settings["cap"].span if "cap" in settings else None,
        )
        for key, setting in settings.items():
            self.anchors.append(Anchor(setting.span.line, setting.span.col, combine, key))
        return self._closed(combine, children)

    def combine_cap(self, children):
        return _Part("cap", self._ints(children)[0], self._span(children))

    def rows_limit(self, children):
        return ast.RowsLimit(span=self._span(children), walk=_names(children)[0],
                             limit=self._ints(children)[0])

    def attention(self, children):
        return _Part("attention", children[-1].value, self._span(children))

    def route(self, children):
        return _Part("route", str(children[0]), self._span(children))

    # ---- walks ------------------------------------------------------------------------------

    def walk(self, children):
        return self._closed(ast.Walk(span=self._span(children), name=_names(children)[0],
                                     body=_sections(children)), children)

    def call(self, children):
        names = _names(children)
        return ast.Call(span=self._span(children), node=names[0], inputs=names[1:],
                        edges=_of(children, ast.Edge))

    def edge(self, children):
        dest = _part(children, "dest")
        flags = {c.value for c in children if isinstance(c, _Part) and c.key == "flag"}
        return ast.Edge(
            span=self._span(children),
            name=_names(children)[0],
            dest=dest.value[0],
            is_persist="PERSIST" in flags,
            is_stream="STREAM" in flags,
            is_device="DEVICE" in flags,
            is_count_tokens="COUNT_TOKENS" in flags,
            modality=dest.value[1],
        )

    def node_dest(self, children):
        return _Part("dest", (str(children[0]), None), self._span(children))

    def client_dest(self, children):
        modality = self._word(children[1], ast.CLIENT_MODALITIES, "client modality")
        return _Part("dest", ("client", modality or "text"), self._span(children))

    def edge_flag(self, children):
        return _Part("flag", children[0].type, self._span(children))

    def parallel(self, children):
        return self._closed(ast.Parallel(span=self._span(children), body=_sections(children)), children)

    def sequential(self, children):
        return self._closed(ast.Sequential(span=self._span(children), body=_sections(children)), children)

    def loop(self, children):
        # children: _LOOP, [NAME], _MAX, "=", max_iters, [count], [STOP], "{", sections..., "}", [outputs],
        # [accumulate]
        name = children[1]
        count = _part(children, "count")
        outputs = _part(children, "outputs")
        accumulate = _part(children, "accumulate")
        return self._closed(ast.Loop(
            span=self._span(children),
            name=str(name) if name is not None else None,
            max_iters=_part(children, "max").value,
            count=count.value if count is not None else None,
            has_stop=_has_token(children, "STOP"),
            body=_sections(children),
            outputs=outputs.value if outputs is not None else [],
            accumulate=accumulate.value if accumulate is not None else [],
        ), children)

    def max_number(self, children):
        return _Part("max", self._int(children[0]), self._span(children))

    def max_param(self, children):
        return _Part("max", str(children[0]), self._span(children))

    def loop_count(self, children):
        return _Part("count", str(children[-1]), self._span(children))

    def loop_outputs(self, children):
        return _Part("outputs", _names(children), self._span(children))

    def loop_accumulate(self, children):
        return _Part("accumulate", _names(children), self._span(children))

    # ---- partitions -------------------------------------------------------------------------

    def partition(self, children):
        return ast.Partition(
            span=self._span(children),
            name=_names(children)[0],
            stages=_of(children, ast.Stage),
            repeat=next(iter(_of(children, ast.Repeat)), None),
            streams=_of(children, ast.StreamSource),
        )

    def repeat(self, children):
        bound = _part(children, "max")
        return ast.Repeat(span=self._span(children), value=_names(children)[0], max_rounds=bound.value)

    def single_stage(self, children):
        return ast.Stage(span=self._span(children), walks=_names(children),
                         is_optional=_has_token(children, "QMARK"))

    def alt_stage(self, children):
        return ast.Stage(span=self._span(children), walks=_names(children))

    def group_stage(self, children):
        sequences = [c.value for c in children if isinstance(c, _Part) and c.key == "alternative"]
        lengths = [len(s) for s in sequences]
        return ast.Stage(span=self._span(children), walks=[w for s in sequences for w in s],
                         is_optional=_has_token(children, "QMARK"),
                         sequence_lengths=lengths if any(n > 1 for n in lengths) else [])

    def alternative(self, children):
        return _Part("alternative", _names(children), self._span(children))

    def stream_source(self, children):
        names = _names(children)
        keep = _part(children, "keep")
        return ast.StreamSource(span=self._span(children), partition=names[0], edge=names[1],
                                policy=_of(children, ast.ChunkPolicy)[0],
                                keep=keep.value if keep is not None else None)

    def keep_range(self, children):
        low, high = self._ints(children)
        return _Part("keep", (low, high), self._span(children))

    def window(self, children):
        sizes = self._ints(children)
        return ast.ChunkPolicy(span=self._span(children), kind="window", size=sizes[0],
                               stride=sizes[1] if len(sizes) > 1 else None)

    def left_context(self, children):
        sizes = self._ints(children)
        return ast.ChunkPolicy(span=self._span(children), kind="left_context", size=sizes[0],
                               context=sizes[1])

    def fixed(self, children):
        return ast.ChunkPolicy(span=self._span(children), kind="fixed", size=self._ints(children)[0],
                               is_continue_after_done=_has_token(children, "CONTINUE_AFTER_DONE"))


_SECTION_TYPES = (ast.Call, ast.Parallel, ast.Sequential, ast.Loop)


def _sections(children: list) -> list:
    return [c for c in children if isinstance(c, _SECTION_TYPES)]
