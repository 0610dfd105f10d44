"""vLLM's `ignore_eos` and `min_tokens`: with the node's stop token one the tiny model samples,
ignore_eos runs a request past it to max_tokens (a stop_token_ids entry still stops it), and
min_tokens keeps every stop token (the node's and the request's) from being sampled before that
many tokens, then lets it stop; the GPU fast path's runner (on the CPU) gives the reference
runner's tokens for both; bad values are refused before anything runs."""
from __future__ import annotations

import pytest

from fast_path_cpu import fast_path_engine
from plan_variants import compiled
from mstar.plan.io import load_plan
from mstar.runtime.engine.torch_engine import TorchEngine
from mstar.runtime.serve.api import LLM, SamplingError, SamplingParams
from test_prefix_cache import ROOT

PROMPT = [1, 2, 3]


@pytest.fixture(scope="module")
def plan_path(tmp_path_factory):
    """specs/llama.mw with its stop token one the tiny model picks second from PROMPT (greedy)."""
    with LLM(str(ROOT / "generated" / "llama.plan")) as llm:
        second = llm.generate([PROMPT], SamplingParams(max_tokens=2))[0].token_ids[1]
    folder = tmp_path_factory.mktemp("stops")
    spec = folder / "llama.mw"
    text = (ROOT / "specs" / "llama.mw").read_text()
    spec.write_text(text.replace("stop_tokens=[128001, 128008, 128009]", f"stop_token={second}"))
    return str(compiled(spec, ROOT / "configs" / "llama.yaml", folder)), second


@pytest.fixture(scope="module")
def llm(plan_path):
    with LLM(plan_path[0]) as served:
        yield served


def test_ignore_eos_samples_past_the_nodes_stop_token(llm, plan_path):
    stop = plan_path[1]
    plain = llm.generate([PROMPT], SamplingParams(max_tokens=6))[0]
    assert plain.token_ids[-1] == stop and len(plain.token_ids) == 2 and plain.finish_reason == "stop"
    ignored = llm.generate([PROMPT], SamplingParams(max_tokens=6, ignore_eos=True))[0]
    assert ignored.finish_reason == "length" and len(ignored.token_ids) == 6 and ignored.token_ids[1] == stop
    asked = llm.generate([PROMPT], SamplingParams(max_tokens=6, ignore_eos=True, stop_token_ids=[stop]))[0]
    assert asked.token_ids == plain.token_ids and asked.finish_reason == "stop"


def test_min_tokens_holds_every_stop_token_back_until_then(llm, plan_path):
    stop = plan_path[1]
    held = llm.generate([PROMPT], SamplingParams(max_tokens=8, min_tokens=4))[0]
    assert len(held.token_ids) >= 4 and stop not in held.token_ids[:4]
    own = held.token_ids[2]  # a request's own stop token is held back too
    again = llm.generate([PROMPT], SamplingParams(max_tokens=8, min_tokens=4, stop_token_ids=[own]))[0]
    assert own not in again.token_ids[:4] and len(again.token_ids) >= 4
    assert llm.generate([PROMPT], SamplingParams(max_tokens=8, min_tokens=1))[0].token_ids[:2] == [
        held.token_ids[0], stop]  # past min_tokens the stop token comes as before


@pytest.mark.parametrize("settings, words", [(dict(min_tokens=9), "min_tokens must be in [0, max_tokens (8)]"),
                                             (dict(min_tokens=-1), "min_tokens must be in"),
                                             (dict(ignore_eos=1), "ignore_eos must be true or false")])
def test_bad_values_are_refused(llm, settings, words):
    with pytest.raises(SamplingError) as refused:
        llm.generate([PROMPT], SamplingParams(max_tokens=8, **settings))
    assert words in str(refused.value)


