"""A step of several requests that raises for one request's sake fails that request alone: the
driver runs each row of the failed step again in a step of its own (`Driver._isolate`, on the nodes
of `EngineCaps.rerun_nodes`), and the others finish with the tokens they have in a run without
the bad request (the torch runner puts their history and counts back: `RequestState.rewind`). A
node with recurrent state (Qwen3.5's gated delta-net) is left out: its failed step still fails
every request in it (docs/runtime.md "Failures and cancellation")."""
from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

from hypothesis import given, settings, strategies as st

from mstar.plan.io import load_plan
from mstar.runtime.conductor.request import Request
from mstar.runtime.engine.runners.decoder import DecoderRunner
from mstar.runtime.engine.sim import SimEngine
from mstar.runtime.serve.driver import Driver
from mstar.runtime.serve.engine_setup import build_engine
from mstar.runtime.serve.workload import Workload

ROOT = Path(__file__).resolve().parents[2]
BAD = "bad"


class RaisesForBad(DecoderRunner):
    """A decoder runner that raises while making the outputs of request `bad`'s row: after the
    forward wrote every row's KV and sampled every row's token (their histories and counts moved)."""

    def _outputs(self, item: Any, *args: Any, **kwargs: Any) -> Any:
        if item.row.request_id == BAD:
            raise RuntimeError("boom for bad")
        return super()._outputs(item, *args, **kwargs)


def _requests(with_bad: bool) -> list[Request]:
    # sampled, with a repetition penalty: a row whose fed tokens were counted twice samples otherwise
    requests = [Request(id=f"g{i}", prompt_tokens=[1 + i, 2, 3, 4], max_tokens=10, temperature=0.8, seed=i,
                        repetition_penalty=1.3) for i in range(5)]
    if with_bad:
        requests.insert(2, Request(id=BAD, prompt_tokens=[7, 8, 9], max_tokens=10))
    return requests


def _torch_run(plan_name: str, node: str, with_bad: bool) -> tuple[Any, dict[str, tuple[str, list]]]:
    plan = load_plan(ROOT / "generated" / f"{plan_name}.plan")
    engine = build_engine(plan, "torch")
    if with_bad:
        engine.runners[node].__class__ = RaisesForBad  # the same runner, its outputs raising for `bad`
    requests = _requests(with_bad)
    driver = Driver(plan, engine)
    driver.run(Workload(requests))  # all arrive at once: `bad` shares its steps with the others
    records = driver.conductor.records
    return engine, {r.id: (str(records[r.id].finish_reason), list(records[r.id].output_tokens)) for r in requests}


def test_one_requests_failure_fails_it_alone_and_the_others_keep_their_tokens():
    _, alone = _torch_run("llama", "LLM", with_bad=False)
    engine, together = _torch_run("llama", "LLM", with_bad=True)
    assert "LLM" in engine.caps.rerun_nodes
    assert together.pop(BAD)[0] == "error: engine failed the step: RuntimeError: boom for bad"
    assert together == alone  # each finished, with the same tokens as without `bad`


def test_a_node_with_recurrent_state_fails_the_whole_step_as_before():
    """Qwen3.5's gated delta-net state moved a token in the failed step: run again, a row would
    start from a state one token on, so the step's requests fail as they always did."""
    engine, together = _torch_run("qwen3_5", "LLM", with_bad=True)
    assert "LLM" not in engine.caps.rerun_nodes
    reasons = {reason for reason, _ in together.values()}
    assert reasons == {"error: engine failed the step: RuntimeError: boom for bad"}


class RaisesFor:
    """A simulated engine whose launch raises for a step holding any of `bad` (run alone too), or,
    with `only_mixed`, only where a bad request shares the step with another (alone it runs)."""

    def __init__(self, plan: Any, bad: set[str], only_mixed: bool = False):
        self.inner = SimEngine(plan)
        self.caps, self.bad, self.only_mixed = self.inner.caps, bad, only_mixed
        self.num_raised = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def launch(self, step: Any) -> Any:
        ids = {row.request_id for row in step.rows}
        if ids & self.bad and not (self.only_mixed and len(ids) == 1):
            self.num_raised += 1
            raise ValueError("no step for you")
        return self.inner.launch(step)

    def wait(self, handle: Any) -> Any:
        return self.inner.wait(handle)


def _sim_run(plan_name: str, requests: list[Request], bad: set[str], only_mixed: bool = False,
             concurrency: Optional[int] = None) -> tuple[RaisesFor, dict[str, tuple[str, list]]]:
    plan = load_plan(ROOT / "generated" / f"{plan_name}.plan")
    engine = RaisesFor(plan, bad, only_mixed)
    driver = Driver(plan, engine)
    driver.run(Workload(requests, closed_concurrency=concurrency))
    records = driver.conductor.records
    return engine, {r.id: (str(records[r.id].finish_reason), list(records[r.id].output_tokens)) for r in requests}


@settings(max_examples=20, deadline=None)
@given(lengths=st.lists(st.tuples(st.integers(1, 40), st.integers(1, 12)), min_size=2, max_size=8),
       bad=st.sets(st.integers(0, 7), max_size=3), plan_name=st.sampled_from(["llama", "llama_chunked", "orpheus"]),
       concurrency=st.sampled_from([None, 2, 4]))
def test_only_the_requests_whose_steps_raise_fail(lengths, bad, plan_name, concurrency):
    requests = [Request(id=f"r{i}", prompt_tokens=[1 + i] * length, max_tokens=num)
                for i, (length, num) in enumerate(lengths)]
    bad_ids = {f"r{i}" for i in bad if i < len(requests)}
    _, clean = _sim_run(plan_name, requests, set(), concurrency=concurrency)
    _, run = _sim_run(plan_name, requests, bad_ids, concurrency=concurrency)
    for request_id, (reason, tokens) in run.items():
        if request_id in bad_ids:
            assert reason == "error: engine failed the step: ValueError: no step for you", (request_id, reason)
        else:
            assert (reason, tokens) == clean[request_id], request_id


def test_a_step_that_raises_only_in_company_fails_no_one():
    requests = [Request(id=f"r{i}", prompt_tokens=[1 + i, 2, 3], max_tokens=8) for i in range(4)]
    _, clean = _sim_run("llama", requests, set())
    engine, run = _sim_run("llama", requests, {"r1"}, only_mixed=True)
    assert engine.num_raised >= 1 and run == clean
