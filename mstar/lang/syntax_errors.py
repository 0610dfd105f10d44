"""Turn Lark's syntax errors into MW0xx diagnostics with plain-word expectations and named hints.

In: an `UnexpectedInput` from the LALR parser, the source text and the terminal patterns of the
grammar. Out: one (code, message, span) per error. Common mistakes (a missing `{` or `}`, `=` for
`<=` in `rows`, a missing `->` before an edge, an unknown engine kind / capture family / attention
route / chunk policy / state kind / edge flag, a `cap` without a number, a reserved word used as a
name, a misplaced `model` line) get their own code and message; anything else is MW001-MW003 with
the list of what the grammar expected there, and a "did you mean" where a name is close to a
keyword the grammar would take there.
"""
from __future__ import annotations

import difflib
from dataclasses import dataclass
from typing import Optional

from lark import Token, Tree
from lark.exceptions import UnexpectedCharacters, UnexpectedInput, UnexpectedToken

from mstar.lang import ast
from mstar.lang import codes
from mstar.lang.diagnostics import Note

# Terminal names whose text is a word of the language: seen where a name is expected they are
# reserved words, not names.
_WORD_TERMINALS_EXCLUDED = {"NAME", "INT", "SIGNED_INT", "SIGNED_FLOAT", "STRING", "COMMENT", "WS"}

_REGEX_WORDS = {
    "NAME": "a name",
    "INT": "a number",
    "SIGNED_INT": "a number",
    "SIGNED_FLOAT": "a decimal number",
    "STRING": "a quoted string",
    "$END": "end of file",
}

_EDGE_FLAGS = "persist, stream, device, count_tokens"
# Words that start a statement only inside a block: found between declarations, the block most
# likely closed early (or a fragment was pasted outside it).
_BODY_WORDS = {**dict.fromkeys(("IN", "OUT", "PROMPT_FORMAT", "KV_SEQUENCES", "CROSS_KV", "GUIDANCE", "KV",
                                "BIDIRECTIONAL", "STATE", "SUBMODEL", "CAP", "BATCHING", "CAPTURE", "COMBINE"),
                               "node"),
               **dict.fromkeys(("LOOP", "PARALLEL", "SEQUENTIAL"), "walk")}
# Words that start a section of a walk besides a call; a misspelt one reads as a node's name.
_SECTION_WORDS = ("loop", "parallel", "sequential")


@dataclass(frozen=True)
class SyntaxProblem:
    code: str
    message: str
    span: ast.Span
    notes: tuple[Note, ...] = ()