def test_the_fast_path_gives_the_references_tokens(plan_path):
    from mstar.runtime.conductor.request import Request
    from mstar.runtime.serve.driver import Driver, Workload

    plan, stop = load_plan(plan_path[0], verify=False), plan_path[1]
    with LLM(plan_path[0]) as llm:  # past the node's stop token: its fifth token ends r4 at once past min_tokens
        fifth = llm.generate([PROMPT], SamplingParams(max_tokens=6, ignore_eos=True))[0].token_ids[4]
    asks = [dict(ignore_eos=True), dict(min_tokens=5), {}, dict(min_tokens=3, ignore_eos=True, logit_bias=[(7, 2.0)]),
            dict(ignore_eos=True, stop_tokens=[fifth], min_tokens=4)]

    def run(engine):
        driver = Driver(plan, engine)
        driver.run(Workload([Request(id=f"r{i}", prompt_tokens=PROMPT, max_tokens=9, **ask)
                             for i, ask in enumerate(asks)]))
        return {rid: (r.output_tokens, r.finish_reason) for rid, r in driver.conductor.records.items()}

    engine, runner = fast_path_engine(plan, 64, max_seq_len=4096, can_run_ahead=True)
    got, expected = run(engine), run(TorchEngine(plan, num_pages=64))
    assert got == expected and runner.num_claimed_rows > 0  # (min_tokens' masks count a step launched ahead's)
    assert got["r4"][1] == "stop" and len(got["r4"][0]) == 5
    assert got["r2"] == (got["r2"][0][:1] + [stop], "stop")  # the node's stop token, second
    assert got["r0"][1] == "length" and got["r0"][0][1] == stop  # sampled past it
    assert len(got["r1"][0]) >= 5 and stop not in got["r1"][0][:5]


def test_the_decode_columns_apply_the_additions_and_ignore_eos(plan_path, monkeypatch):
    """Steady decode steps in columns (gpu/decode_columns.py; they took the per-row path before)
    with every row's logit_bias forcing the node's stop token: ignore_eos runs past it to the
    length, min_tokens holds it back that many tokens, a plain row stops at once, run ahead or not,
    the reference runner's tokens. Dropping the columns' calls (no additions there) or their
    ignore_eos rule fails it."""
    from mstar.runtime.conductor.request import Request
    from mstar.runtime.engine.gpu import runner as gpu_runner
    from mstar.runtime.serve.driver import Driver, Workload

    plan, stop = load_plan(plan_path[0], verify=False), plan_path[1]
    forced = [(stop, 100.0)]
    asks = [dict(ignore_eos=True, logit_bias=forced), dict(min_tokens=6, logit_bias=forced), dict(logit_bias=forced),
            dict(ignore_eos=True), {}]
    steady_steps = []
    start_steady = gpu_runner.start_steady
    monkeypatch.setattr(gpu_runner, "start_steady", lambda *args: steady_steps.append(1) or start_steady(*args))

    def run(engine):
        driver = Driver(plan, engine)
        driver.run(Workload([Request(id=f"r{i}", prompt_tokens=[4 + i, 5, 6], max_tokens=10, **ask)
                             for i, ask in enumerate(asks)]))
        return {rid: (r.output_tokens, r.finish_reason) for rid, r in driver.conductor.records.items()}

    expected = run(TorchEngine(plan, num_pages=64))
    for can_run_ahead in (False, True):
        steady_steps.clear()
        assert run(fast_path_engine(plan, 64, max_seq_len=4096, can_run_ahead=can_run_ahead)[0]) == expected
        assert len(steady_steps) >= 5, can_run_ahead  # the rows' later steps went through the columns
    assert expected["r0"] == ([stop] * 10, "length")
    assert expected["r1"][1] == "stop" and len(expected["r1"][0]) == 7 and stop not in expected["r1"][0][:6]
    assert expected["r2"] == ([stop], "stop")


def test_min_tokens_holds_a_stop_string_back_too(tmp_path):
    """vLLM's rule: a stop string counts only where it ends past the first min_tokens tokens' text,
    in the conductor's stop check and in the text the API (and `mstar run`) gives."""
    import sys

    sys.path.insert(0, str(ROOT / "tests" / "serve"))
    from serve_harness import write_tokenizer

    with LLM(str(ROOT / "generated" / "llama.plan"), tokenizer=str(write_tokenizer(tmp_path / "tok"))) as llm:
        free = llm.generate([PROMPT], SamplingParams(max_tokens=8))[0]
        word = llm.tokenizer.decode([free.token_ids[1]])
        stopped = llm.generate([PROMPT], SamplingParams(max_tokens=8, stop=[word]))[0]
        held = llm.generate([PROMPT], SamplingParams(max_tokens=8, stop=[word], min_tokens=3))[0]
    assert stopped.finish_reason == "stop" and word not in stopped.text
    assert held.token_ids[:3] == free.token_ids[:3] and word in held.text
    assert len(held.token_ids) > 3
