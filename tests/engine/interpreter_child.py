"""A test file of Triton kernels runs its kernel cases in a child pytest of itself with
TRITON_INTERPRET=1: Triton reads the variable when it first decorates its own library, and setting
it in this process would turn every later GPU test of the session into an interpreted one."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

IS_CHILD = os.environ.get("TRITON_INTERPRET") == "1"
# For the parent's one test that runs the child: skipped inside the child itself.
parent_only = pytest.mark.skipif(IS_CHILD, reason="this is the interpreter's process")


def skip_unless_child(test_name: str) -> None:
    """Skip a kernel case outside the child (the parent's `test_name` runs it there)."""
    if not IS_CHILD:
        pytest.skip(f"runs in the interpreter's own process ({test_name})")


def run_child(test_file: str, expected: str) -> None:
    """Run `test_file` under the interpreter; it must pass with `expected` in its summary (a count
    of passed cases, so cases that all skipped would not pass for run)."""
    env = dict(os.environ, TRITON_INTERPRET="1")
    result = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", test_file],
                            env=env, capture_output=True, text=True, cwd=Path(test_file).parent)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    assert expected in result.stdout, result.stdout[-2000:]