class ErrorExplainer:
    """Explains syntax errors of one grammar; `terminals` maps terminal name -> literal text or None."""

    def __init__(self, terminals: dict[str, Optional[str]]):
        self.terminals = terminals
        self.keywords = {name for name, text in terminals.items()
                         if text is not None and text.isidentifier() and name not in _WORD_TERMINALS_EXCLUDED}

    # ---- words ------------------------------------------------------------------------------

    def describe_terminal(self, name: str) -> str:
        if name in _REGEX_WORDS:
            return _REGEX_WORDS[name]
        text = self.terminals.get(name)
        return f"`{text}`" if text is not None else name.lower()

    def describe_expected(self, expected) -> str:
        words = sorted({self.describe_terminal(n.lstrip("_") if n != "$END" else n) for n in expected})
        if not words:
            return "nothing more"
        if len(words) == 1:
            return words[0]
        return "one of " + ", ".join(words)

    def describe_token(self, token: Token) -> str:
        if token.type == "$END":
            return "end of file"
        if token.type == "NAME":
            return f"name `{token}`"
        return f"`{_short(str(token))}`"

    # ---- main entry ---------------------------------------------------------------------------

    def explain(self, error: UnexpectedInput, text: str, file: str, *,
                is_declaration: bool = False, is_last: bool = True, line_offset: int = 0) -> SyntaxProblem:
        """One problem for `error`, found parsing `text` (the whole file, or one declaration of it
        when `is_declaration`; `is_last` says whether that declaration ends the file).
        `line_offset`: the number of lines of the file before `text`; every line in the problem
        is a line of the file (the error's tokens are moved down in place)."""
        if line_offset:
            _shift_error(error, line_offset)
        if isinstance(error, UnexpectedToken):
            return self._explain_token(error, text, file, is_declaration, is_last, line_offset)
        if isinstance(error, UnexpectedCharacters):
            pos = error.pos_in_stream
            char = text[pos] if pos is not None and 0 <= pos < len(text) else "?"
            span = ast.Span(file=file, line=error.line, col=error.column,
                            end_line=error.line, end_col=error.column + 1)
            expected = self.describe_expected(error.allowed or ())
            return SyntaxProblem(codes.UNEXPECTED_CHARACTER,
                                 f"unexpected character {_show_char(char)}; expected {expected}", span)
        span = ast.Span(file=file, line=getattr(error, "line", 1) or 1,
                        col=getattr(error, "column", 1) or 1)
        return SyntaxProblem(codes.UNEXPECTED_TOKEN, f"syntax error: {error}", span)

    def _explain_token(self, error: UnexpectedToken, text: str, file: str,
                       is_declaration: bool, is_last: bool, line_offset: int) -> SyntaxProblem:
        token = _normalised(error.token)
        expected = {name.lstrip("_") if name != "$END" else name for name in _accepted(error)}
        if is_declaration and "$END" in expected and token.type != "$END":
            # The declaration may end here: the file may go on with the next declaration.
            expected |= {"PARAM", "NODE", "WALK", "PARTITION"}
        stack = _value_stack(error)
        if token.type == "$END":
            span = _end_span(text, file, line_offset)
        else:
            span = _token_span(token, file)
        where = self.describe_token(token)
        plain = f"unexpected {where}; expected {self.describe_expected(expected)}"

        if token.type == "$END":
            return self._explain_end(expected, stack, span, file, is_last)
        if _is_ellipsis(token, text):
            return SyntaxProblem(codes.UNEXPECTED_TOKEN,
                                 "`...` stands for text left out in the docs' examples and is not part of the "
                                 "language: write out what it stands for (specs/ holds complete examples)",
                                 span.model_copy(update={"end_col": span.col + 3}))
        known = self._explain_known_mistake(token, expected, stack, span, where, file)
        if known is not None:
            return known
        previous = _previous_token(stack)
        if "LBRACE" in expected and (previous is None or (previous.end_line or 1) < (token.line or 1)):
            # The header's line ended and the block's body started without its `{`.
            return SyntaxProblem(codes.MISSING_LBRACE,
                                 f"missing `{{` at the end of line {previous.end_line if previous else 1}: "
                                 f"{plain}", span)
        if previous is not None and str(previous).lstrip("-").isdigit() and str(token)[:2].startswith(".") \
                and str(token)[1:2].isdigit():  # (`param n = 512.0`: "unexpected `.0`; expected `node`, ...")
            fix = f": write `{previous}`" if set(str(token)[1:]) == {"0"} else ""
            return SyntaxProblem(codes.UNEXPECTED_TOKEN, f"`{previous}{token}` is not a whole number, and a whole "
                                 f"number stands here{fix}", span)
        closer = self._unclosed_list(token, expected, previous)
        if closer is not None:
            return SyntaxProblem(codes.UNEXPECTED_TOKEN, f"missing `{closer}` at the end of line "
                                 f"{previous.end_line if previous else 1}: {plain}", span)
        return SyntaxProblem(codes.UNEXPECTED_TOKEN, plain + self._keyword_hint(token, expected), span)

    def _unclosed_list(self, token: Token, expected: set[str], previous: Optional[Token]) -> Optional[str]:
        """The `]` or `)` a list or argument list left open at the end of its line, where the next
        line starts a statement (a keyword or a brace: no item of the list), or None. The error was
        reported at the next line's first word only, as 'expected one of `,`, `]`'."""
        if previous is None or (previous.end_line or 1) >= (token.line or 1):
            return None
        if token.type not in self.keywords and token.type not in ("RBRACE", "LBRACE", "$END"):
            return None
        return next((text for name, text in sorted(self.terminals.items()) if name in expected
                     and text in ("]", ")")), None)

    def _keyword_hint(self, token: Token, expected: set[str]) -> str:
        """`; did you mean `partition`?` when a name stands where a keyword close to it was expected
        (a misspelt keyword lexes as a name), else an empty string."""
        if token.type != "NAME":
            return ""
        words = sorted(text for name, text in self.terminals.items() if name in expected and name in self.keywords
                       and text is not None)
        close = difflib.get_close_matches(str(token), words, n=1, cutoff=0.6)
        return f"; did you mean `{close[0]}`?" if close else ""

    def _explain_end(self, expected: set[str], stack: list, span: ast.Span, file: str, is_last: bool) -> SyntaxProblem:
        """The declaration or the file ended early: an unclosed block, else what was expected."""
        brace = _last_token(stack, "LBRACE")
        if "RBRACE" in expected and brace is not None:
            return SyntaxProblem(codes.MISSING_RBRACE,
                                 f"missing `}}`: the block opened at line {brace.line} "
                                 f"is not closed before the end of the declaration", span,
                                 (Note("the block opened here", _token_span(brace, file)),))
        ending = "end of file" if is_last else "end of the declaration"
        return SyntaxProblem(codes.UNEXPECTED_END,
                             f"unexpected {ending}; expected {self.describe_expected(expected)}", span)

    def _explain_known_mistake(self, token: Token, expected: set[str], stack: list, span: ast.Span, where: str,
                               file: str) -> Optional[SyntaxProblem]:
        """A mistake the message can name (a missing `}` or `->`, a reserved word as a name, `=` for
        `<=`, ...), or None for the general message."""
        if expected == {"MODEL"}:
            return SyntaxProblem(codes.MODEL_LINE,
                                 f"a spec starts with `model NAME`; found {where}", span)
        if token.type == "MODEL":
            return SyntaxProblem(codes.MODEL_LINE,
                                 "`model` may appear only once, as the first line of the spec", span)
        if token.type == "NAME":
            named = self._explain_unknown_word(token, expected)
            if named is not None:
                return SyntaxProblem(named[0], named[1], span)
        if token.type in _BODY_WORDS and {"NODE", "WALK"} <= expected:
            return SyntaxProblem(codes.UNEXPECTED_TOKEN,
                                 f"`{token}` is a statement of a {_BODY_WORDS[token.type]}'s body, here outside "
                                 f"every declaration: it goes inside the {_BODY_WORDS[token.type]}'s `{{ }}` (does "
                                 f"a `}}` above close the block early?)", span)
        if expected == {"MAX"}:
            return SyntaxProblem(codes.UNEXPECTED_TOKEN,
                                 f"a loop needs the most iterations it runs: `loop [NAME] max=N|PARAM [count=PARAM] "
                                 f"[stop] {{`; found {where}", span)
        section = _misspelt_section_word(stack, expected)
        if section is not None:
            return SyntaxProblem(codes.UNEXPECTED_TOKEN,
                                 f"unknown word `{stack[-1]}`: a walk's section is a call `NODE(INPUTS)`, "
                                 f"`parallel {{`, `sequential {{` or `loop`; did you mean `{section}`?",
                                 _token_span(stack[-1], file))
        if "RBRACE" in expected and token.type in {"NODE", "WALK", "PARTITION", "PARAM"}:
            brace = _last_token(stack, "LBRACE")
            if brace is not None:
                return SyntaxProblem(codes.MISSING_RBRACE,
                                     f"missing `}}`: the block opened at line {brace.line} is not closed "
                                     f"before this `{token}`", span,
                                     (Note("the block opened here", _token_span(brace, file)),))
        if token.type == "LPAR" and stack and _is_keyword(stack[-1], self.keywords):
            return SyntaxProblem(codes.RESERVED_WORD,
                                 f"`{stack[-1]}` is a reserved word and cannot name a node here",
                                 _token_span(stack[-1], file))
        if token.type in self.keywords and "NAME" in expected:
            return SyntaxProblem(codes.RESERVED_WORD,
                                 f"`{token}` is a reserved word and cannot be used as a name here; "
                                 f"expected {self.describe_expected(expected)}", span)
        if token.type == "EQUAL" and "LE" in expected:
            return SyntaxProblem(codes.ROWS_NEEDS_LE,
                                 "a rows limit is written `rows WALK <= N`, with `<=` instead of `=`", span)
        if _last_keyword(stack, self.keywords) == "CAP" and "INT" in expected:
            return SyntaxProblem(codes.CAP_WITHOUT_NUMBER,
                                 f"`cap` needs a number of rows (`cap WALK N` in a node, `cap N` in a "
                                 f"combine); found {where}", span)
        if token.type == "COLON" and "LPAR" in expected and stack and _is_name(stack[-1]):
            return SyntaxProblem(codes.MISSING_ARROW,
                                 f"missing `->` before the edge `{stack[-1]}:` (write `-> {stack[-1]}: DEST`)",
                                 span)
        flag = _stray_flag(stack)
        if flag is not None and "LPAR" in expected:
            return _explain_stray_flag(flag, stack, file)
        if stack and isinstance(stack[-1], Token) and stack[-1].type == "CLIENT" and "NAME" in expected:
            return SyntaxProblem(codes.CLIENT_WITHOUT_MODALITY,
                                 "a client edge names what it carries: `-> NAME: client MODALITY` "
                                 f"(text, audio, image, ...); found {where}", span)
        return None

    def _explain_unknown_word(self, token: Token, expected: set[str]) -> Optional[tuple[str, str]]:
        """A name found where only certain words may stand: engine kind, capture family, ..."""
        if expected and expected <= {"KV", "STATELESS"}:
            return (codes.UNKNOWN_ENGINE,
                    f"unknown engine kind `{token}`; an engine is `kv` or `stateless`")
        if {"BATCHED", "PACKED"} <= expected and "NAME" not in expected:
            replays = " (or `capture WALK replays OTHER`: replay another walk's captures)" \
                if "REPLAYS" in expected else ""
            return (codes.UNKNOWN_CAPTURE_FAMILY,
                    f"unknown capture family `{token}`; a capture is `batched` or `packed`{replays}")
        if expected == {"SPLIT", "PACKED"}:
            return (codes.UNKNOWN_ATTENTION_ROUTE,
                    f"unknown attention route `{token}`; the route is `split` or `packed`")
        if {"WINDOW", "LEFT_CONTEXT", "FIXED"} <= expected:
            return (codes.UNKNOWN_CHUNK_POLICY,
                    f"unknown chunk policy `{token}`; a stream is cut by `window(SIZE, stride=N)`, "
                    f"`left_context(chunk=N, context=M)` or `fixed(SIZE[, continue_after_done])`")
        if expected == {"STATE_KIND"}:
            return (codes.UNKNOWN_STATE_KIND,
                    f"unknown state kind `{token}`; the state kind is `recurrent`")
        return None


