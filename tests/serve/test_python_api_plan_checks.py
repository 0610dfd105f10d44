"""The Python API checks a request against its plan before anything runs (serve/plan_checks.py):
a prompt token id outside the vocabulary, a stop token id no node samples, a route the plan's
partitions and stages do not take, a guidance label the plan does not declare. Each was an
`Output` ending `error: ...` (or, for guidance on the simulated engine, ran as if it were not
there); now a PromptError / SamplingError naming the field, on generate and stream, on both
engines, and a batch with one bad prompt is refused whole. Also: sampling given beside a Request
(it was ignored) is refused, and a prompt + max_tokens past max_seq_len says it is about max_tokens."""
from __future__ import annotations

import asyncio

import pytest

from mstar import LLM, SamplingParams
from mstar.runtime.serve.api import PromptError, SamplingError
from mstar.runtime.serve.engine_setup import load
from mstar.runtime.serve.plan_checks import PlanChecks
from serve_harness import LLAMA, ROOT, wait_until

VOCAB = load(LLAMA).nodes[0].dims["vocab"]  # the plan's, not the tiny model's


@pytest.fixture(scope="module", params=["torch", "sim"])
def llm(request):
    with LLM(LLAMA, engine=request.param, **({"sim_pace": 0} if request.param == "sim" else {})) as llm:
        yield llm


@pytest.fixture
def submitted(llm, monkeypatch):
    """The requests the run loop was given during the test."""
    seen = []
    submit = llm.loop.submit

    def recording(request, deliver):
        seen.append(request)
        submit(request, deliver)

    monkeypatch.setattr(llm.loop, "submit", recording)
    return seen


def _both(llm, prompt, sampling):
    """The error generate and stream raise (the same type and message), or None."""
    errors = []
    try:
        llm.generate(prompt, sampling)
    except (PromptError, SamplingError) as error:
        errors.append(error)

    async def first():
        async for _ in llm.stream(prompt, sampling):
            break
    try:
        asyncio.run(first())
    except (PromptError, SamplingError) as error:
        errors.append(error)
    assert len(errors) == 2 and type(errors[0]) is type(errors[1]) and str(errors[0]) == str(errors[1])
    return errors[0]


@pytest.mark.parametrize("prompt, sampling, kind, param, words", [
    ([1, 10**6], SamplingParams(max_tokens=3), PromptError, None,
     rf"prompt token id 1000000 is outside the vocabulary \[0, {VOCAB}\)"),
    ([1, 2**70], SamplingParams(max_tokens=3), PromptError, None, "outside the vocabulary"),
    ([1, 2], SamplingParams(max_tokens=3, stop_token_ids=[10**12]), SamplingError, "stop_token_ids",
     rf"token id 1000000000000, outside the plan's vocabulary \[0, {VOCAB}\)"),
    # the names in `mstar run --route`'s words (workload.py route_name_problem), a near name offered
    ([1, 2], SamplingParams(max_tokens=3, route={"nope": ["x"]}), SamplingError, "route",
     r"route is not one this plan takes: unknown partition 'nope' \(partitions: LLM\)"),
    ([1, 2], SamplingParams(max_tokens=3, route={"LLM": ["bogus"]}), SamplingError, "route",
     r"route is not one this plan takes: partition 'LLM' has no walk 'bogus' \(walks: prefill, decode\)"),
    ([1, 2], SamplingParams(max_tokens=3, route={"LLM": ["decod"]}), SamplingError, "route",
     r"partition 'LLM' has no walk 'decod'; did you mean 'decode'\?"),
    ([1, 2], SamplingParams(max_tokens=3, route={"LLM": ["decode", "prefill"]}), SamplingError, "route",
     "route is not one this plan takes"),
    ([1, 2], SamplingParams(max_tokens=3, guidance={"zzz": 2.0}), SamplingError, "guidance",
     r"guidance 'zzz' is not a guidance label of the plan \(labels: none\)"),
    ([1] * 8190, SamplingParams(max_tokens=3), PromptError, "max_tokens", "more than the plan's max_seq_len"),
    # llama's decode loop runs at most 2048 times after the prefill's token: 2049 (plan/output_bound.py)
    ([1, 2], SamplingParams(max_tokens=10**9), SamplingError, "max_tokens",
     r"max_tokens 1000000000 is more than this plan makes for a request: at most 2049 output tokens"),
])
def test_a_request_the_plan_cannot_take_is_refused_before_it_runs(llm, submitted, prompt, sampling, kind, param,
                                                                  words):
    error = _both(llm, prompt, sampling)
    assert type(error) is kind and error.param == param
    with pytest.raises(kind, match=words):  # request() checks it: generate and stream go through it
        llm.request(prompt, sampling)
    assert submitted == []  # nothing ran
    assert llm.generate([1, 2], SamplingParams(max_tokens=2))[0].finish_reason == "length"  # the loop lives


