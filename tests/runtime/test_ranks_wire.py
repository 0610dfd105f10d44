"""Messages between rank processes are plain data: steps, results and requests survive the wire
encoding field for field (tensors by value, numpy arrays, tuples, nested lists), anything without
a plain-data rule is refused by name, the controller's KV homes say which rows must move, and an
engine that loses a rank (`EngineLost`) stops the run loop instead of failing one step."""
from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
import torch

from mstar.runtime.conductor.request import Request
from mstar.runtime.serve.ranks.kv_homes import KvHomes
from mstar.runtime.serve.ranks.wire import (
    WireError, decode_request, decode_result, decode_step, decode_value, encode_request, encode_result,
    encode_step, encode_value,
)
from mstar.runtime.engine.sim import SimEngine
from mstar.runtime.serve.driver import Driver
from mstar.runtime.serve.workload import generate
from mstar.runtime.step import EngineLost, RowResult, Step, StepResult, StepRow
from mstar.plan.io import load_plan
from lost_rank import LosesARank
from runtime_plans import ROOT


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, np.ndarray):
        return isinstance(b, np.ndarray) and a.dtype == b.dtype and np.array_equal(a, b)
    if isinstance(a, float) and math.isnan(a):
        return isinstance(b, float) and math.isnan(b)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    return type(a) is type(b) and a == b


VALUES = [
    None, True, 7, -1.5, "text", [1, 2, 3], (4, [5]), {"a": [1], "b": None}, float("inf"), float("nan"),
    torch.arange(6).reshape(2, 3), torch.randn(3, 4), torch.ones(2, dtype=torch.bool),
    torch.randn(2, 2).to(torch.bfloat16), torch.tensor(3), [torch.zeros(0), torch.randn(1, 8)],
    np.arange(5, dtype=np.int16),
]


@pytest.mark.parametrize("value", VALUES, ids=[type(v).__name__ + str(i) for i, v in enumerate(VALUES)])
def test_values_cross_by_value(value):
    tensors: list = []
    obj = encode_value(value, tensors)
    assert _same(value, decode_value(obj, tensors))


@pytest.mark.parametrize("value", [object(), {1: "x"}, {"a": lambda: 0}, {3.5}])
def test_values_without_a_plain_rule_are_refused(value):
    with pytest.raises(WireError, match="cannot cross ranks"):
        encode_value(value, [])


def test_a_step_crosses_without_the_conductor_handle():
    rows = [StepRow("r1", "decode", 1, 12, {"text_inputs": None}, loop_iter=3, handle=object()),
            StepRow("r2", "prefill", 5, 0, {"text_inputs": [1, 2, 3, 4, 5], "hidden": torch.randn(5, 8)})]
    step = Step(worker=1, key="LLM:mixed", node="LLM", mask=3, label=None, rows=rows, attention="split",
                capture="LLM:mixed", padded_batch=4, token_bucket=128, is_speculative=True)
    tensors: list = []
    back = decode_step(encode_step(step, tensors), tensors)
    for f in dataclasses.fields(Step):
        if f.name != "rows":
            assert getattr(back, f.name) == getattr(step, f.name), f.name
    for sent, got in zip(step.rows, back.rows):
        assert got.handle is None
        for f in dataclasses.fields(StepRow):
            if f.name != "handle":
                assert _same(getattr(sent, f.name), getattr(got, f.name)), f.name


def test_results_and_requests_cross_field_for_field():
    result = StepResult(rows=[RowResult("r1", {"new_token": [5], "states": torch.randn(1, 4)}, is_stop=True),
                              RowResult("r2", error="boom"), RowResult("r4")],
                        allocation_failed=["r3"], elapsed_s=0.25)
    logprobs = (-0.5, ((5, -0.5), (7, -1.25)))  # a TokenLogprobs (step.py): plain tuples, set where asked for
    result.rows[0].logprobs, result.rows[1].logprobs = logprobs, (float("-inf"), ())
    tensors: list = []
    back = decode_result(encode_result(result, tensors), tensors)
    assert back.allocation_failed == ["r3"] and back.elapsed_s == 0.25
    assert [(r.request_id, r.is_stop, r.error) for r in back.rows] == [("r1", True, None), ("r2", False, "boom"),
                                                                        ("r4", False, None)]
    assert _same(back.rows[0].outputs, result.rows[0].outputs)
    assert [r.logprobs for r in back.rows] == [logprobs, (float("-inf"), ()), None]
    result.rows[2].prompt_logprobs = [None, logprobs]  # a prompt's: its first token has none
    back = decode_result(encode_result(result, tensors := []), tensors)
    assert [r.prompt_logprobs for r in back.rows] == [None, None, [None, logprobs]]
    request = Request("q", [1, 2], 9, temperature=0.5, seed=3, stop_tokens=[7], stop_strings=["x"], logprobs=4,
                      prompt_logprobs=2,
                      guidance={"cfg": 2.0}, route={"LLM": ["prefill", "decode"]},
                      media={"image": np.zeros((2, 2), dtype=np.uint8)}, arrival_s=1.5)
    tensors = []
    got = decode_request(encode_request(request, tensors), tensors)
    for f in dataclasses.fields(Request):
        assert _same(getattr(request, f.name), getattr(got, f.name)), f.name


