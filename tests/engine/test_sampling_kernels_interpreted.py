"""The device sampler's Triton draws (`engine/gpu/sampling_kernels.py`) under the Triton interpreter
on the CPU, against the torch sampler they replace (`sampler.sample(is_fused=False)`): the same
noise bit for bit, the same tokens; the nucleus' ties."""
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
    run_child(__file__, "15 passed")


@pytest.mark.parametrize("vocab", [1, 4095, 4097])
def test_the_noise_is_the_torch_samplers(interpreted, vocab):
    """Every row sampled at temperature 1 over a flat row: its draw is the argmax of its noise
    alone, at vocabularies of one token and either side of a chunk's end."""
    ones = torch.ones(len(SEEDS))
    noise = -torch.log(-torch.log(sampler.hashed_uniform(SEEDS, COUNTERS, vocab))).float()
    assert torch.equal(interpreted.draw_rows(torch.zeros(len(SEEDS), vocab), ones, SEEDS, COUNTERS), noise.argmax(-1))


@pytest.mark.parametrize("vocab", [1, 2047, 2049])
def test_the_sorts_noise_is_the_torch_samplers_bit_for_bit(interpreted, vocab):
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


@pytest.mark.parametrize("seed, vocab", [(0, 3000), (1, 3000), (2, 3000), (3, 9000)])
def test_nucleus_and_top_k_draws_are_the_torch_samplers(interpreted, seed, vocab):
    """Greedy rows, nucleus rows, top_k rows, both, and a row that limits nothing beside them, on
    fp32 logits of a few scales (no ties: the two keep the same tokens, so draw the same), in one
    chunk of columns and in three."""
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(8, vocab, generator=gen) * (1 + seed)
    seeds, counters = torch.cat([SEEDS, SEEDS[:2] + 1]) + seed, torch.cat([COUNTERS, COUNTERS[:2]])
    temperature = torch.tensor([1.0, 0.8, 0.0, 1.2, 0.5, 1.0, 0.9, 1e-7])
    top_p = torch.tensor([0.9, 1.0, 0.5, 0.95, 0.3, 1.0, 1.0, 0.5])
    top_k = torch.tensor([0, 40, 0, 5, 0, 1, 0, 3])
    expected = sampler.sample(logits, temperature, top_p, seeds, counters, top_k, is_fused=False)
    for nucleus in ("search", "sort"):
        assert torch.equal(sampler.sample(logits, temperature, top_p, seeds, counters, top_k, is_fused=True,
                                          nucleus=nucleus), expected), nucleus


def test_draws_stay_in_the_nucleus_and_ties_at_its_edge_are_kept(interpreted):
    """Probabilities 0.4, 0.2, 0.2, 0.2 (the rest nothing): a top_p of 0.5 keeps the first token
    and the three tied after it (each has only 0.4 heavier), a top_p of 0.4 the first alone, a
    top_k of 2 the first and the tied three; over many counters every kept token comes up."""
    row = torch.full((1100,), -1e4)
    row[[7, 100, 600, 1099]] = torch.log(torch.tensor([0.4, 0.2, 0.2, 0.2]))
    n = 16
    logits, ones = row.repeat(n, 1), torch.ones(n)
    seeds, counters = torch.full((n,), 3), torch.arange(n)
    for top_p, top_k, kept in ((0.5, 0, {7, 100, 600, 1099}), (0.4, 0, {7}), (1.0, 2, {7, 100, 600, 1099}),
                               (0.45, 1, {7})):
        drawn = interpreted.nucleus_draw(logits, ones, ones * top_p, torch.full((n,), top_k), seeds, counters)
        assert set(drawn.tolist()) == kept, (top_p, top_k)


def test_top_p_applies_to_the_top_ks_renormalised_mass(interpreted):
    """Probabilities 0.4, 0.35, 0.25: top_k 2 leaves 0.75 of mass, so top_p 0.5 keeps the first token
    alone (its 0.4 is past 0.5 x 0.75), and 0.6 the first two; the CPU sampler's rule (sampling.py),
    vLLM's and transformers'. Rows without a top_k beside them keep top_p of the whole row."""
    row = torch.full((3000,), -1e4)
    row[[5, 2100, 2999]] = torch.log(torch.tensor([0.4, 0.35, 0.25]))
    n = 24
    logits, ones = row.repeat(n, 1), torch.ones(n)
    seeds, counters = torch.full((n,), 11), torch.arange(n)
    for top_p, top_k, kept in ((0.5, 2, {5}), (0.6, 2, {5, 2100}), (0.5, 0, {5, 2100}), (1.0, 2, {5, 2100})):
        drawn = interpreted.nucleus_draw(logits, ones, ones * top_p, torch.full((n,), top_k), seeds, counters)
        assert set(drawn.tolist()) == kept, (top_p, top_k)
    mixed_k = torch.tensor([2, 0] * (n // 2))
    drawn = interpreted.nucleus_draw(logits, ones, ones * 0.5, mixed_k, seeds, counters)
    assert set(drawn[0::2].tolist()) == {5} and set(drawn[1::2].tolist()) == {5, 2100}


def test_ties_take_the_first_column_and_no_rows_give_none(interpreted):
    flat, none = torch.zeros(2, 5000), torch.zeros(0, 10)
    for draw in (lambda x, t: interpreted.draw_rows(x, t, SEEDS[:len(t)], COUNTERS[:len(t)]),
                 lambda x, t: interpreted.nucleus_draw(x, t, t + 0.5, None, SEEDS[:len(t)], COUNTERS[:len(t)])):
        assert draw(flat, torch.zeros(2)).tolist() == [0, 0]  # greedy rows of equal logits
        assert draw(none, torch.zeros(0)).shape == (0,)
