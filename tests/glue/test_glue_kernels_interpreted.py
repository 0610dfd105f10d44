"""The generated kernels equal the torch references, under Triton's interpreter on the CPU, and
every glue kernel the cases launched compiles for an sm_90 GPU (on the CPU: the interpreter runs
what Triton's compiler may refuse; tests/interpreter_child.py).

The cases live in interpreted_cases.py and run in a child pytest: TRITON_INTERPRET=1 must be
set before triton is first imported, and setting it in this process would also turn every
later GPU test of the session into an interpreted one.
"""
from importlib.metadata import version
from pathlib import Path

import pytest

from interpreter_child import run_child

HERE = Path(__file__).resolve().parent


# Triton 3.6's interpreter refuses a loop bound computed inside the kernel (a row's token count);
# 3.9 takes it. Compiled kernels run on both (checked on an H200 with 3.6).
INTERPRETER_VERSION = (3, 9)


@pytest.mark.skipif(tuple(int(part) for part in version("triton").split(".")[:2]) < INTERPRETER_VERSION,
                    reason=f"Triton's interpreter before {INTERPRETER_VERSION} cannot run the glue kernels")
def test_kernels_match_reference_under_interpreter():
    # All cases skip when the interpreter is off, so a count of passed cases proves it was on.
    run_child(str(HERE / "interpreted_cases.py"), "7 passed")
