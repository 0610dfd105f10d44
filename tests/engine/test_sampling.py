"""Sampling, batched over a step's rows: greedy is argmax; temperature / top-k / top-p draws are
reproducible per request seed and step and do not depend on the other rows of the call (nor their
order); top-k and top-p keep only their tokens; the repetition penalty follows HF."""
import torch
from hypothesis import given, strategies as st

from engine_plans import llm_plan, step
from mstar.runtime.engine.torch_engine import TorchEngine
from mstar.runtime.conductor.request import Request
from mstar.runtime.engine.sampling import (
    SamplingError, SamplingParams, apply_output_penalties, apply_repetition_penalty, sample_tokens,
)
from mstar.runtime.step import StepRow

import pytest


def one(logits, params, history=(), stream=0, step_index=0):
    return sample_tokens(logits.unsqueeze(0), [params], [torch.tensor(list(history), dtype=torch.long)],
                         [stream], [step_index])[0]


def test_greedy_is_argmax():
    assert one(torch.tensor([0.1, 3.0, -1.0, 2.9]), SamplingParams()) == 1


@pytest.mark.parametrize("temperature", [1e-6, 1e-38, 1e-320, 5e-324])
def test_a_temperature_too_small_for_fp32_is_greedy_on_both_samplers(temperature):
    """Beside a row that samples: a temperature of 1e-38 made every probability NaN and 1e-320 is 0
    in fp32; the sampler's gather then failed the whole step (every request in it)."""
    from mstar.runtime.engine.gpu.sampler import sample

    logits = torch.tensor([[0.1, 3.0, -1.0, 2.9], [0.5, 0.4, 0.3, 0.2]])
    tokens = sample_tokens(logits, [SamplingParams(temperature=temperature), SamplingParams(temperature=1.0)],
                           [torch.tensor([], dtype=torch.long)] * 2, [0, 1], [0, 0])
    assert tokens[0] == 1
    device = sample(logits, torch.tensor([temperature, 1.0], dtype=torch.float32), torch.ones(2),
                    torch.tensor([0, 1]), torch.tensor([0, 0]))
    assert int(device[0]) == 1


@pytest.mark.parametrize("top_p", [1e-300, 1e-45, 1e-9])
def test_a_top_p_too_small_keeps_the_top_token_on_both_samplers(top_p):
    from mstar.runtime.engine.gpu.sampler import sample

    logits = torch.tensor([[0.1, 3.0, -1.0, 2.9]])
    assert one(logits[0], SamplingParams(temperature=1.0, top_p=top_p)) == 1
    device = sample(logits, torch.ones(1), torch.tensor([top_p], dtype=torch.float32), torch.tensor([3]),
                    torch.tensor([0]))
    assert int(device[0]) == 1


def test_repetition_penalty_matches_hf_rule():
    logits = torch.tensor([[2.0, -2.0, 1.0], [2.0, -2.0, 1.0]])
    out = apply_repetition_penalty(logits, [torch.tensor([0, 1, 1]), torch.tensor([])], torch.tensor([2.0, 2.0]))
    assert out.tolist() == [[1.0, -4.0, 1.0], [2.0, -2.0, 1.0]]
    assert one(torch.tensor([3.0, 1.0]), SamplingParams(repetition_penalty=4.0), history=[0]) == 1


def test_presence_and_frequency_penalties_follow_openais_rule():
    """A logit less presence once its token is among the row's outputs and frequency a time; rows
    are penalised by their own outputs and settings alone."""
    logits = torch.tensor([[2.0, -2.0, 1.0], [2.0, -2.0, 1.0]])
    out = apply_output_penalties(logits, [torch.tensor([0, 1, 1]), torch.tensor([], dtype=torch.long)],
                                 torch.tensor([0.5, 0.5]), torch.tensor([0.25, 0.25]))
    assert out.tolist() == [[2.0 - 0.5 - 0.25, -2.0 - 0.5 - 0.5, 1.0], [2.0, -2.0, 1.0]]
    negative = apply_output_penalties(logits[:1], [torch.tensor([2])], torch.tensor([-1.5]), torch.tensor([0.0]))
    assert negative.tolist() == [[2.0, -2.0, 2.5]]  # a negative penalty favours a token already said


