"""Sampling: greedy is argmax; temperature / top-p draws are reproducible per request seed and do
not depend on other requests; top-p keeps only the nucleus; the repetition penalty follows HF."""
import torch
from hypothesis import given, strategies as st

from engine_plans import llm_plan, step
from mstar.runtime.engine.torch_engine import TorchEngine
from mstar.runtime.conductor.request import Request
from mstar.runtime.engine.sampling import SamplingParams, apply_repetition_penalty, sample_token
from mstar.runtime.step import StepRow


def test_greedy_is_argmax():
    logits = torch.tensor([0.1, 3.0, -1.0, 2.9])
    assert sample_token(logits, SamplingParams(), torch.tensor([]), torch.Generator()) == 1


def test_repetition_penalty_matches_hf_rule():
    logits = torch.tensor([2.0, -2.0, 1.0])
    out = apply_repetition_penalty(logits, torch.tensor([0, 1, 1]), 2.0)
    assert out.tolist() == [1.0, -4.0, 1.0]
    params = SamplingParams(repetition_penalty=4.0)
    assert sample_token(torch.tensor([3.0, 1.0]), params, torch.tensor([0]), torch.Generator()) == 1


@given(st.integers(0, 2**31 - 1), st.floats(0.05, 1.0))
def test_top_p_draws_stay_in_the_nucleus(seed, top_p):
    logits = torch.tensor([4.0, 3.0, 1.0, 0.0, -1.0])
    probs = torch.softmax(logits, -1)
    sorted_probs, order = torch.sort(probs, descending=True)
    nucleus = {int(order[i]) for i in range(len(order)) if float(sorted_probs[:i].sum()) < top_p}
    token = sample_token(logits, SamplingParams(temperature=1.0, top_p=top_p), torch.tensor([]),
                         torch.Generator().manual_seed(seed))
    assert token in nucleus


def sampled_tokens(prompts, seeds, num_steps=6):
    engine = TorchEngine(llm_plan())
    for rid, prompt in prompts.items():
        engine.add_request(rid, Request(id=rid, prompt_tokens=prompt, max_tokens=50, temperature=1.3, top_p=0.9,
                                        seed=seeds[rid]))
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
