"""Kernel-vs-reference cases run under Triton's interpreter on CPU tensors.

Not collected on its own (the name lacks `test_`): test_glue_kernels_interpreted.py runs it in a
fresh `python3 -m pytest` with TRITON_INTERPRET=1 set before triton is first imported, which is
the only way the interpreter takes effect (triton fixes it when its own library is decorated).
"""
import os

import pytest

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                reason="needs TRITON_INTERPRET=1 before triton is imported")

import glue_cases  # noqa: E402
import interpreter_child  # noqa: E402,F401  (records each launch for the parent to compile)
from glue_modules import checked_in_glue, key_glues, sample_generated_glue_files, tiny_glue_module  # noqa: E402

SEEDS = range(8)
# The interpreter runs each program in Python: keep steps small.
MAX_ROWS = 12


@pytest.mark.parametrize("page_size", [1, 4, 16])
def test_pack_step_matches_reference(tmp_path, page_size):
    for key_glue in key_glues(tiny_glue_module(tmp_path, page_size)):
        for seed in SEEDS:
            glue_cases.compare_pack(key_glue, seed, "cpu", MAX_ROWS)


@pytest.mark.parametrize("page_size", [1, 4])
def test_scatter_after_sampling_matches_reference(tmp_path, page_size):
    for key_glue in key_glues(tiny_glue_module(tmp_path, page_size)):
        for seed in SEEDS:
            glue_cases.compare_scatter(key_glue, seed, "cpu", MAX_ROWS)


def test_kernels_are_interpreted(tmp_path):
    import triton.runtime.interpreter as interpreter

    module = tiny_glue_module(tmp_path, 4)
    assert isinstance(module._pack_step_llm_mixed_kernel.jitted, interpreter.InterpretedFunction)
    assert not module._pack_step_llm_mixed_kernel._variants  # interpreted launches keep no compiled variant


@pytest.mark.parametrize("path", sample_generated_glue_files(), ids=lambda p: p.name)
def test_generated_glue_matches_reference(path):
    for key_glue in key_glues(checked_in_glue(path)):
        for seed in range(3):
            glue_cases.compare_pack(key_glue, seed, "cpu", MAX_ROWS)
            glue_cases.compare_scatter(key_glue, seed, "cpu", MAX_ROWS)
