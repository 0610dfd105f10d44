"""Version numbers the docs quote are the code's: docs/cli.md's `--version` line, docs/plan.md's
schema-version message and header example (they read 3, 10 and 7 while the schema was at 12)."""
import re
from pathlib import Path

import pytest

from mstar.plan.schema import SCHEMA_VERSION

DOCS = Path(__file__).parents[2] / "docs"


@pytest.mark.parametrize("doc, pattern", [
    ("cli.md", r"plan schema (\d+)\)"),
    ("plan.md", r"this mstar reads version (\d+)"),
    ("plan.md", r'"schema_version": (\d+)'),
])
def test_the_docs_quote_the_plan_schema_version(doc, pattern):
    quoted = re.findall(pattern, (DOCS / doc).read_text(encoding="utf-8"))
    assert quoted, f"docs/{doc} no longer quotes /{pattern}/: update this test"
    assert set(quoted) == {str(SCHEMA_VERSION)}, (
        f"docs/{doc} quotes schema version {quoted}, the code is at {SCHEMA_VERSION}")