@pytest.mark.parametrize("sampling", [
    SamplingParams(max_tokens=3, stop_token_ids=[VOCAB - 1]),
    SamplingParams(max_tokens=3, route={"LLM": ["prefill", "decode"]}),
])
def test_what_the_plan_declares_still_runs(llm, sampling):
    [output] = llm.generate([1, VOCAB - 1], sampling)
    assert not output.finish_reason.startswith("error"), output.finish_reason


def test_a_batch_with_one_bad_prompt_is_refused_whole(llm, submitted):
    for bad, kind in (([1, 10**6], PromptError), ([], PromptError)):
        with pytest.raises(kind):
            llm.generate([[1, 2], bad, [3, 4]], SamplingParams(max_tokens=3))
    with pytest.raises(SamplingError, match="guidance"):
        llm.generate([[1, 2], [3, 4]], SamplingParams(max_tokens=3, guidance={"zzz": 1.0}))
    assert submitted == []
    assert llm.loop.num_in_flight == 0


def test_sampling_beside_a_request_is_refused(llm, submitted):
    request = llm.request([1, 2], SamplingParams(max_tokens=3))
    with pytest.raises(SamplingError, match="a Request, which carries its own"):
        llm.generate(request, SamplingParams(max_tokens=10))
    with pytest.raises(SamplingError, match="a Request, which carries its own"):
        llm.generate([request], SamplingParams(max_tokens=10))

    async def first():
        async for _ in llm.stream(request, SamplingParams(max_tokens=10)):
            break
    with pytest.raises(SamplingError, match="a Request, which carries its own"):
        asyncio.run(first())
    assert submitted == []
    [output] = llm.generate(request)  # not spent by the refusals: it runs, with its own max_tokens
    assert output.finish_reason == "length" and len(output.token_ids) == 3
    # a batch of prompts and requests: the sampling is the prompts', each request keeps its own
    mixed = llm.generate([[1, 2], llm.request([1, 2], SamplingParams(max_tokens=2))], SamplingParams(max_tokens=4))
    assert [len(o.token_ids) for o in mixed] == [4, 2]
    assert wait_until(lambda: llm.loop.num_in_flight == 0)


def test_the_checks_read_the_plan_tables():
    """Guidance labels and routes are the plan's own: a plan declaring labels takes them and
    refuses others; a partition's stages decide a route (no names known to the check)."""
    bagel = load(str(ROOT / "generated" / "bagel.plan"))
    checks = PlanChecks(bagel)
    labels = [g.label for node in bagel.nodes for g in node.guidance]
    assert labels and checks.guidance_problem({label: 2.0 for label in labels}) is None
    assert "not a guidance label" in checks.guidance_problem({"zzz": 1.0})
    for part in bagel.partitions:
        default = [stage.walks[0] for stage in part.stages if not stage.is_optional and not stage.sequence_lengths]
        if len(default) == len([s for s in part.stages if not s.is_optional]):
            assert checks.route_problem({part.name: default}) is None
    assert checks.stop_problem([checks.stop_vocab - 1]) is None and checks.stop_problem([checks.stop_vocab])


def test_a_prompt_dict_key_the_prompt_does_not_take_is_refused(tmp_path):
    """A misspelt prompt format field (Orpheus's `voice`) silently took the spec's default voice."""
    from serve_harness import ORPHEUS, write_tokenizer

    with LLM(ORPHEUS, engine="sim", sim_pace=0, tokenizer=str(write_tokenizer(tmp_path))) as llm:
        with pytest.raises(PromptError, match="'vocie', which it does not take") as refused:
            llm.request({"prompt": "hello", "vocie": "leo"}, SamplingParams(max_tokens=3))
        assert "voice" in str(refused.value)
        assert llm.request({"prompt": "hello", "voice": "leo"}, SamplingParams(max_tokens=3)).prompt_tokens
        with pytest.raises(PromptError, match="'extra', which it does not take"):
            llm.request({"messages": [{"role": "user", "content": "hi"}], "extra": 1}, SamplingParams(max_tokens=3))
        # without either key the dict is neither kind: a misspelt "promt" was told the prompt takes messages only
        for neither in ({"promt": "hello"}, {}):
            with pytest.raises(PromptError, match=r"needs 'prompt' \(text, with voice\) or 'messages'"):
                llm.request(neither, SamplingParams(max_tokens=3))