# ---- helpers ------------------------------------------------------------------------------------

def _explain_stray_flag(flag: Token, stack: list, file: str) -> SyntaxProblem:
    """A word after an edge that is no flag: a misspelt flag, or the modality of a misspelt
    `client` (`-> x: clinet text` reads as an edge to a node `clinet` and a flag `text`)."""
    dest = _final_token(stack[-2]) if isinstance(stack[-2], Tree) else None
    client = difflib.get_close_matches(str(dest), ["client"], n=1, cutoff=0.6) if dest is not None else []
    if str(flag) in ast.CLIENT_MODALITIES and dest is not None and dest.type == "NAME" and client:
        return SyntaxProblem(codes.UNKNOWN_EDGE_FLAG,
                             f"`{dest} {flag}` is an edge to a node `{dest}` and an unknown edge flag `{flag}`; a "
                             f"client edge is written `-> NAME: client MODALITY`: did you mean `client`?",
                             _token_span(dest, file))
    close = difflib.get_close_matches(str(flag), _EDGE_FLAGS.split(", "), n=1, cutoff=0.6)
    hint = f"; did you mean `{close[0]}`?" if close else ""
    return SyntaxProblem(codes.UNKNOWN_EDGE_FLAG,
                         f"unknown edge flag `{flag}`; edge flags are {_EDGE_FLAGS}, and a client "
                         f"edge is written `-> NAME: client MODALITY`{hint}", _token_span(flag, file))


