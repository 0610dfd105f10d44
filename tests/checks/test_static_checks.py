"""Static checks as part of the test suite (so `.ci/run`, which runs exactly the README's test
command, enforces them): `ruff check` and `mypy`, each configured in pyproject.toml (what they
cover and which rules), run from the repository root with this interpreter. Any finding fails the
test with the tool's own report. mypy keeps its incremental cache in `.mypy_cache/` (ignored by
git): a warm run takes seconds, a cold one about a minute."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("tool", [["ruff", "check"], ["mypy"]], ids=["ruff", "mypy"])
def test_static_check_reports_nothing(tool):
    done = subprocess.run([sys.executable, "-m", *tool], cwd=ROOT, capture_output=True, text=True)
    report = (done.stdout + done.stderr).strip()
    assert done.returncode == 0, f"`{' '.join(tool)}` found problems:\n{report}"