def test_output_penalties_take_the_outputs_not_the_history():
    """The repetition penalty reads everything the row has seen (its prompt too); presence and
    frequency read only the tokens sampled so far: a prompt token keeps its logit."""
    logits = torch.tensor([[3.0, 2.5, 0.0]])
    params = SamplingParams(presence_penalty=1.0)
    assert sample_tokens(logits, [params], [torch.tensor([0])], [0], [0], [torch.tensor([], dtype=torch.long)]) == [0]
    assert sample_tokens(logits, [params], [torch.tensor([0])], [0], [0], [torch.tensor([0])]) == [1]
    assert sample_tokens(logits, [params], [torch.tensor([0])], [0], [0]) == [0]  # no outputs given: no penalty
    beside = sample_tokens(logits.repeat(2, 1), [SamplingParams(), params], [torch.tensor([0])] * 2, [0, 0], [0, 0],
                           [torch.tensor([0]), torch.tensor([0])])
    assert beside == [0, 1]


@pytest.mark.parametrize("values, words", [({"presence_penalty": 2.5}, "presence_penalty must be in [-2, 2]"),
                                           ({"frequency_penalty": -3}, "frequency_penalty must be in [-2, 2]"),
                                           ({"presence_penalty": float("nan")}, "presence_penalty must be a finite")])
def test_an_output_penalty_out_of_range_is_refused(values, words):
    with pytest.raises(SamplingError, match=words.replace("[", r"\[").replace("]", r"\]")):
        SamplingParams.from_request({"prompt_tokens": [1], "max_tokens": 1, **values})


@pytest.mark.parametrize("values, words", [
    ({"temperature": 1e39}, "temperature must be at most 10000"),
    ({"temperature": 1.0, "repetition_penalty": 1e-300}, r"repetition_penalty must be in \[0.0001, 10000\]"),
    ({"temperature": 1.0, "repetition_penalty": 1e5}, r"repetition_penalty must be in \[0.0001, 10000\]")])
def test_a_value_past_the_samplers_float32_is_refused(values, words):
    """1e39 is inf in float32 (a masked logit's -inf / inf is NaN) and 1e-300 is 0 (a logit / 0 is
    inf): the row's probabilities were NaN and it sampled token 0, silently."""
    with pytest.raises(SamplingError, match=words):
        SamplingParams.from_request({"prompt_tokens": [1], "max_tokens": 1, **values})


def test_the_samplers_bounds_keep_every_probability_finite():
    """At the bounds a masked token stays unsampled and the draws spread over the rest (NaN
    probabilities gave token 0 every time)."""
    logits = torch.tensor([[60.0, -60.0, 30.0, 0.0, 10.0]] * 64)
    masked = [((0, float("-inf")),)] * 32 + [()] * 32
    params = [SamplingParams(temperature=1e4)] * 32 + [SamplingParams(temperature=1.0, repetition_penalty=1e-4)] * 32
    tokens = sample_tokens(logits, params, [torch.tensor([2, 4])] * 64, list(range(64)), [0] * 64, biases=masked)
    assert 0 not in tokens[:32] and len(set(tokens[:32])) == 4  # near-uniform over the four left
    assert set(tokens[32:]) == {2}  # the seen tokens' logits x 1e4: 3e5 against 1e5, finite
    probe = logits[:1] / 1e-4
    assert bool(torch.isfinite(torch.softmax(probe / 1e-5, dim=1)).all())  # the least temperature, too


@given(st.integers(0, 2**31 - 1), st.integers(0, 1000), st.floats(0.05, 1.0), st.integers(0, 5))
def test_draws_stay_in_the_nucleus_and_the_top_k(stream, step_index, top_p, top_k):
    logits = torch.tensor([4.0, 3.0, 1.0, 0.0, -1.0])
    probs = torch.softmax(logits, -1)
    sorted_probs, order = torch.sort(probs, descending=True)
    limit = top_k or len(order)
    top_k_mass = float(sorted_probs[:limit].sum())  # top_p applies to the top k's renormalised mass
    kept = {int(order[i]) for i in range(limit) if float(sorted_probs[:i].sum()) < top_p * top_k_mass}
    token = one(logits, SamplingParams(temperature=1.0, top_p=top_p, top_k=top_k), stream=stream,
                step_index=step_index)
    assert token in kept