def _is_ellipsis(token: Token, text: str) -> bool:
    """Whether the token is the start of a `...` (lexed as `..` then `.`), as the docs write elisions."""
    start = token.start_pos
    return str(token) == ".." and isinstance(start, int) and text[start:start + 3] == "..."


def _misspelt_section_word(stack: list, expected: set[str]) -> Optional[str]:
    """The section keyword a name just taken as a call's node most likely misspells (`lop`,
    `paralel`: the parser then wants the call's `(`), or None."""
    if expected != {"LPAR"} or not stack or not _is_name(stack[-1]):
        return None
    if len(stack) >= 2 and isinstance(stack[-2], Token) and stack[-2].type.lstrip("_") == "SUBMODEL":
        return None
    close = difflib.get_close_matches(str(stack[-1]), _SECTION_WORDS, n=1, cutoff=0.6)
    return close[0] if close else None


def _normalised(token: Token) -> Token:
    """The token with the `_` of filtered keyword terminals dropped from its type."""
    if token.type.startswith("_") and token.type != "$END":
        return Token.new_borrow_pos(token.type.lstrip("_"), token.value, token)
    return token


def _accepted(error: UnexpectedToken) -> set[str]:
    """The terminals the parser could take at the error: Lark's own list when the lexer failed
    leaves out the end of input, so ask the parser state itself when it is there."""
    parser = getattr(error, "interactive_parser", None)
    if parser is not None:
        try:
            return set(parser.accepts())
        except Exception:  # a failed probe only costs the better list, never the diagnostic
            pass
    return set(error.expected or ())


