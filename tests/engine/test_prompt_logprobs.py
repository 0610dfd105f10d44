"""A prompt's own log-probabilities (engine/prompt_logprobs.py).

The oracle: a prompt whose tail is the model's own greedy continuation of its head. Each tail
token is then the argmax of the distribution before it, so its prompt log-probability and its
first alternative are what the sampler reported when it drew that token (`logprobs`), a number
computed on another path (the last position of each decode step). A prompt cut into chunks (the
llama_chunked plan, 512-token chunks) gives what the whole prompt gives; such a request claims no
cached prefix and still gets every entry; the GPU fast path's runner (on the CPU: its executor,
packing and forward) gives what the CPU engine gives."""
from __future__ import annotations

from pathlib import Path

import pytest

from mstar.runtime.serve.api import LLM, SamplingParams

GENERATED = Path(__file__).resolve().parents[2] / "generated"
LLAMA, CHUNKED = GENERATED / "llama.plan", GENERATED / "llama_chunked.plan"
HEAD = [5, 9, 13, 2, 7, 11, 3]


def _generate(llm, prompts, **settings):
    return llm.generate(prompts, SamplingParams(**settings))


def test_the_tail_of_a_greedy_prompt_has_the_samplers_logprobs():
    with LLM(str(LLAMA)) as llm:
        drawn = _generate(llm, [HEAD], max_tokens=6, logprobs=2)[0]
        prompt = HEAD + drawn.token_ids
        out = _generate(llm, [prompt], max_tokens=1, prompt_logprobs=2)[0]
    assert out.prompt_token_ids == prompt and len(out.prompt_logprobs) == len(prompt)
    assert out.prompt_logprobs[0] is None
    for position, (token, (own, top)) in enumerate(zip(drawn.token_ids, drawn.logprobs), start=len(HEAD)):
        found_own, found_top = out.prompt_logprobs[position]
        assert found_own == pytest.approx(own, abs=1e-5)
        assert [t for t, _ in found_top] == [t for t, _ in top] and found_top[0][0] == token
        assert [v for _, v in found_top] == pytest.approx([v for _, v in top], abs=1e-5)
    for own, top in out.prompt_logprobs[1:len(HEAD)]:
        assert own <= top[0][1] + 1e-6 and len(top) == 2


def test_a_prompt_cut_into_chunks_gives_what_the_whole_prompt_gives():
    prompt = [(7 * i) % 500 + 1 for i in range(1200)]  # three chunks of llama_chunked's 512
    answers = []
    for plan in (LLAMA, CHUNKED):
        with LLM(str(plan)) as llm:
            answers.append(_generate(llm, [prompt], max_tokens=1, prompt_logprobs=1)[0].prompt_logprobs)
    whole, chunked = answers
    assert whole[0] is None and chunked[0] is None and len(whole) == len(chunked) == len(prompt)
    for at in (1, 511, 512, 513, 1023, 1024, 1025, 1199):  # either side of each chunk's edge
        assert chunked[at][0] == pytest.approx(whole[at][0], abs=1e-4)
        assert chunked[at][1][0][0] == whole[at][1][0][0]


def test_a_request_asking_for_them_claims_no_cached_prefix():
    prompt = [(3 * i) % 400 + 1 for i in range(600)]
    with LLM(str(CHUNKED)) as llm:
        first = _generate(llm, [prompt], max_tokens=1)[0]
        cached = _generate(llm, [prompt], max_tokens=1)[0]
        asks = _generate(llm, [prompt], max_tokens=1, prompt_logprobs=0)[0]
    assert first.num_cached_tokens == 0 and cached.num_cached_tokens > 0  # the cache works here
    assert asks.num_cached_tokens == 0 and asks.finish_reason == "length"
    assert asks.prompt_logprobs[0] is None and all(entry is not None for entry in asks.prompt_logprobs[1:])
    assert all(top == () for _, top in asks.prompt_logprobs[1:])


def test_a_request_without_them_gets_none():
    with LLM(str(LLAMA)) as llm:
        out = _generate(llm, [HEAD], max_tokens=2)[0]
    assert out.prompt_logprobs is None


