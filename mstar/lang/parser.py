"""Parse `.mw` source text into a `Spec` AST, reporting syntax errors as MW0xx diagnostics.

    parse(text, file, diags) -> Spec | None

Never raises on any input text: syntax errors, numbers out of range and even unexpected failures
inside Lark become diagnostics, and the result is None when any error was added.

Error collection: the whole file is parsed once. When that fails, the file is cut into its
top-level declarations (lines starting at column 1 with `model`, `param`, `node`, `walk` or
`partition`) and each one is parsed alone, so one run reports the first syntax error of every
broken declaration (at most one error per declaration, at most MAX_SYNTAX_ERRORS in all). The
recovery is linear in the file's size.

Comments: after a successful parse, mstar/lang/comments.py attaches every `#` comment to the
construct it belongs to (the AST's comment fields), so that the formatter can write them back.

Cache: the Lark parser (LALR(1), contextual lexer) is built once per process, on first use, and
kept by `lru_cache`; between processes mstar/lang/grammar_cache.py keeps the built tables in a
private per-user folder (never Lark's own `cache=True`, which unpickles a file from the shared
temp folder).
"""
from __future__ import annotations

import re
from functools import lru_cache
from pathlib import Path
from typing import Optional

from lark import Lark
from lark.exceptions import UnexpectedInput, VisitError
from lark.lexer import PatternStr

from mstar.lang import ast
from mstar.lang import codes
from mstar.lang.build import AstBuilder
from mstar.lang.comments import attach_comments
from mstar.lang.diagnostics import Diagnostics, Note
from mstar.lang.grammar_cache import load_or_build
from mstar.lang.syntax_errors import ErrorExplainer, shift_tokens

GRAMMAR_PATH = Path(__file__).resolve().parents[2] / "grammar" / "mw.lark"

# Blocks nest at most this deep: every later pass walks the tree recursively, and no real walk
# comes near it.
MAX_NESTING = 100
# Error recovery stops after this many syntax errors: a file that broken is fixed from the top,
# and reporting all of them would only cost time.
MAX_SYNTAX_ERRORS = 100
_BRACE_OR_SKIPPED = re.compile(r'#[^\n]*|"(?:[^"\\\n]|\\.)*"|[{}]')
# A line that starts a top-level declaration: where error recovery cuts the file.
_DECLARATION_START = re.compile(r"^(model|param|node|walk|partition)\b", re.MULTILINE)
# A keyword terminal of the grammar: a word ending at a word boundary.
_KEYWORD_PATTERN = re.compile(r"^([a-z_]+)\\b$")


_LARK_OPTIONS = dict(
    start=["spec", "chunk"],
    parser="lalr",
    lexer="contextual",
    keep_all_tokens=True,  # the builder computes spans from every token (see build.py)
    maybe_placeholders=True,
)


@lru_cache(maxsize=1)
def _lark() -> Lark:
    """The parser, built once per process (see the module docstring on caching)."""
    grammar = GRAMMAR_PATH.read_text(encoding="utf-8")
    return load_or_build(grammar, _LARK_OPTIONS, lambda: Lark(grammar, **_LARK_OPTIONS))


@lru_cache(maxsize=1)
def _explainer() -> ErrorExplainer:
    """The error explainer of this grammar, given each terminal's literal text (None for regexes)."""
    terminals: dict[str, Optional[str]] = {}
    for terminal in _lark().terminals:
        keyword = _KEYWORD_PATTERN.match(terminal.pattern.value)
        if isinstance(terminal.pattern, PatternStr):
            text: Optional[str] = terminal.pattern.value
        elif keyword is not None:
            text = keyword.group(1)
        else:
            text = None
        terminals[terminal.name.lstrip("_")] = text
    return ErrorExplainer(terminals)


def keywords() -> frozenset[str]:
    """The words of the language (`node`, `stream`, `client`, ...).

    A keyword is read as a keyword wherever the grammar allows one, and as a name where only a
    name may stand; a declaration named like a keyword may therefore not be usable everywhere.
    """
    return frozenset(text for text in _explainer().terminals.values() if text and text.isidentifier())


def parse(text: str, file: str, diags: Diagnostics) -> Optional[ast.Spec]:
    """Parse one spec. Adds the source to `diags`; on any error adds diagnostics and returns None."""
    diags.add_source(file, text)
    num_errors_before = _num_errors(diags)
    try:
        spec = _parse_checked(text, file, diags)
    except Exception as error:  # a bug in the parser or Lark must not become a traceback
        diags.error(codes.INTERNAL_PARSER_ERROR,
                    f"internal parser error ({type(error).__name__}: {_first_line(error)}); "
                    f"please report it with this spec",
                    ast.Span(file=file, line=1, col=1, end_line=1, end_col=2))
        return None
    if spec is None or _num_errors(diags) > num_errors_before:
        return None
    return spec


def _parse_checked(text: str, file: str, diags: Diagnostics) -> Optional[ast.Spec]:
    try:
        tree = _lark().parse(text, start="spec")
    except UnexpectedInput as error:
        _report_by_declaration(text, file, diags, error)
        return None
    if _reports_deep_nesting(text, file, diags):
        return None
    builder = AstBuilder(file, diags)
    spec = _build(tree, builder)
    attach_comments(spec, text, builder.anchors)
    return spec