def _value_stack(error: UnexpectedToken) -> list:
    parser = getattr(error, "interactive_parser", None)
    state = getattr(parser, "parser_state", None)
    return list(getattr(state, "value_stack", None) or [])


def _last_token(stack: list, type_name: str) -> Optional[Token]:
    for item in reversed(stack):
        if isinstance(item, Token) and item.type.lstrip("_") == type_name:
            return item
    return None


def _last_keyword(stack: list, keywords: set[str]) -> Optional[str]:
    for item in reversed(stack):
        if isinstance(item, Token) and item.type.lstrip("_") in keywords:
            return item.type.lstrip("_")
        if isinstance(item, Tree):
            return None
    return None


def _previous_token(stack: list) -> Optional[Token]:
    """The last token the parser took before the error."""
    for item in reversed(stack):
        if isinstance(item, Token):
            return item
        if isinstance(item, Tree):
            found = _final_token(item)
            if found is not None:
                return found
    return None


def _is_keyword(item, keywords: set[str]) -> bool:
    return isinstance(item, Token) and item.type.lstrip("_") in keywords


def _is_name(item) -> bool:
    return isinstance(item, Token) and item.type == "NAME"


def _stray_flag(stack: list) -> Optional[Token]:
    """A name just after an edge, on the edge's own line: most likely a misspelt edge flag.

    The parser took it as the start of a new call, so the stack ends with [.., call, NAME].
    """
    if len(stack) < 2 or not _is_name(stack[-1]):
        return None
    previous = stack[-2]
    # Lark keeps a run of sections in a helper tree (`__walk_star_3`): look at its last section.
    while isinstance(previous, Tree) and previous.data.startswith("__") and previous.children:
        previous = previous.children[-1]
    if not isinstance(previous, Tree) or previous.data != "call" or not previous.children:
        return None
    last = previous.children[-1]
    if not isinstance(last, Tree) or last.data != "edge":
        return None
    edge_end = _final_token(last)
    return stack[-1] if edge_end is not None and edge_end.end_line == stack[-1].line else None


def _final_token(tree: Tree) -> Optional[Token]:
    for child in reversed(tree.children):
        if isinstance(child, Token):
            return child
        if isinstance(child, Tree):
            found = _final_token(child)
            if found is not None:
                return found
    return None


def _token_span(token: Token, file: str) -> ast.Span:
    line = token.line or 1
    col = token.column or 1
    end_line = token.end_line or line
    end_col = token.end_column or col + 1
    if end_line == line and end_col <= col:
        end_col = col + 1
    return ast.Span(file=file, line=line, col=col, end_line=end_line, end_col=end_col)


def _end_span(text: str, file: str, line_offset: int = 0) -> ast.Span:
    """The place just after the last character that is not blank or a comment."""
    lines = text.split("\n")  # lines as Lark counts them
    for index in range(len(lines) - 1, -1, -1):
        content = lines[index].split("#", 1)[0].rstrip()
        if content:
            col = len(content) + 1
            line = line_offset + index + 1
            return ast.Span(file=file, line=line, col=col, end_line=line, end_col=col + 1)
    return ast.Span(file=file, line=line_offset + 1, col=1, end_line=line_offset + 1, end_col=2)


def shift_tokens(values, num_lines: int, seen: set[int]) -> None:
    """Move every token in `values` (tokens and trees, recursively) down by `num_lines` lines;
    `seen` holds the ids of tokens already moved, so a shared token moves once."""
    stack = list(values)
    while stack:
        value = stack.pop()
        if isinstance(value, Tree):
            stack.extend(value.children)
        elif isinstance(value, Token) and id(value) not in seen:
            seen.add(id(value))
            if isinstance(value.line, int):
                value.line += num_lines
            if isinstance(value.end_line, int):
                value.end_line += num_lines


def _shift_error(error: UnexpectedInput, num_lines: int) -> None:
    """The error's line, its token and the parser's value stack, moved down by `num_lines`."""
    if isinstance(getattr(error, "line", None), int):
        error.line += num_lines
    seen: set[int] = set()
    token = getattr(error, "token", None)
    shift_tokens([token] if token is not None else [], num_lines, seen)
    shift_tokens(_value_stack(error) if isinstance(error, UnexpectedToken) else [], num_lines, seen)


def _short(text: str) -> str:
    return text if len(text) <= 30 else text[:27] + "..."


def _show_char(char: str) -> str:
    if char.isprintable() and char not in "` ":
        return f"`{char}`"
    return f"U+{ord(char):04X} {char!r}"
