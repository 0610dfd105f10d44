"""logit_bias (OpenAI's): a bias added to a token's logit before sampling, on the calls that send
their tokens to the client as text. The amount is exact (a bias just past the gap between the two
most likely tokens swaps them, one just short of it does not), +100 all but forces a token, a
request beside a biased one samples what it samples alone, the GPU fast path's runner (on the
CPU) picks the reference runner's tokens, and ids past the plan's vocabulary or bad values are
refused before anything runs."""
from __future__ import annotations

import pytest

from fast_path_cpu import fast_path_engine, run_asks
from mstar.plan.io import load_plan
from mstar.runtime.conductor.request import Request
from mstar.runtime.engine.sampling import SamplingError, SamplingParams as EngineParams
from mstar.runtime.engine.torch_engine import TorchEngine
from mstar.runtime.serve.api import LLM, SamplingParams
from test_prefix_cache import ROOT

PLAN = ROOT / "generated" / "llama.plan"
PROMPT = [1, 9, 10, 11]


@pytest.fixture(scope="module")
def llm():
    with LLM(str(PLAN)) as served:
        yield served


def _one(llm, **settings):
    return llm.generate([PROMPT], SamplingParams(**settings))[0]


def test_the_bias_is_added_to_the_logit_exactly(llm):
    first = _one(llm, max_tokens=1, logprobs=2)
    (best, best_value), (second, second_value) = first.logprobs[0][1][0], first.logprobs[0][1][1]
    assert first.token_ids == [best] and best != second
    gap = best_value - second_value  # (log-probabilities differ as the logits do)
    assert _one(llm, max_tokens=1, logit_bias={second: gap + 1e-3}).token_ids == [second]
    assert _one(llm, max_tokens=1, logit_bias={second: gap - 1e-3}).token_ids == [best]
    assert _one(llm, max_tokens=1, logit_bias={best: -gap - 1e-3}).token_ids == [second]


def test_a_large_bias_forces_its_token_and_a_neighbour_is_untouched(llm):
    alone = _one(llm, max_tokens=6, temperature=1.0, seed=4)
    forced, beside = llm.generate([PROMPT, PROMPT], [SamplingParams(max_tokens=6, temperature=1.0, seed=9,
                                                                    logit_bias={"42": 100}),
                                                     SamplingParams(max_tokens=6, temperature=1.0, seed=4)])
    assert forced.token_ids == [42] * 6
    assert beside.token_ids == alone.token_ids
    banned = _one(llm, max_tokens=6, logit_bias={token: -100 for token in alone.token_ids})
    assert not set(banned.token_ids) & set(alone.token_ids)


@pytest.mark.parametrize("bias, words", [
    ({"x": 1}, "logit_bias token id must be an integer"), ({-1: 1}, "logit_bias token id must be >= 0"),
    ({5: 100.5}, "logit_bias of token 5 must be a number in [-100, 100]"),
    ({5: "1"}, "logit_bias of token 5 must be a number"), ({i: 1 for i in range(1025)}, "more than the 1024"),
    ([(5, 1)], "logit_bias must map token ids to biases"),
    ({"9" * 5000: 1}, "(5000 digits) is outside every vocabulary"),  # int() raised past 4,300 digits
    ({"5": 1, "005": 2}, "logit_bias names token 5 twice"),
])
def test_bad_biases_are_refused_before_anything_runs(llm, bias, words):
    from mstar.runtime.serve.api import SamplingError as ApiSamplingError

    with pytest.raises(ApiSamplingError) as refused:
        llm.generate([PROMPT], SamplingParams(max_tokens=2, logit_bias=bias))
    assert words in str(refused.value) and refused.value.param == "logit_bias"


def test_an_id_past_the_plans_vocabulary_is_refused_by_the_engine():
    plan = load_plan(PLAN, verify=False)
    engine = TorchEngine(plan, num_pages=64)
    reason = engine.add_request("r", Request(id="r", prompt_tokens=PROMPT, max_tokens=2, logit_bias=[(128256, 1.0)]))
    assert reason is not None and "logit_bias token id 128256 is outside the vocabulary [0, 128256)" in reason
    with pytest.raises(SamplingError):
        EngineParams.from_request({"logit_bias": {"5": float("nan")}})


@pytest.mark.parametrize("plan_name, can_run_ahead", [("llama", True), ("llama_chunked", True)])
def test_the_fast_path_picks_the_references_tokens(plan_name, can_run_ahead):
    plan = load_plan(ROOT / "generated" / f"{plan_name}.plan", verify=False)
    prompt_len = 40 if plan_name == "llama_chunked" else 6
    asks = [dict(logit_bias=[(42, 100.0)]), dict(logit_bias=[(t, -100.0) for t in range(200, 300)]), {},
            dict(logit_bias=[(7, 3.0)], repetition_penalty=1.2, logprobs=1)]

    def run(engine):
        records = run_asks(plan, engine, asks, prompt_len, 10)
        return {rid: (r.output_tokens, r.finish_reason) for rid, r in records.items()}

    engine, _ = fast_path_engine(plan, 64, max_seq_len=4096, can_run_ahead=can_run_ahead)
    got, expected = run(engine), run(TorchEngine(plan, num_pages=64))
    assert got == expected
    assert got["r0"][0] == [42] * 10 and not set(got["r1"][0]) & set(range(200, 300))
