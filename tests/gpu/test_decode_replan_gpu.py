"""A planned graph-mode decode wrapper's next plan (`attention.replan_graph_decode`, the compiled
planner called directly) schedules every step as FlashInfer's own `fast_decode_plan` does, on the
tensor-core and the CUDA-core kernels, with the KV lengths given or derived (CUDA GPU only)."""
import numpy as np
import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]
PAGE = 16


def _csr(lengths: list[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    pages = [-(-n // PAGE) for n in lengths]
    indptr = torch.tensor(np.concatenate([[0], np.cumsum(pages)]), dtype=torch.int32)
    last = torch.tensor([n - (p - 1) * PAGE for n, p in zip(lengths, pages)], dtype=torch.int32)
    indices = torch.arange(int(indptr[-1]), dtype=torch.int32, device="cuda")
    return indptr, indices, last, torch.tensor(lengths, dtype=torch.int32)


@pytest.mark.parametrize("batch", [1, 4, 16, 64])
def test_replan_schedules_as_fast_decode_plan(batch):
    from flashinfer.decode import fast_decode_plan

    from mstar.runtime.engine.gpu.attention import FlashInferSteps, plan_graph_decode, replan_graph_decode

    steps = FlashInferSteps(torch.device("cuda"), 32, 8, 64, PAGE, 512, [batch], "flashinfer")
    wrapper = steps.decode[batch]
    assert wrapper.use_tensor_cores == steps.is_tensor_decode(batch)
    rng = np.random.default_rng(batch)
    plan_graph_decode(wrapper, True, *_csr([int(n) for n in rng.integers(1, 4000, batch)])[:3], steps.heads, PAGE,
                      steps.sm_scale)
    for trial in range(6):
        lengths = [int(n) for n in rng.integers(1, 8000 if trial % 2 else 300, batch)]
        indptr, indices, last, seq_lens = _csr(lengths)
        fast_decode_plan(wrapper, indptr, indices, last, *steps.heads, PAGE, q_data_type=torch.bfloat16,
                         kv_data_type=torch.bfloat16, sm_scale=steps.sm_scale)
        expected = list(wrapper._plan_info)
        replan_graph_decode(wrapper, indptr, indices, last, steps.heads, PAGE, seq_lens if trial % 3 else None)
        assert list(wrapper._plan_info) == expected
