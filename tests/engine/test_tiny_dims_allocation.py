"""A plan whose dims tiny mode does not shrink (a gated delta-net's conv kernel of 2**31 - 1, within
mstarc's bound on a dim) asks the torch engine for more memory than the machine holds: a start-up
refusal naming the node (EngineError), where it was an internal error from torch's allocator.
Run in a child process under an address-space limit, so the allocation fails on any machine
(with memory overcommitted, a lazily granted 824 GB would be written by the initialisation)."""
from __future__ import annotations

import resource
import subprocess
import sys
from pathlib import Path

import pytest

from mstar.runtime.engine.runners.values import is_out_of_memory

ROOT = Path(__file__).resolve().parents[2]
CHILD = """
import json, sys
from mstar.plan.schema import Plan
from mstar.runtime.engine.torch_engine import EngineError, TorchEngine
data = json.loads(open(sys.argv[1]).read())
next(n for n in data["nodes"] if n["name"] == "LLM")["dims"]["conv_kernel"] = 2**31 - 1
try:
    TorchEngine(Plan.model_validate(data))
except EngineError as error:
    print("refused:", error)
"""


def _limited() -> None:
    resource.setrlimit(resource.RLIMIT_AS, (6 * 2**30, 6 * 2**30))


def test_a_model_past_the_machine_at_tiny_dims_is_a_start_up_refusal():
    done = subprocess.run([sys.executable, "-c", CHILD, str(ROOT / "generated" / "qwen3_5.plan")], cwd=ROOT,
                          capture_output=True, text=True, timeout=120, preexec_fn=_limited)
    assert done.returncode == 0 and "Traceback" not in done.stderr, done.stderr[-2000:]
    assert done.stdout.startswith("refused: node LLM: its model cannot be allocated at tiny dims"), done.stdout


@pytest.mark.parametrize("error, expected", [
    (MemoryError(), True),
    (RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to allocate 8 bytes"), True),
    (RuntimeError("Storage size calculation overflowed with sizes=[4611686018427387904]"), True),
    (RuntimeError("mat1 and mat2 shapes cannot be multiplied"), False),  # a bug stays a bug
    (ValueError("can't allocate memory"), False),
])
def test_what_counts_as_out_of_memory(error, expected):
    assert is_out_of_memory(error) is expected