@pytest.mark.parametrize("plan_path, prompt_len", [(LLAMA, 40), (CHUNKED, 600)])
def test_the_fast_path_gives_what_the_cpu_engine_gives(plan_path, prompt_len):
    """The GPU fast path's runner on the CPU (its executor, packing and forward in fp32): a step
    scoring a prompt runs eagerly and keeps every position's hidden state; llama_chunked's
    600-token prompts cross a chunk's edge, and steps are launched ahead beside them."""
    from fast_path_cpu import fast_path_engine, run_asks

    from mstar.plan.io import load_plan
    from mstar.runtime.engine.torch_engine import TorchEngine

    plan = load_plan(str(plan_path), verify=False)
    asks = [{"prompt_logprobs": 2}, {}, {"prompt_logprobs": 0, "logprobs": 1}, {"prompt_logprobs": 1}]
    reference = run_asks(plan, TorchEngine(plan, num_pages=256), asks, prompt_len, 4)
    engine, runner = fast_path_engine(plan, 256, can_run_ahead=True)
    fast = run_asks(plan, engine, asks, prompt_len, 4)
    assert runner.executor.num_eager_steps > 0
    for request_id, expected in reference.items():
        found = fast[request_id]
        assert found.finish_reason == expected.finish_reason == "length"
        assert found.output_tokens == expected.output_tokens
        assert len(found.prompt_logprobs) == len(expected.prompt_logprobs)
        if not expected.prompt_logprobs:
            continue
        assert len(expected.prompt_logprobs) == prompt_len and found.prompt_logprobs[0] is None
        for got, want in zip(found.prompt_logprobs[1:], expected.prompt_logprobs[1:]):
            assert got[0] == pytest.approx(want[0], abs=1e-4)
            assert [t for t, _ in got[1]] == [t for t, _ in want[1]]


def test_an_out_of_range_count_is_refused():
    with pytest.raises(ValueError, match=r"prompt_logprobs must be in \[0, 20\]"):
        SamplingParams(max_tokens=2, prompt_logprobs=21).check()


@pytest.mark.parametrize("plan", ["orpheus.plan", "cosmos3.plan"])
def test_a_plan_that_gives_none_refuses_the_request_before_it_runs(plan):
    """Orpheus's LLM sends audio codes, not text: the request ran and came back an error output."""
    from mstar.runtime.serve.api import SamplingError

    with LLM(str(GENERATED / plan), engine="sim") as llm:
        with pytest.raises(SamplingError, match="prompt_logprobs asks for what this plan does not give") as refused:
            llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2, prompt_logprobs=1))
        assert refused.value.param == "prompt_logprobs"


@pytest.mark.parametrize("field", ["logprobs", "prompt_logprobs"])
def test_a_plan_without_text_tokens_refuses_both_kinds_of_log_probabilities(field):
    """Orpheus's LLM sends audio codes: `logprobs` ran and gave `Output.logprobs == []` (the torch
    engine; nothing said why), while `prompt_logprobs` was refused. Both are refused now, before
    the request runs, naming the field."""
    from mstar.runtime.serve.api import SamplingError

    with LLM(str(GENERATED / "orpheus.plan")) as llm:
        with pytest.raises(SamplingError, match=f"^{field} asks for what this plan does not give") as refused:
            llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2, **{field: 1}))
        assert refused.value.param == field
        assert llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2))[0].logprobs is None


@pytest.mark.parametrize("field, value, words", [
    ("logit_bias", {"5": 3.0}, "logit_bias would change nothing on this plan"),
    ("ignore_eos", True, "ignore_eos would change nothing on this plan"),
])
def test_a_plan_without_text_tokens_refuses_what_acts_on_text_tokens_only(field, value, words):
    """A logit bias and ignore_eos act on the calls that send text tokens (docs/engine.md): on
    Orpheus they were taken and the request ran as if it had not asked. Refused now, naming the
    field; ignore_eos false asks nothing and runs."""
    from mstar.runtime.serve.api import SamplingError

    with LLM(str(GENERATED / "orpheus.plan"), engine="sim") as llm:
        with pytest.raises(SamplingError, match=f"^{words}") as refused:
            llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2, **{field: value}))
        assert refused.value.param == field
        assert llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2, ignore_eos=False))[0].finish_reason == "length"


