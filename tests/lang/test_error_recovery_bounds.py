"""Syntax-error recovery stays linear in the file's size and stops after MAX_SYNTAX_ERRORS
(issue 15, point 6: 32,000 broken `param` lines, 470 KB, took 90 s).

Time is not measured here (that is for benchmarks); the tests count what grows: the characters
handed to Lark over a whole recovery, and the number of errors reported.
"""
from __future__ import annotations

from mstar.lang import parser
from mstar.lang.diagnostics import Diagnostics


class _CountingLark:
    """Lark's parser, counting the characters it is asked to parse."""

    def __init__(self, lark):
        self._lark = lark
        self.num_chars = 0

    def parse(self, text, **kwargs):
        self.num_chars += len(text)
        return self._lark.parse(text, **kwargs)

    def __getattr__(self, name):
        return getattr(self._lark, name)


def _parse_counting(monkeypatch, text: str) -> tuple[Diagnostics, _CountingLark]:
    counting = _CountingLark(parser._lark())
    monkeypatch.setattr(parser, "_lark", lambda: counting)
    diags = Diagnostics()
    assert parser.parse(text, "big.mw", diags) is None
    return diags, counting


def test_recovery_reads_each_character_a_bounded_number_of_times(monkeypatch):
    lines = ["model m"] + [f"param p{i} = {i}" for i in range(3000)] + ["param broken = = 3"]
    text = "\n".join(lines) + "\n"
    diags, counting = _parse_counting(monkeypatch, text)
    (error,) = diags.items
    assert error.span.line == len(lines)
    # The whole-file parse, then each declaration once: never the text before it again.
    assert counting.num_chars <= 2 * len(text)


def test_recovery_stops_after_max_errors(monkeypatch):
    lines = ["model m"] + [f"param p{i} = = 3" for i in range(5000)]
    diags, counting = _parse_counting(monkeypatch, "\n".join(lines) + "\n")
    assert len(diags.items) == parser.MAX_SYNTAX_ERRORS
    assert [d.span.line for d in diags.items] == list(range(2, parser.MAX_SYNTAX_ERRORS + 2))
    assert "stops after" in diags.items[-1].notes[-1].message
    assert "stops after" in diags.render()


def test_errors_in_later_declarations_name_lines_of_the_file():
    text = "model m\n\nparam a = = 1\n\n\nwalk w\n    LLM(x)\n}\nnode N kv( {\n"
    diags = Diagnostics()
    assert parser.parse(text, "f.mw", diags) is None
    rendered = diags.render()
    assert [d.span.line for d in diags.sorted()] == [3, 7, 9]
    assert "missing `{` at the end of line 6" in rendered
