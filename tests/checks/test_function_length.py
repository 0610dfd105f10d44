"""No function in mstar/runtime is longer than MAX_LINES lines (DESIGN.md: small parts with one job).

Measured with ast from the `def` line to the function's last line, docstring and comments
included. A long function is split into named helpers, each with one job; the message names
every offender so the fix is plain.
"""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
RUNTIME = ROOT / "mstar" / "runtime"
MAX_LINES = 60


def long_functions(folder: Path) -> list[str]:
    found = []
    for path in sorted(folder.rglob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                num_lines = node.end_lineno - node.lineno + 1
                if num_lines > MAX_LINES:
                    where = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path.name
                    found.append(f"{where}:{node.lineno} {node.name} has {num_lines} lines")
    return found


def test_no_runtime_function_is_over_the_limit():
    found = long_functions(RUNTIME)
    assert not found, (
        f"functions in mstar/runtime must be at most {MAX_LINES} lines (split them into helpers with one "
        "job each):\n  " + "\n  ".join(found)
    )


def test_the_check_finds_a_long_function(tmp_path):
    body = "\n".join(f"    x{i} = {i}" for i in range(MAX_LINES))
    (tmp_path / "long.py").write_text(f"def too_long():\n{body}\n", encoding="utf-8")
    (tmp_path / "short.py").write_text("def short():\n    return 1\n", encoding="utf-8")
    found = long_functions(tmp_path)
    assert len(found) == 1 and "too_long has 61 lines" in found[0]
