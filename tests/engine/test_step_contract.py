"""The torch engine runs the step it is given: the step's attention route picks the attention path,
and a step that disagrees with its plan row (key, mask, rows, label, route, capture bucket, token
budget) is refused with an error naming the field, before anything runs; the simulated engine
refuses the same steps (a what-if run finds what the real engine would refuse)."""
from __future__ import annotations

from pathlib import Path

import pytest

from engine_plans import step
from mstar.plan.io import load_plan
from mstar.plan.schema import Plan
from mstar.runtime.conductor.request import Request
from mstar.runtime.engine.attention import routes
from mstar.runtime.engine.sim import SimEngine
from mstar.runtime.engine.step_check import StepContractError
from mstar.runtime.engine.torch_engine import TorchEngine
from mstar.runtime.step import StepRow

GENERATED = Path(__file__).resolve().parents[2] / "generated"


def generated(name: str) -> Plan:
    return load_plan(GENERATED / f"{name}.plan", verify=False)


def _orpheus(mixed_route: str = "split") -> Plan:
    data = generated("orpheus").model_dump(mode="json", by_alias=True)
    for worker in data["workers"]:
        for key in worker["keys"]:
            for entry in key["mixtures"]:
                if len(entry["walks"]) > 1:
                    entry["attention"] = mixed_route
    return Plan.model_validate(data)


def _engine(plan: Plan, engine_class=TorchEngine):
    engine = engine_class(plan)
    for rid in ("a", "b"):
        assert engine.add_request(rid, Request(id=rid, prompt_tokens=[1, 2, 3], max_tokens=8)) is None
    return engine


def _prefill(rid: str) -> StepRow:
    return StepRow(rid, "prefill", 3, 0, {"text_inputs": [1, 2, 3]})


def _spy(monkeypatch) -> list[str]:
    calls: list[str] = []
    for name in ("decode_attention", "prefill_attention", "split_attention", "packed_attention"):
        original = getattr(routes, name)

        def spy(*args, _name=name, _original=original):
            calls.append(_name.split("_")[0])
            return _original(*args)
        monkeypatch.setattr(routes, name, spy)
    return calls


@pytest.mark.parametrize("route, paths", [("split", {"split", "decode", "prefill"}), ("packed", {"packed"})])
def test_the_steps_route_picks_the_attention_path(monkeypatch, route, paths):
    plan = _orpheus(route)
    engine = _engine(plan)
    token = engine.run_step(step(plan, "LLM", [_prefill("a")])).rows[0].outputs["new_token"]
    calls = _spy(monkeypatch)
    mixed = step(plan, "LLM", [_prefill("b"), StepRow("a", "decode", 1, 3, {"text_inputs": token})])
    assert mixed.attention == route
    result = engine.run_step(mixed)
    assert all(row.error is None for row in result.rows) and len(result.rows) == 2
    assert set(calls) == paths  # one call per full-attention layer and path
    # The route changes which kernels run, never the numbers: both routes give the same tokens.
    calls.clear()
    decode_only = engine.run_step(step(plan, "LLM", [StepRow("b", "decode", 1, 3, {"text_inputs": [5]})]))
    assert set(calls) == {"decode"} and decode_only.rows[0].error is None


def test_split_and_packed_give_the_same_tokens():
    outputs = []
    for route in ("split", "packed"):
        plan = _orpheus(route)
        engine = _engine(plan)
        token = engine.run_step(step(plan, "LLM", [_prefill("a")])).rows[0].outputs["new_token"]
        mixed = step(plan, "LLM", [_prefill("b"), StepRow("a", "decode", 1, 3, {"text_inputs": token})])
        outputs.append([row.outputs["new_token"] for row in engine.run_step(mixed).rows])
    assert outputs[0] == outputs[1]


def test_a_route_of_none_on_a_kv_step_is_refused():
    plan = generated("orpheus")
    engine = _engine(plan)
    bad = step(plan, "LLM", [_prefill("a")])
    bad.attention = "none"
    with pytest.raises(StepContractError, match="attention route none on a step of kv node LLM"):
        engine.run_step(bad)
    assert engine.runners["LLM"].pool.num_free_pages == engine.runners["LLM"].pool.num_pages  # nothing ran


