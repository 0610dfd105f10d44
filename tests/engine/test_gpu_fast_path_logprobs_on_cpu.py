"""Log-probabilities on the device fast path (`StepExecutor.collect_logprobs`), run on the CPU: a
request that asks for them gets, for every text token, the reference runner's numbers (the same
model's logits, another kernel order: within 1e-4) and the same alternatives, greedy or penalised,
whole prompts or chunks, beside requests that ask for none (which get none), run ahead or not."""
from __future__ import annotations

import pytest

from fast_path_cpu import fast_path_engine, run_asks
from mstar.plan.io import load_plan
from mstar.runtime.engine.torch_engine import TorchEngine
from test_prefix_cache import ROOT

ASKS = [dict(logprobs=3), dict(logprobs=0, repetition_penalty=1.3), dict(logprobs=5, presence_penalty=1.0),
        {}, dict(temperature=0.9, seed=5, logprobs=1)]
SAMPLED = "r4"  # the device sampler draws from its own hash: its tokens are not the reference's


def _run(plan, engine, asks, prompt_len, max_tokens=12):
    return {rid: (r.output_tokens, r.finish_reason, [r.emission_logprobs.get(i) for i in range(len(r.emission_values))])
            for rid, r in run_asks(plan, engine, asks, prompt_len, max_tokens).items()}


@pytest.mark.parametrize("plan_name, can_run_ahead", [("llama", False), ("llama", True), ("llama_chunked", True)])
def test_fast_path_logprobs_are_the_reference_runners(plan_name, can_run_ahead):
    plan = load_plan(ROOT / "generated" / f"{plan_name}.plan", verify=False)
    prompt_len = 40 if plan_name == "llama_chunked" else 6
    engine, _ = fast_path_engine(plan, 64, max_seq_len=4096, can_run_ahead=can_run_ahead)
    got = _run(plan, engine, ASKS, prompt_len)
    expected = _run(plan, TorchEngine(plan, num_pages=64), ASKS, prompt_len)
    for rid, (tokens, reason, logprobs) in got.items():
        assert reason == "length" and len(tokens) == 12, rid
        if ASKS[int(rid[1:])].get("logprobs") is None:
            assert logprobs == [None] * len(tokens), rid
            continue
        assert all(entry is not None for entry in logprobs), rid
        assert [len(entry[1]) for entry in logprobs] == [ASKS[int(rid[1:])]["logprobs"]] * len(tokens)
        if rid == SAMPLED:
            continue
        want_tokens, _, want = expected[rid]
        assert tokens == want_tokens, rid
        for (own, top), (want_own, want_top) in zip(logprobs, want):
            assert own == pytest.approx(want_own, abs=1e-4)
            assert [t for t, _ in top] == [t for t, _ in want_top]
            assert [v for _, v in top] == pytest.approx([v for _, v in want_top], abs=1e-4)


def test_steps_holding_logprobs_rows_run_ahead_and_keep_them():
    """A step launched ahead computes its rows' log-probabilities too, and the step that claims
    those rows answers them (`_Ahead.logprobs`): every token of every request has its own, the
    reference runner's, though most steps ran ahead."""
    plan = load_plan(ROOT / "generated" / "llama.plan", verify=False)
    engine, runner = fast_path_engine(plan, 64, max_seq_len=4096, can_run_ahead=True)
    asks = [dict(logprobs=1), dict(logprobs=2, logit_bias=[(9, 1.5)]), dict(logprobs=0, min_tokens=6)]
    got = _run(plan, engine, asks, 6)
    assert runner.num_ahead_rows > 0 and runner.num_claimed_rows > 0
    expected = _run(plan, TorchEngine(plan, num_pages=64), asks, 6)
    for rid, (tokens, _, logprobs) in got.items():
        assert tokens == expected[rid][0] and all(entry is not None for entry in logprobs)
        assert [own for own, _ in logprobs] == pytest.approx([own for own, _ in expected[rid][2]], abs=1e-4)


@pytest.mark.parametrize("can_run_ahead", [False, True])
def test_chunk_steps_in_columns_answer_every_rows_logprobs(can_run_ahead):
    """Steady rows done in columns beside other rows (prompt chunks, a prompt's last chunk, a
    request's first decode row: gpu/decode_columns.py's mixed steps), each asking for
    log-probabilities: every token gets the reference runner's, whichever of the step's parts (the
    columns, the other rows, the step launched ahead) sampled it."""
    from mstar.runtime.conductor.request import Request
    from mstar.runtime.serve.driver import Driver, Workload

    from mstar.runtime.serve.bench_kv import with_budget

    # a 16-token step budget cuts the long prompts into chunks beside the short ones' decode rows
    plan = with_budget(load_plan(ROOT / "generated" / "llama_chunked.plan", verify=False), 16)
    shapes = [(4, 16, 1), (40, 6, 2), (60, 5, 0), (9, 12, 3)]  # (prompt length, max_tokens, logprobs)

    def run(engine):
        driver = Driver(plan, engine)
        driver.run(Workload([Request(id=f"r{i}", prompt_tokens=[(11 * i + 3 * j) % 90 + 1 for j in range(length)],
                                     max_tokens=max_tokens, logprobs=count)
                             for i, (length, max_tokens, count) in enumerate(shapes)]))
        return {rid: (r.output_tokens, [r.emission_logprobs.get(i) for i in range(len(r.emission_values))])
                for rid, r in driver.conductor.records.items()}

    engine, runner = fast_path_engine(plan, 64, max_seq_len=4096, can_run_ahead=can_run_ahead)
    got, expected = run(engine), run(TorchEngine(plan, num_pages=64))
    for rid, (tokens, logprobs) in got.items():
        assert tokens == expected[rid][0] and all(entry is not None for entry in logprobs), rid
        assert [own for own, _ in logprobs] == pytest.approx([own for own, _ in expected[rid][1]], abs=1e-4), rid
        assert [[t for t, _ in top] for _, top in logprobs] == [[t for t, _ in top] for _, top in expected[rid][1]]
