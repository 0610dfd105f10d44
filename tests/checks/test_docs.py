"""docs/diagnostics.md documents every diagnostic code."""
import re
from pathlib import Path

from mstar.compiler import codes as compiler_codes
from mstar.compiler.driver import MW500
from mstar.lang import codes as lang_codes

DOC = Path(__file__).parents[2] / "docs" / "diagnostics.md"


def test_every_code_has_a_section():
    documented = set(re.findall(r"^### (MW\d{3}):", DOC.read_text(encoding="utf-8"), re.MULTILINE))
    expected = set(lang_codes.TITLES) | set(compiler_codes.TITLES) | {MW500}
    assert expected - documented == set()
