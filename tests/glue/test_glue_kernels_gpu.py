"""The generated kernels equal the torch references on a CUDA GPU (compiled, not interpreted)."""
import pytest
import torch

import glue_cases
from glue_modules import checked_in_glue, key_glues, sample_generated_glue_files, tiny_glue_module

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


@pytest.mark.parametrize("page_size", [1, 16])
def test_kernels_match_reference_on_gpu(tmp_path, page_size):
    for key_glue in key_glues(tiny_glue_module(tmp_path, page_size)):
        for seed in range(40):
            glue_cases.compare_pack(key_glue, seed, "cuda")
            glue_cases.compare_scatter(key_glue, seed, "cuda")
        torch.cuda.synchronize()


@pytest.mark.parametrize("path", sample_generated_glue_files(), ids=lambda p: p.name)
def test_generated_glue_on_gpu(path):
    for key_glue in key_glues(checked_in_glue(path)):
        for seed in range(8):
            glue_cases.compare_pack(key_glue, seed, "cuda")
            glue_cases.compare_scatter(key_glue, seed, "cuda")


def test_launches_after_the_first_skip_the_jit(tmp_path):
    """`GlueKernel`: the first launch of an argument signature goes through Triton's JIT, later ones
    straight to the compiled variant, and their results still equal the references."""
    module = tiny_glue_module(tmp_path, 16)
    kernel = module._pack_step_llm_mixed_kernel
    jitted, calls = kernel.jitted, []

    class Counting:
        def __getitem__(self, grid):
            calls.append(grid)
            return jitted[grid]

    kernel.jitted = Counting()
    for key_glue in key_glues(module):
        for seed in range(12):
            glue_cases.compare_pack(key_glue, seed, "cuda")
    torch.cuda.synchronize()
    assert 1 <= len(calls) == len(kernel._variants) < 12  # one JIT launch per signature, not per step
