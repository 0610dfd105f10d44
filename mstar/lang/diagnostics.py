"""Diagnostics: codes, spans, collection and rendering (as mypy does them).

Every error is tied to a span; a pass adds diagnostics to a `Diagnostics` collection and goes
on, so one run shows every error. Rendering:

    specs/orpheus.mw:12:5: error[MW204]: message
       12 |     cap prefill 16
          |     ^^^^^^^^^^^^^^
    specs/orpheus.mw:8:1: note: secondary message
        8 | node LLM kv(...)
          | ^^^^

Codes and their one-line titles live in `mstar/lang/codes.py` (the registry); docs/diagnostics.md
documents each one.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, Optional

from mstar.arg_types import shown_path
from mstar.lang.ast import Span

Severity = Literal["error", "warning", "note"]

# Source lines longer than this are shown as a window around the error's column.
MAX_EXCERPT_CHARS = 160


@dataclass(frozen=True)
class Note:
    message: str
    span: Optional[Span] = None


@dataclass(frozen=True)
class Diagnostic:
    code: str
    message: str
    span: Span
    severity: Severity = "error"
    notes: tuple[Note, ...] = ()

    def sort_key(self) -> tuple:
        return (self.span.file, self.span.line, self.span.col, self.code, self.message)


@dataclass
class Diagnostics:
    """A collection of diagnostics from one run; sources are kept to render source lines."""

    items: list[Diagnostic] = field(default_factory=list)
    sources: dict[str, str] = field(default_factory=dict)

    def add_source(self, file: str, text: str) -> None:
        self.sources[file] = text

    def error(self, code: str, message: str, span: Span, *notes: Note) -> None:
        self.items.append(Diagnostic(code, message, span, "error", tuple(notes)))

    def warning(self, code: str, message: str, span: Span, *notes: Note) -> None:
        self.items.append(Diagnostic(code, message, span, "warning", tuple(notes)))

    @property
    def has_errors(self) -> bool:
        return any(d.severity == "error" for d in self.items)

    def sorted(self) -> list[Diagnostic]:
        return sorted(set(self.items), key=Diagnostic.sort_key)

    def render(self) -> str:
        lines_by_file: dict[str, list[str]] = {}  # each source split once, however many diagnostics
        return "".join(render_diagnostic(d, self.sources, lines_by_file) for d in self.sorted())


def _source_excerpt(span: Span, sources: dict[str, str], lines_by_file: dict[str, list[str]]) -> str:
    lines = lines_by_file.get(span.file)
    if lines is None:
        text = sources.get(span.file)
        if text is None:
            return ""
        # Lark counts lines by \n only; splitlines() would also break on \f and \u2028.
        lines = lines_by_file[span.file] = text.split("\n")
    if not 1 <= span.line <= len(lines):
        return ""
    line_text = lines[span.line - 1].rstrip("\n")
    col = span.col
    end_col = span.end_col if span.end_line == span.line else len(line_text) + 1
    if len(line_text) > MAX_EXCERPT_CHARS:
        # A very long line (a minified file): show a window around the column, not the line.
        start = max(0, min(col - 1 - MAX_EXCERPT_CHARS // 2, len(line_text) - MAX_EXCERPT_CHARS))
        before = "..." if start > 0 else ""
        after = "..." if start + MAX_EXCERPT_CHARS < len(line_text) else ""
        line_text = before + line_text[start:start + MAX_EXCERPT_CHARS] + after
        shift = len(before) - start
        col, end_col = col + shift, min(end_col + shift, len(before) + MAX_EXCERPT_CHARS + 1)
    gutter = f"{span.line:>5}"
    width = max(1, end_col - col)
    underline = " " * (col - 1) + "^" * width
    pad = " " * len(gutter)
    return f"{gutter} | {line_text}\n{pad} | {underline}\n"


def render_diagnostic(diag: Diagnostic, sources: dict[str, str],
                      lines_by_file: Optional[dict[str, list[str]]] = None) -> str:
    """One diagnostic with its source lines; `lines_by_file` caches the split sources across calls."""
    lines_by_file = {} if lines_by_file is None else lines_by_file
    s = diag.span
    out = [f"{shown_path(s.file)}:{s.line}:{s.col}: {diag.severity}[{diag.code}]: {diag.message}\n"]
    out.append(_source_excerpt(s, sources, lines_by_file))
    for note in diag.notes:
        if note.span is None:
            out.append(f"    note: {note.message}\n")
        else:
            n = note.span
            out.append(f"{shown_path(n.file)}:{n.line}:{n.col}: note: {note.message}\n")
            out.append(_source_excerpt(n, sources, lines_by_file))
    return "".join(out)


class CompileError(Exception):
    """Raised by the driver when a pass leaves errors; carries the whole collection."""

    def __init__(self, diagnostics: Diagnostics):
        super().__init__(diagnostics.render())
        self.diagnostics = diagnostics