def _transformers_kept(logits, top_k, top_p):
    """The tokens transformers' top-k then top-p warpers leave finite (its generate's order)."""
    from transformers.generation.logits_process import TopKLogitsWarper, TopPLogitsWarper

    scores = logits.unsqueeze(0).clone()
    if top_k:
        scores = TopKLogitsWarper(top_k)(None, scores)
    if top_p < 1.0:
        scores = TopPLogitsWarper(top_p)(None, scores)
    return {int(i) for i in torch.isfinite(scores[0]).nonzero().flatten()}


@given(st.lists(st.integers(-32, 32), min_size=6, max_size=6, unique=True), st.integers(0, 6),
       st.floats(0.05, 1.0))
def test_the_nucleus_is_transformers_top_k_then_top_p(quarters, top_k, top_p):
    """With both, top_p applies to the top k's renormalised distribution (transformers' and vLLM's
    order): every draw is among the tokens transformers' warpers keep, and over many draws each of
    them comes up (the nucleus is neither larger nor smaller)."""
    logits = torch.tensor(quarters) / 4  # (no ties: transformers keeps every token tied with the k-th)
    kept = _transformers_kept(logits, top_k, top_p)
    params = SamplingParams(temperature=1.0, top_p=top_p, top_k=top_k)
    # a kept token of probability p is missed by 400 draws with chance (1 - p)^400; skip those that
    # 400 draws may miss (the property is the set, not the draws' luck)
    probs = torch.softmax(logits, -1)
    drawn = {one(logits, params, stream=s) for s in range(400)}
    assert drawn <= kept
    assert {t for t in kept if float(probs[t]) > 0.05} <= drawn


def test_top_k_then_top_p_renormalises_over_the_top_k():
    """Probabilities 0.4, 0.35, 0.25: top_k 2 leaves 0.75 of mass, so top_p 0.5 keeps the tokens whose
    heavier ones weigh less than 0.375: the first alone (of the whole distribution, 0.5 would have
    kept the second too, 0.4 < 0.5)."""
    logits = torch.tensor([0.4, 0.35, 0.25]).log()
    params = SamplingParams(temperature=1.0, top_p=0.5, top_k=2)
    assert {one(logits, params, stream=s) for s in range(200)} == {0}
    assert {one(logits, SamplingParams(temperature=1.0, top_p=0.6, top_k=2), stream=s) for s in range(200)} == {0, 1}


def test_top_k_one_is_greedy_and_draws_cover_the_top_k():
    logits = torch.tensor([4.0, 3.9, 3.8, -9.0, -9.0])
    assert {one(logits, SamplingParams(temperature=2.0, top_k=1), stream=s) for s in range(50)} == {0}
    assert {one(logits, SamplingParams(temperature=2.0, top_k=3), stream=s) for s in range(200)} == {0, 1, 2}


ROW = st.tuples(st.lists(st.floats(-5, 5), min_size=6, max_size=6), st.sampled_from([None, 0.7, 1.5]),
                st.integers(0, 6), st.floats(0.1, 1.0), st.integers(0, 2**32 - 1), st.integers(0, 500),
                st.lists(st.integers(0, 5), max_size=4), st.sampled_from([1.0, 1.3]))


@given(st.lists(ROW, min_size=1, max_size=6), st.randoms(use_true_random=False))
def test_a_rows_draw_depends_only_on_its_own_seed_and_step(rows, random):
    """One batched call gives each row the token it gets alone, whatever its neighbours and order."""
    def call(chosen):
        logits = torch.tensor([r[0] for r in chosen])
        params = [SamplingParams(temperature=r[1], top_k=r[2], top_p=r[3], repetition_penalty=r[7]) for r in chosen]
        histories = [torch.tensor(r[6], dtype=torch.long) for r in chosen]
        return sample_tokens(logits, params, histories, [r[4] for r in chosen], [r[5] for r in chosen])

    alone = [call([row])[0] for row in rows]
    order = list(range(len(rows)))
    random.shuffle(order)
    together = call([rows[i] for i in order])
    assert [together[order.index(i)] for i in range(len(rows))] == alone