def _reports_deep_nesting(text: str, file: str, diags: Diagnostics) -> bool:
    """Adds MW024 and says True when blocks nest deeper than MAX_NESTING."""
    too_deep = _first_brace_too_deep(text)
    if too_deep is None:
        return False
    diags.error(codes.NESTING_TOO_DEEP, _too_deep_message(), _point_span(file, *too_deep))
    return True


def _too_deep_message() -> str:
    return f"blocks are nested more than {MAX_NESTING} levels deep here; flatten the walk"


def _point_span(file: str, line: int, col: int) -> ast.Span:
    return ast.Span(file=file, line=line, col=col, end_line=line, end_col=col + 1)


def _first_brace_too_deep(text: str) -> Optional[tuple[int, int]]:
    """(line, col) of the first `{` deeper than MAX_NESTING, outside comments and strings."""
    depth = 0
    for match in _BRACE_OR_SKIPPED.finditer(text):
        brace = match.group()
        if brace == "{":
            depth += 1
            if depth > MAX_NESTING:
                line = text.count("\n", 0, match.start()) + 1
                return line, match.start() - (text.rfind("\n", 0, match.start()) + 1) + 1
        elif brace == "}":
            depth -= 1
    return None


def _build(tree, builder: AstBuilder):
    try:
        return builder.transform(tree)
    except VisitError as error:
        raise error.orig_exc from error


def _report_by_declaration(text: str, file: str, diags: Diagnostics, whole_error: UnexpectedInput) -> None:
    """Re-parse each top-level declaration alone and report the first error of each, stopping
    after MAX_SYNTAX_ERRORS.

    Linear in the file's size: each declaration is parsed on its own text and its tokens'
    lines are moved down afterwards (padding it with the newlines before it made the whole
    recovery quadratic), and which declaration is the last one is found once.
    """
    explainer = _explainer()
    num_reported = 0
    starts = [m.start() for m in _DECLARATION_START.finditer(text)]
    bounds = [0] + starts + [len(text)]
    pieces = [text[begin:end] for begin, end in zip(bounds, bounds[1:])]
    last_filled = max((i for i, piece in enumerate(pieces) if not _is_blank(piece)), default=-1)
    models_seen = 0
    num_lines_before = 0
    for index, piece in enumerate(pieces):
        line_offset = num_lines_before
        num_lines_before += piece.count("\n")
        if index > last_filled:
            break
        if _is_blank(piece):
            continue
        start = _DECLARATION_START.match(piece)
        if start is not None and start.group(1) == "model":
            models_seen += 1
        problems: list[tuple[str, str, ast.Span, tuple]] = []
        try:
            tree = _lark().parse(piece, start="chunk")
        except UnexpectedInput as error:
            problem = explainer.explain(error, piece, file, is_declaration=True,
                                        is_last=index == last_filled, line_offset=line_offset)
            problems.append((problem.code, problem.message, problem.span, problem.notes))
        else:
            too_deep = _first_brace_too_deep(piece)
            if too_deep is not None:
                line, col = too_deep
                problems.append((codes.NESTING_TOO_DEEP, _too_deep_message(),
                                 _point_span(file, line + line_offset, col), ()))
            else:
                shift_tokens([tree], line_offset, set())
                num_reported += _check_model_line(_build(tree, AstBuilder(file, diags)), models_seen,
                                                  num_reported, diags)
        for code, message, span, notes in problems:
            num_reported += 1
            if num_reported >= MAX_SYNTAX_ERRORS and index < last_filled:
                notes += (Note(f"mstarc stops after {MAX_SYNTAX_ERRORS} syntax errors; "
                               "fix these and run it again"),)
            diags.error(code, message, span, *notes)
        if num_reported >= MAX_SYNTAX_ERRORS:
            break
    if num_reported == 0:
        problem = explainer.explain(whole_error, text, file)
        diags.error(problem.code, problem.message, problem.span, *problem.notes)


def _check_model_line(item, models_seen: int, num_reported: int, diags: Diagnostics) -> int:
    """The `model` line's place, for a declaration that parsed alone: one `model` line, first.
    Returns the errors reported (0 or 1); a misplaced first declaration is reported only when
    nothing was reported before it."""
    is_model = not isinstance(item, (ast.Param, ast.NodeDecl, ast.Walk, ast.Partition))
    if is_model and models_seen > 1:
        diags.error(codes.MODEL_LINE, "`model` may appear only once, as the first line of the spec", item.span)
        return 1
    if not is_model and models_seen == 0 and num_reported == 0:
        diags.error(codes.MODEL_LINE, "a spec starts with `model NAME`; this declaration comes first", item.span)
        return 1
    return 0


def _is_blank(text: str) -> bool:
    """Only whitespace and comments (checked line by line: a regex here backtracks badly)."""
    return all(not line.split("#", 1)[0].strip() for line in text.split("\n"))


def _num_errors(diags: Diagnostics) -> int:
    return sum(1 for d in diags.items if d.severity == "error")


def _first_line(error: Exception) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else "no message"
