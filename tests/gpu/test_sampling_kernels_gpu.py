"""The device sampler's Triton draws (`engine/gpu/sampling_kernels.py`) on a CUDA GPU: the torch
sampler's tokens from the same logits, and `mstar bench sampler`'s figures. Skipped without a GPU."""
import pytest
import torch

from mstar.runtime.engine.gpu import bench_sampler, sampler

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


@pytest.mark.parametrize("is_whole, nucleus", [(True, None), (False, "sort"), (False, "search")])
def test_the_kernels_draw_the_torch_samplers_tokens(is_whole, nucleus):
    """The whole draw and a nucleus by torch's sort give the torch sampler's tokens (the same noise);
    a nucleus by search (fp32 logits: no ties, whose edge the two keep differently) on all but a
    rounding's few."""
    gen = torch.Generator().manual_seed(0)
    rows = 64
    logits = (torch.randn(rows, 128256, generator=gen) * 3).cuda()
    logits = logits if nucleus == "search" else logits.to(torch.bfloat16)
    temperature = torch.linspace(0.0, 1.5, rows).cuda()  # row 0 greedy
    top_p = torch.ones(rows).cuda() if is_whole else torch.linspace(0.2, 1.0, rows).cuda()
    top_k = None if is_whole else torch.arange(rows).cuda() % 7 * 10
    seeds, counters = torch.arange(rows).cuda() * 31 - 5, torch.arange(rows).cuda() * 3
    expected = sampler.sample(logits, temperature, top_p, seeds, counters, top_k, is_whole=is_whole, is_fused=False)
    got = sampler.sample(logits, temperature, top_p, seeds, counters, top_k, is_whole=is_whole, is_fused=True,
                         nucleus=nucleus)
    num_same = int((got == expected).sum())
    assert num_same >= rows - 2 if nucleus == "search" else num_same == rows, num_same


def test_the_sampler_bench_times_both_variants():
    result = bench_sampler.run(128256, [1, 64], iters=3, device=torch.device("cuda"))
    assert result["has_kernels"]
    for case in result["rows"].values():
        for kind in bench_sampler.KINDS:
            assert case[kind]["fused_us"] > 0 and case[kind]["fused_same_rows"] == 1.0, (kind, case)
            assert kind == "temperature" or case[kind]["search_same_rows"] >= 0.9, (kind, case)
    assert "ratio" in bench_sampler.table(result)


@pytest.mark.parametrize("nucleus", ["sort", "search"])
def test_top_p_applies_to_the_top_ks_renormalised_mass(nucleus):
    """Probabilities 0.4, 0.35, 0.25: top_k 2 then top_p 0.5 keeps the first token alone (0.4 is past
    0.5 of the top two's 0.75), top_p 0.6 the first two; rows without a top_k beside them keep top_p
    0.5 of the whole row (the first two)."""
    row = torch.full((128256,), -1e4)
    row[[5, 70000, 128255]] = torch.log(torch.tensor([0.4, 0.35, 0.25]))
    n = 64
    logits, ones = row.repeat(n, 1).cuda(), torch.ones(n).cuda()
    seeds, counters = torch.full((n,), 11).cuda(), torch.arange(n).cuda()
    top_k = torch.tensor([2, 0] * (n // 2)).cuda()
    for top_p, kept_with_k, kept_without in ((0.5, {5}, {5, 70000}), (0.6, {5, 70000}, {5, 70000})):
        drawn = sampler.sample(logits, ones, ones * top_p, seeds, counters, top_k, is_fused=True, nucleus=nucleus,
                               has_both=True)
        assert set(drawn[0::2].tolist()) == kept_with_k and set(drawn[1::2].tolist()) == kept_without, top_p