@pytest.mark.parametrize("name, sign", [("seed", 1), ("top_k", -1), ("min_tokens", 1),
                                        ("logprobs", 1)])
def test_an_integer_past_4300_digits_is_refused_with_its_length(name, sign):
    """seed=10**5000 raised Python's ValueError of int -> str inside the range check's message (a
    traceback where a 400 or a SamplingError belongs); the message gives the digit count instead."""
    with pytest.raises(SamplingError, match=f"{name} must .*5001 digits"):
        SamplingParams.from_request({"prompt_tokens": [1], "max_tokens": 4, name: sign * 10**5000})


def test_top_k_must_not_be_negative():
    with pytest.raises(SamplingError, match="top_k must be >= 0"):
        SamplingParams.from_request({"top_k": -1})


def sampled_tokens(prompts, seeds, num_steps=6):
    engine = TorchEngine(llm_plan())
    for rid, prompt in prompts.items():
        engine.add_request(rid, Request(id=rid, prompt_tokens=prompt, max_tokens=50, temperature=1.3, top_k=40,
                                        top_p=0.9, seed=seeds[rid]))
    out = {rid: [] for rid in prompts}
    rows = [StepRow(rid, "prefill", len(p), 0, {"text_inputs": p}) for rid, p in prompts.items()]
    for _ in range(num_steps):
        result = engine.run_step(step(engine.plan, "LLM", rows))
        rows = []
        for row in result.rows:
            token = row.outputs["new_token"][0]
            out[row.request_id].append(token)
            rows.append(StepRow(row.request_id, "decode", 1, 0, {"text_inputs": [token]}))
    return out


def test_seeded_sampling_is_reproducible_and_independent_of_neighbours():
    alone = sampled_tokens({"a": [1, 2, 3]}, {"a": 11})
    together = sampled_tokens({"a": [1, 2, 3], "b": [9, 9]}, {"a": 11, "b": 12})
    assert alone["a"] == together["a"]
    other_seed = sampled_tokens({"a": [1, 2, 3]}, {"a": 99})
    assert other_seed["a"] != alone["a"]


def test_stop_token_and_max_tokens_set_is_stop():
    engine = TorchEngine(llm_plan())
    engine.add_request("m", Request(id="m", prompt_tokens=[1, 2], max_tokens=2))
    first = engine.run_step(step(engine.plan, "LLM", [StepRow("m", "prefill", 2, 0, {"text_inputs": [1, 2]})])).rows[0]
    token = first.outputs["new_token"][0]
    assert not first.is_stop
    second = engine.run_step(step(engine.plan, "LLM", [StepRow("m", "decode", 1, 0, {"text_inputs": [token]})])).rows[0]
    assert second.is_stop  # max_tokens reached
    probe = TorchEngine(llm_plan())
    probe.add_request("s", {"prompt_tokens": [1, 2], "max_tokens": 9, "stop_tokens": [token]})
    row = probe.run_step(step(probe.plan, "LLM", [StepRow("s", "prefill", 2, 0, {"text_inputs": [1, 2]})])).rows[0]
    assert row.outputs["new_token"] == [token] and row.is_stop  # its stop token was sampled


def test_on_device_loop_back_arriving_as_none_uses_the_engine_kept_token():
    plain, kept = TorchEngine(llm_plan()), TorchEngine(llm_plan())
    for engine in (plain, kept):
        engine.add_request("r", Request(id="r", prompt_tokens=[4, 5, 6], max_tokens=9))
    prefill = StepRow("r", "prefill", 3, 0, {"text_inputs": [4, 5, 6]})
    token = plain.run_step(step(plain.plan, "LLM", [prefill])).rows[0].outputs["new_token"]
    kept.run_step(step(kept.plan, "LLM", [prefill]))
    explicit = plain.run_step(step(plain.plan, "LLM", [StepRow("r", "decode", 1, 0, {"text_inputs": token})])).rows[0]
    implicit = kept.run_step(step(kept.plan, "LLM", [StepRow("r", "decode", 1, 0, {"text_inputs": None})])).rows[0]
    assert implicit.outputs == explicit.outputs
