"""editors/mw.tmLanguage.json agrees with the language's own lexer on every spec in specs/.

Each spec is tokenized twice: by the Lark parser's contextual lexer (the tokens the parser really
reads, from `parse_interactive(...).iter_parse()`) and by the TextMate grammar (textmate.py, a
small TextMate engine). Every Lark token must get the scope its kind calls for: a keyword a
keyword (or storage / support.constant) scope, a number a numeric scope, a string a string scope,
an operator an operator scope, punctuation a punctuation scope, and a name none of those (unless
the name is spelled like a keyword, which the contextual lexer allows where only a name can stand
and a regex grammar cannot always tell). Every comment (what Lark skips from a `#`) must be a
comment scope. And every keyword of grammar/mw.lark must be highlighted as one, so a keyword
added to the language without the editor grammar fails here.
"""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from mstar.lang.parser import GRAMMAR_PATH, _lark
from textmate import Tokenizer

ROOT = Path(__file__).resolve().parents[2]
TM_PATH = ROOT / "editors" / "mw.tmLanguage.json"
SPECS = sorted((ROOT / "specs").glob("*.mw"))

KEYWORD_SCOPES = ("keyword.", "storage.", "support.constant.")
NOT_A_NAME = KEYWORD_SCOPES + ("constant.numeric", "string.", "comment.", "punctuation.")
OPERATORS = {"ARROW", "LARROW", "LE", "QMARK", "EQUAL", "PLUS", "VBAR"}
NUMBERS = {"INT", "SIGNED_INT", "SIGNED_FLOAT"}


def _keywords() -> dict[str, str]:
    """Terminal name -> keyword, from grammar/mw.lark's `NAME.2: /word\\b/` lines."""
    text = GRAMMAR_PATH.read_text(encoding="utf-8")
    return dict(re.findall(r"^(_?[A-Z_]+)\.2: /([a-z_]+)\\b/", text, re.MULTILINE))


KEYWORDS = _keywords()


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer(json.loads(TM_PATH.read_text(encoding="utf-8")))


def _expected(token_type: str, text: str) -> tuple[tuple[str, ...], bool]:
    """(scope prefixes, whether the innermost scope must start with one of them (True) or must not)."""
    if token_type in KEYWORDS:
        return KEYWORD_SCOPES, True
    if token_type in NUMBERS:
        return ("constant.numeric",), True
    if token_type == "STRING":
        return ("string.quoted",), True
    if token_type in OPERATORS:
        return ("keyword.operator",), True
    if token_type == "NAME":
        return (NOT_A_NAME, False) if text not in KEYWORDS.values() else (("comment.", "string."), False)
    return ("punctuation.",), True


def _problems(spec: Path, tokenizer: Tokenizer) -> list[str]:
    text = spec.read_text(encoding="utf-8")
    lines = text.split("\n")
    scopes = tokenizer.tokenize(lines)
    problems = []
    covered: set[tuple[int, int]] = set()
    for token in _lark().parse_interactive(text, start="spec").iter_parse():
        if token.type == "$END":
            continue
        line, column = token.line - 1, token.column - 1
        covered.update((line, column + i) for i in range(len(token)))
        innermost = scopes[line][column][-1]
        prefixes, must_match = _expected(token.type, str(token))
        if innermost.startswith(prefixes) != must_match:
            problems.append(f"{spec.name}:{line + 1}:{column + 1}: {token.type} {str(token)!r} got {innermost}")
    for number, line in enumerate(lines):
        for column, char in enumerate(line):
            if char == "#" and (number, column) not in covered:
                if not scopes[number][column][-1].startswith("comment."):
                    problems.append(f"{spec.name}:{number + 1}:{column + 1}: comment got {scopes[number][column]}")
                break
    return problems


def test_every_regex_compiles(tokenizer):
    assert tokenizer.compile_all() > 20


@pytest.mark.parametrize("spec", SPECS, ids=lambda p: p.name)
def test_spec_tokens_get_their_scopes(spec, tokenizer):
    problems = _problems(spec, tokenizer)
    assert not problems, "editors/mw.tmLanguage.json scopes these tokens wrongly:\n" + "\n".join(problems[:40])


def test_every_keyword_of_the_grammar_is_highlighted(tokenizer):
    assert len(KEYWORDS) > 40  # the grammar's keyword lines were found
    missed = {}
    for word in KEYWORDS.values():
        scope = tokenizer.tokenize([word])[0][0][-1]
        if not scope.startswith(KEYWORD_SCOPES):
            missed[word] = scope
    assert not missed, (f"keywords of grammar/mw.lark the TextMate grammar does not highlight: {missed}; add them "
                        "to a keyword rule of editors/mw.tmLanguage.json (repository.keyword)")


def test_the_engine_can_fail(tokenizer):
    """A grammar without its keyword rules misses keywords, and one that scopes names as keywords
    is caught on a spec: the checks above are not vacuous."""
    grammar = json.loads(TM_PATH.read_text(encoding="utf-8"))
    grammar["repository"]["keyword"]["patterns"] = grammar["repository"]["keyword"]["patterns"][:1]
    assert _problems(SPECS[0], Tokenizer(grammar))
    grammar = json.loads(TM_PATH.read_text(encoding="utf-8"))
    grammar["repository"]["call"]["captures"]["1"]["name"] = "keyword.other.call.mw"
    assert any("NAME" in p for p in _problems(ROOT / "specs" / "orpheus.mw", Tokenizer(grammar)))


def test_strings_and_comments_inside_a_line(tokenizer):
    line = 'node N stateless(x="a # b", y=1) # note'
    scopes = [s[-1] for s in tokenizer.tokenize([line])[0]]
    assert scopes[line.index('"a')].startswith("string.") and scopes[line.index("# b")].startswith("string.")
    assert scopes[line.index("# note")].startswith("comment.")
    assert scopes[line.index("1)")].startswith("constant.numeric")
