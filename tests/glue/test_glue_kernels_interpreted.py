"""The generated kernels equal the torch references, under Triton's interpreter on the CPU.

The cases live in interpreted_cases.py and run in a child pytest: TRITON_INTERPRET=1 must be
set before triton is first imported, and setting it in this process would also turn every
later GPU test of the session into an interpreted one.
"""
import os
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent


def test_kernels_match_reference_under_interpreter():
    env = dict(os.environ, TRITON_INTERPRET="1")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(HERE.parents[1]), env.get("PYTHONPATH")]))
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--rootdir", str(HERE.parents[1]),
         str(HERE / "interpreted_cases.py")],
        cwd=HERE.parents[1], env=env, capture_output=True, text=True, timeout=600,
    )
    assert result.returncode == 0, result.stdout[-8000:] + result.stderr[-4000:]
    # All cases skip when the interpreter is off, so passing cases prove it was on.
    assert " passed" in result.stdout, result.stdout[-4000:]
