"""Version numbers the docs quote are the code's: docs/cli.md's `--version` line, docs/plan.md's
version messages and header example (they read 3, 10 and 7 while the schema was at 12)."""
import re
from pathlib import Path

import pytest

from mstar.plan.schema import COMPILER_VERSION, SCHEMA_VERSION

DOCS = Path(__file__).parents[2] / "docs"


@pytest.mark.parametrize("doc, pattern, version", [
    ("cli.md", r"plan schema (\d+)\)", str(SCHEMA_VERSION)),
    ("plan.md", r"this mstar reads version (\d+)", str(SCHEMA_VERSION)),
    ("plan.md", r'"schema_version": (\d+)', str(SCHEMA_VERSION)),
    ("cli.md", r"\(compiler (\d+\.\d+\.\d+), plan schema", COMPILER_VERSION),
    ("plan.md", r"this is mstarc (\d+\.\d+\.\d+); recompile", COMPILER_VERSION),
    ("plan.md", r'"compiler_version": "(\d+\.\d+\.\d+)"', COMPILER_VERSION),
])
def test_the_docs_quote_the_plan_schema_and_compiler_versions(doc, pattern, version):
    quoted = re.findall(pattern, (DOCS / doc).read_text(encoding="utf-8"))
    assert quoted, f"docs/{doc} no longer quotes /{pattern}/: update this test"
    assert set(quoted) == {version}, f"docs/{doc} quotes {quoted}, the code is at {version}"


def test_the_header_example_holds_the_orpheus_plans_hashes():
    """docs/plan.md's header excerpt, its hashes cut to 8 digits, is generated/orpheus.plan's (its
    content hash went stale with a compiler version bump)."""
    import json

    header = json.loads((DOCS.parent / "generated" / "orpheus.plan").read_text())["header"]
    text = (DOCS / "plan.md").read_text(encoding="utf-8")
    shown = dict(re.findall(r'"(content_sha256|deployment|glue|spec)": "([0-9a-f]{8})\.\.\."', text))
    actual = {"content_sha256": header["content_sha256"], **header["hashes"]}
    assert shown == {key: value[:8] for key, value in actual.items()}