def _refused(edit, match, plan: Plan | None = None):
    """On both engines."""
    plan = plan or generated("orpheus")
    for engine_class in (TorchEngine, SimEngine):
        engine = _engine(plan, engine_class)
        bad = step(plan, "LLM", [_prefill("a"), _prefill("b")])
        edit(bad)
        with pytest.raises(StepContractError, match=match):
            engine.run_step(bad)


def test_rows_past_the_step_token_budget_are_refused():
    """Two rows of 3 tokens on a key whose budget is 5 (one row alone may pass a budget: a row that
    cannot be cut runs alone)."""
    data = generated("orpheus").model_dump(mode="json", by_alias=True)
    for worker in data["workers"]:
        for key in worker["keys"]:
            key["token_budget"] = 5
    _refused(lambda s: None, r"tokens: 6 tokens, past the key's token_budget 5", Plan.model_validate(data))


def test_a_padded_size_that_is_not_captured_is_refused():
    def edit(s):
        s.capture, s.padded_batch, s.token_bucket = "LLM:prefill", 3, 32
    _refused(edit, r"padded_batch 3 for 2 rows is not a captured batch size of LLM:prefill")


def test_a_padded_size_below_the_rows_is_refused():
    def edit(s):
        s.capture, s.padded_batch, s.token_bucket = "LLM:prefill", 1, 32
    _refused(edit, r"padded_batch 1 for 2 rows")


def test_a_token_bucket_that_is_not_captured_or_too_small_is_refused():
    def uncaptured(s):
        s.capture, s.padded_batch, s.token_bucket = "LLM:prefill", 2, 48
    _refused(uncaptured, r"token_bucket 48 for 6 tokens is not a token bucket")

    def too_small(s):
        s.capture, s.padded_batch, s.token_bucket = "LLM:prefill", 2, 0
    _refused(too_small, r"token_bucket 0 for 6 tokens")


def test_a_capture_the_mixture_does_not_replay_is_refused():
    def edit(s):
        s.capture, s.padded_batch = "LLM:decode", 2
    _refused(edit, r"capture 'LLM:decode' with padded_batch 2, the plan's mixture replays 'LLM:prefill'")


def test_a_mask_that_is_not_a_mixture_or_disagrees_with_the_rows_is_refused():
    def absent(s):
        s.mask = 4
    _refused(absent, r"mask 4 is not a mixture of the key")

    def wrong_walks(s):
        s.mask, s.label, s.attention = 2, "decode", "decode"
    _refused(wrong_walks, r"mask 2: rows of walk prefill, which the mixture \['decode'\] does not hold")


def test_rows_past_the_cap_and_a_wrong_label_or_route_are_refused():
    def over_cap(s):
        s.rows = [StepRow(f"r{i}", "prefill", 1, 0, {"text_inputs": [1]}) for i in range(17)]
    _refused(over_cap, r"rows: 17 rows, past the mixture's cap 16")

    def label(s):
        s.label = "decode"
    _refused(label, r"label 'decode', the plan's mixture has 'prefill'")

    def route(s):
        s.attention = "packed"
    _refused(route, r"attention 'packed', the plan's mixture \['prefill'\] has 'prefill'")

    def key(s):
        s.key = "LLM:nothing"
    _refused(key, r"key: worker 0 has no scheduling key 'LLM:nothing'")


def test_a_row_past_a_batched_captures_tokens_per_row_is_refused():
    def edit(s):
        s.rows = [StepRow("a", "decode", 2, 3, {"text_inputs": [1, 2]})]
        s.mask, s.label, s.attention = 2, "decode", "decode"
        s.capture, s.padded_batch, s.token_bucket = "LLM:decode", 1, 0
    _refused(edit, r"request a feeds 2 tokens, past the 1 tokens a row of batched capture LLM:decode holds")


def test_a_mixed_step_on_a_key_that_combines_nothing_is_refused():
    data = generated("orpheus").model_dump(mode="json", by_alias=True)
    data["workers"][0]["keys"][0]["is_combined"] = False
    plan = Plan.model_validate(data)
    engine = _engine(plan)
    mixed = step(plan, "LLM", [_prefill("b"), StepRow("a", "decode", 1, 3, {"text_inputs": [1]})])
    with pytest.raises(StepContractError, match="which combines no walks"):
        engine.run_step(mixed)