def test_a_hybrid_decoders_fast_path_gives_what_the_cpu_engine_gives():
    """The qwen3_5 plan (gated delta-net layers beside full attention; tiny dims): the scored
    prompt step runs eagerly with its linear layers' layout, on the fast path's runner on the CPU."""
    from fast_path_cpu import fast_path_engine, run_asks

    from mstar.plan.io import load_plan
    from mstar.runtime.engine.kv.slots import SlotPool
    from mstar.runtime.engine.torch_engine import TorchEngine

    plan = load_plan(str(GENERATED / "qwen3_5.plan"), verify=False)
    asks = [{"prompt_logprobs": 1}, {}, {"prompt_logprobs": 3}]
    reference = run_asks(plan, TorchEngine(plan, num_pages=64), asks, 12, 3)
    engine, _ = fast_path_engine(plan, 64, max_seq_len=4096, with_decode_family=False,
                                 slots=SlotPool("LLM", plan.nodes[0].recurrent.num_slots))
    fast = run_asks(plan, engine, asks, 12, 3)
    for request_id, expected in reference.items():
        found = fast[request_id]
        assert found.output_tokens == expected.output_tokens and found.finish_reason == "length"
        assert len(found.prompt_logprobs) == len(expected.prompt_logprobs) == (0 if request_id == "r1" else 12)
        for got, want in zip(found.prompt_logprobs[1:], expected.prompt_logprobs[1:]):
            assert got[0] == pytest.approx(want[0], abs=1e-4) and [t for t, _ in got[1]] == [t for t, _ in want[1]]


def test_a_chunks_entries_and_tail_over_several_slices_of_positions():
    """`chunk_logprobs` over 600 positions (three slices of POSITIONS_AT_ONCE) against one
    log_softmax of the whole chunk: every entry, the alternatives in order; the tail is the last
    position's row and owns only that row's storage (a view would keep a [256, vocab] block alive
    on the request between its chunks)."""
    import torch

    from mstar.runtime.engine.prompt_logprobs import POSITIONS_AT_ONCE, chunk_logprobs

    generator = torch.Generator().manual_seed(3)
    vocab, count = 50, 3
    hidden = torch.randn(600, 8, generator=generator)
    head = torch.randn(vocab, 8, generator=generator)
    tokens = torch.randint(0, vocab, (600,), generator=generator).tolist()
    previous_tail = torch.log_softmax(torch.randn(vocab, generator=generator), dim=-1)
    entries, tail = chunk_logprobs(lambda h: h @ head.T, hidden, tokens, previous_tail, count)
    whole = torch.log_softmax(hidden @ head.T, dim=-1)
    assert 600 > 2 * POSITIONS_AT_ONCE and len(entries) == 600
    expected_rows = [previous_tail] + [whole[p] for p in range(599)]  # entry p: given position p - 1
    for entry, row, token in zip(entries, expected_rows, tokens):
        own, top = entry
        assert own == pytest.approx(row[token].item(), abs=1e-5)
        assert [t for t, _ in top] == row.topk(count).indices.tolist()
    assert torch.allclose(tail, whole[-1], atol=1e-5)
    assert tail.untyped_storage().nbytes() == vocab * 4
    first, _ = chunk_logprobs(lambda h: h @ head.T, hidden[:1], tokens[:1], None, count)
    assert first == [None]  # a prompt's first token has nothing before it


def test_a_scoring_step_takes_the_smallest_piecewise_bucket_that_keeps_its_hidden_states():
    """`StepExecutor._path` of a step scoring a prompt: the smallest piecewise bucket holding its
    tokens whatever family the plan gave it, where the pieces keep every position's final hidden
    state; eagerly where they keep none, where its rows or tokens do not fit, or with
    `scores_on_pieces` off; a step scoring nothing keeps the plan's path (the stand-in has no
    graphs here: eager)."""
    from types import SimpleNamespace

    import torch
    from fast_path_cpu import fast_path_engine

    from mstar.plan.io import load_plan
    from mstar.runtime.engine.gpu.packing import RowSpec

    plan = load_plan(str(LLAMA), verify=False)
    _, runner = fast_path_engine(plan, 64)
    executor = runner.executor

    def rows(*lengths):
        return [RowSpec(list(range(1, n + 1)), 0, [0], index) for index, n in enumerate(lengths)]

    def path(step, is_scoring=True):
        return executor._path(step, "LLM:prefill", 32, 0, is_scoring)

    assert path(rows(14)) == (0, None, 0)  # no piecewise graphs: eager
    executor.piecewise = SimpleNamespace(hidden=torch.zeros(8192, 8), max_rows=16, token_buckets=[64, 128, 1024, 8192])
    assert path(rows(14)) == (0, None, 64)
    assert path(rows(100, 28)) == (0, None, 128)
    assert path(rows(129)) == (0, None, 1024)
    assert path(rows(8193)) == (0, None, 0)  # past the largest bucket
    assert path(rows(*[1] * 17)) == (0, None, 0)  # past the graphs' row entries
    assert path(rows(14), is_scoring=False)[2] == 0  # a plain step: the plan's family, not captured here
    executor.scores_on_pieces = False
    assert path(rows(14)) == (0, None, 0)
    executor.scores_on_pieces = True
    executor.piecewise.hidden = None  # pieces that keep no hidden states
    assert path(rows(14)) == (0, None, 0)
