"""The generated kernels equal the torch references on a CUDA GPU (compiled, not interpreted)."""
import pytest
import torch

import glue_cases
from glue_modules import key_glues, sample_generated_glue_files, tiny_glue_module

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
    from mstar.runtime.engine.glue_loader import load_glue

    for key_glue in key_glues(load_glue(path)):
        for seed in range(8):
            glue_cases.compare_pack(key_glue, seed, "cuda")
            glue_cases.compare_scatter(key_glue, seed, "cuda")
