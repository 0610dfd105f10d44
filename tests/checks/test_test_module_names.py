"""Every module under tests/ has a name of its own. The test folders are no packages, so pytest
imports each test file, and each helper module it imports, by its file name alone: a second
`test_batching_rules.py` in another folder stopped a fresh clone's collection ("import file
mismatch") only once CI ran, though each file passed where it was written."""
from __future__ import annotations

from collections import defaultdict
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]
SHARED_NAMES = {"conftest.py", "__init__.py"}  # pytest loads these per folder, not by name


def test_no_two_test_modules_share_a_name():
    by_name: dict[str, list[str]] = defaultdict(list)
    for path in TESTS.rglob("*.py"):
        if path.name not in SHARED_NAMES and "golden" not in path.relative_to(TESTS).parts:
            by_name[path.name].append(str(path.relative_to(TESTS)))
    assert {name: paths for name, paths in by_name.items() if len(paths) > 1} == {}
