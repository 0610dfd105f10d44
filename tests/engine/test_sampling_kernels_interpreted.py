"""The device sampler's Triton draws (`engine/gpu/sampling_kernels.py`) under the Triton interpreter
on the CPU, against the torch sampler they replace (`sampler.sample(is_fused=False)`): the same
noise bit for bit, the same tokens."""
import pytest
import torch

pytest.importorskip("triton")

from interpreter_child import parent_only, run_child, skip_unless_child  # noqa: E402

from mstar.runtime.engine.gpu import sampler, sampling_kernels  # noqa: E402

SEEDS = torch.tensor([0, 1, -5, 2**62, -(2**63), 2**63 - 1])
COUNTERS = torch.tensor([0, 3, 7, 1, 2**40, 255])


@pytest.fixture
def interpreted():
    skip_unless_child("test_sampling_kernels_under_the_interpreter")
    return sampling_kernels


@parent_only
def test_sampling_kernels_under_the_interpreter():
    """Triton reads TRITON_INTERPRET when it first decorates its own library: this file again, in a
    process with the variable set."""
    run_child(__file__, "8 passed")


@pytest.mark.parametrize("vocab", [1, 2047, 2049, 9000])
def test_the_noise_is_the_torch_samplers_bit_for_bit(interpreted, vocab):
    expected = -torch.log(-torch.log(sampler.hashed_uniform(SEEDS, COUNTERS, vocab))).float()
    assert torch.equal(interpreted.gumbel_noise(SEEDS, COUNTERS, vocab), expected)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_whole_vocabulary_draws_are_the_torch_samplers(interpreted, dtype):
    """Sampled rows at several temperatures beside greedy ones (temperature 0 and one below
    MIN_TEMPERATURE), over three chunks of columns; a second counter gives other draws."""
    gen = torch.Generator().manual_seed(0)
    logits = (torch.randn(len(SEEDS), 9000, generator=gen) * 3).to(dtype)
    temperature = torch.tensor([1.0, 0.0, 0.7, 2.0, 1e-7, 0.3])
    ones = torch.ones(len(SEEDS))
    drawn = []
    for counters in (COUNTERS, COUNTERS + 1):
        expected = sampler.sample(logits, temperature, ones, SEEDS, counters, is_whole=True, is_fused=False)
        got = sampler.sample(logits, temperature, ones, SEEDS, counters, is_whole=True, is_fused=True)
        assert torch.equal(got, expected)
        drawn.append(got)
    assert not torch.equal(drawn[0][[0, 2, 3]], drawn[1][[0, 2, 3]])  # the draws move with the counter
    assert torch.equal(drawn[0][[1, 4]], logits[[1, 4]].float().argmax(-1))  # greedy rows: their argmax


def test_nucleus_and_top_k_draws_with_the_kernels_noise_are_the_torch_samplers(interpreted):
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(len(SEEDS), 3000, generator=gen) * 2
    temperature = torch.tensor([1.0, 0.8, 0.0, 1.2, 0.5, 1.0])
    top_p = torch.tensor([0.9, 1.0, 0.5, 0.95, 0.3, 1.0])
    top_k = torch.tensor([0, 40, 0, 5, 0, 1])
    expected = sampler.sample(logits, temperature, top_p, SEEDS, COUNTERS, top_k, is_fused=False)
    assert torch.equal(sampler.sample(logits, temperature, top_p, SEEDS, COUNTERS, top_k, is_fused=True), expected)


def test_ties_take_the_first_column_and_no_rows_give_none(interpreted):
    flat = torch.zeros(2, 5000)
    assert interpreted.draw_rows(flat, torch.zeros(2), SEEDS[:2], COUNTERS[:2]).tolist() == [0, 0]
    assert interpreted.draw_rows(torch.zeros(0, 10), torch.zeros(0), SEEDS[:0], COUNTERS[:0]).shape == (0,)