def test_kv_homes_move_a_request_to_the_instance_that_runs_its_next_walk():
    plan = load_plan(str(ROOT / "generated" / "orpheus_pd_disaggregated.plan"))
    homes = KvHomes(plan)
    prefill = Step(0, "LLM:prefill", "LLM", 1, "prefill",
                   [StepRow("a", "prefill", 4, 0), StepRow("b", "prefill", 4, 0)], "prefill")
    assert homes.moves(prefill, (0,)) == []
    homes.settle(prefill, (0,), StepResult(rows=[], allocation_failed=["b"]), [])
    decode = Step(1, "LLM:decode", "LLM", 1, "decode", [StepRow("a", "decode", 1, 4), StepRow("b", "decode", 1, 0)],
                  "decode")
    assert homes.moves(decode, (1,)) == [("a", (0,))]  # b never ran anywhere: nothing to move
    homes.settle(decode, (1,), StepResult(rows=[]), ["a"])
    assert homes.moves(decode, (1,)) == []
    snac = Step(0, "snac_decoder:snac_chunk", "snac_decoder", 1, "snac_chunk",
                [StepRow("a", "snac_chunk", 28, 0)], "none")
    assert homes.moves(snac, (0,)) == []  # a stateless node has no KV
    homes.forget("a")
    assert homes.home == {("b", "LLM"): (1,)}


def test_a_lost_engine_leaves_the_run_and_every_request_in_it_fails_with_its_message():
    plan = load_plan(str(ROOT / "generated" / "orpheus.plan"))
    driver = Driver(plan, LosesARank(plan))
    workload = generate(12, prompt_len=(4, 8), output_len=(20, 20), concurrency=4, seed=0)
    with pytest.raises(EngineLost):
        driver.run(workload)
    active = list(driver.conductor.active)
    assert active  # requests were mid-run when the rank went
    driver.fail_active("rank 1 was killed by SIGKILL (during its step 10)")
    assert not driver.conductor.active
    failed = [r for r in driver.conductor.records.values() if r.finish_reason.startswith("error")]
    assert sorted(r.request.id for r in failed) == sorted(active)
    assert all("rank 1 was killed" in r.finish_reason for r in failed)


class _LosesARankOnAdmission(SimEngine):
    """The simulated engine, until it admits its sixth request: then a rank is gone (it froze
    while the request was being added on every rank)."""

    def add_request(self, request_id, request):
        self.num_added = getattr(self, "num_added", 0) + 1
        if self.num_added == 6:
            raise EngineLost("rank 1 hangs: no progress within the rank timeout (after its step 9)")
        return super().add_request(request_id, request)


def test_a_rank_lost_while_a_request_is_admitted_fails_that_request_too():
    """The request being added when the rank went is neither waiting nor running: it fails with
    the loss's message like the running ones (it was left unfinished, and the run's report named
    no failed request when the loss came during an admission)."""
    plan = load_plan(str(ROOT / "generated" / "orpheus.plan"))
    driver = Driver(plan, _LosesARankOnAdmission(plan))
    workload = generate(12, prompt_len=(4, 8), output_len=(20, 20), concurrency=4, seed=0)
    with pytest.raises(EngineLost):
        driver.run(workload)
    driver.fail_active("rank 1 hangs: no progress within the rank timeout (after its step 9)")
    records = driver.conductor.records.values()
    assert all(r.is_finished for r in records)
    failed = [r for r in records if r.finish_reason.startswith("error")]
    assert failed and all("rank 1 hangs" in r.finish_reason for r in failed)
