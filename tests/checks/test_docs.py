"""docs/diagnostics.md documents every diagnostic code and is up to date with the fixtures."""
import re
from pathlib import Path

import make_diagnostics_doc
from mstar.compiler import codes as compiler_codes
from mstar.compiler.driver import MW500, MW501
from mstar.lang import codes as lang_codes

DOC = Path(__file__).parents[2] / "docs" / "diagnostics.md"


def test_every_code_has_a_section():
    documented = set(re.findall(r"^### (MW\d{3}):", DOC.read_text(encoding="utf-8"), re.MULTILINE))
    expected = set(lang_codes.TITLES) | set(compiler_codes.TITLES) | {MW500, MW501}
    assert expected - documented == set()


def test_doc_is_not_stale(monkeypatch):
    monkeypatch.chdir(Path(__file__).parent)
    assert DOC.read_text(encoding="utf-8") == make_diagnostics_doc.build(), (
        "docs/diagnostics.md is stale: run python3 tests/checks/make_diagnostics_doc.py")
