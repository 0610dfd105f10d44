"""Random mutations of the checked-in specs only ever produce diagnostics, never an exception.

Mutations: delete / swap / duplicate lines, delete / duplicate / swap tokens, insert junk
characters. Whatever parse returns, it must not raise, must not report an internal parser error
(MW099), must add at least one error when it returns None, and the diagnostics must render.
"""
import re
from pathlib import Path

from hypothesis import given
from hypothesis import strategies as st

from mstar.lang import codes
from mstar.lang.diagnostics import Diagnostics
from mstar.lang.parser import parse

SPEC_TEXTS = {p.stem: p.read_text() for p in sorted((Path(__file__).resolve().parents[2] / "specs").glob("*.mw"))}
_TOKEN = re.compile(r"\s+|\w+|->|<-|<=|.", re.DOTALL)
JUNK = "{}()[]<>-=+|?.,:#\"\\$@!\t\n0123456789 _xé\u00a0\u2028\x00"


def _lines(text):
    return text.split("\n")


def _tokens(text):
    return _TOKEN.findall(text)


@st.composite
def mutations(draw):
    text = SPEC_TEXTS[draw(st.sampled_from(sorted(SPEC_TEXTS)))]
    for _ in range(draw(st.integers(min_value=1, max_value=3))):
        kind = draw(st.sampled_from(["del_line", "swap_lines", "dup_line", "del_token", "dup_token",
                                     "swap_tokens", "junk"]))
        if kind.endswith("line") or kind.endswith("lines"):
            parts, sep = _lines(text), "\n"
        elif kind == "junk":
            position = draw(st.integers(min_value=0, max_value=len(text)))
            junk = draw(st.text(alphabet=JUNK, min_size=1, max_size=3))
            text = text[:position] + junk + text[position:]
            continue
        else:
            parts, sep = _tokens(text), ""
        if not parts:
            continue
        i = draw(st.integers(min_value=0, max_value=len(parts) - 1))
        j = draw(st.integers(min_value=0, max_value=len(parts) - 1))
        if kind.startswith("del"):
            del parts[i]
        elif kind.startswith("dup"):
            parts.insert(i, parts[i])
        else:
            parts[i], parts[j] = parts[j], parts[i]
        text = sep.join(parts)
    return text


@given(mutations())
def test_mutated_spec_gives_diagnostics_not_exceptions(text):
    diags = Diagnostics()
    spec = parse(text, "mutated.mw", diags)
    assert all(d.code != codes.INTERNAL_PARSER_ERROR for d in diags.items), diags.render()
    if spec is None:
        assert diags.has_errors
    else:
        assert not diags.has_errors
    for diagnostic in diags.items:
        assert re.fullmatch(r"MW0\d\d", diagnostic.code)
        assert diagnostic.span.line >= 1 and diagnostic.span.col >= 1
    diags.render()


@given(st.text(max_size=200))
def test_arbitrary_text_gives_diagnostics_not_exceptions(text):
    diags = Diagnostics()
    spec = parse(text, "noise.mw", diags)
    assert all(d.code != codes.INTERNAL_PARSER_ERROR for d in diags.items), diags.render()
    assert (spec is None) == diags.has_errors
    diags.render()
