"""`capture ... eager_above`: steps of more rows than the largest captured batch size run
eagerly by intent, so a cap above it compiles (MW405 otherwise) and such steps run; without it
the engine refuses an eager step above the family's buckets."""
import pytest
from spec_text import plan_of, run

from mstar.lang.diagnostics import Diagnostics
from mstar.lang.fmt import format_spec
from mstar.lang.parser import parse
from mstar.runtime.conductor.request import Request
from mstar.runtime.engine.step_check import StepChecker, StepContractError
from mstar.runtime.step import Step, StepRow

SPEC = """model eager
node LLM kv(layers=1, kv_heads=2, qo_heads=2, head_dim=8, hidden=16, vocab=64) {
    in text_inputs: tokens prompt text
    out text_inputs: tokens
    out new_token: tokens
    cap prefill 8
    capture prefill packed batch=[1, 2] tokens=[8, 16]EAGER
}
walk prefill {
    LLM(text_inputs) -> new_token: client text
}
partition P = prefill
"""
CONFIG = "model: eager\nmax_seq_len: 64\nnode_groups:\n  - node_names: [LLM]\n    ranks: [0]\n"


def test_a_cap_above_the_capture_needs_eager_above(tmp_path):
    with pytest.raises(AssertionError, match="MW405"):
        plan_of(tmp_path, SPEC.replace("EAGER", ""), CONFIG)


def test_steps_above_the_largest_bucket_run_eagerly(tmp_path):
    plan = plan_of(tmp_path, SPEC.replace("EAGER", " eager_above"), CONFIG)
    family = plan.workers[0].keys[0].captures[0]
    assert family.is_eager_above and plan.workers[0].keys[0].mixtures[1].cap == 8
    records = run(plan, [Request(id=f"r{i}", prompt_tokens=[1, 2], max_tokens=4) for i in range(5)])
    assert all(r.finish_reason in ("done", "stop", "length") for r in records.values())


def test_without_eager_above_an_eager_step_above_the_buckets_is_refused(tmp_path):
    plan = plan_of(tmp_path, SPEC.replace("EAGER", " eager_above"), CONFIG)
    data = plan.model_dump(mode="json")
    data["workers"][0]["keys"][0]["captures"][0]["is_eager_above"] = False
    checker = StepChecker(type(plan).model_validate(data))
    key = plan.workers[0].keys[0]
    rows = [StepRow(f"r{i}", "prefill", 2, 0) for i in range(3)]
    with pytest.raises(StepContractError, match="no `eager_above`"):
        checker.check(Step(worker=0, key=key.name, node="LLM", mask=1, label="prefill", rows=rows,
                           attention=key.mixtures[1].attention))
    StepChecker(plan).check(Step(worker=0, key=key.name, node="LLM", mask=1, label="prefill", rows=rows,
                                 attention=key.mixtures[1].attention))


def test_eager_above_round_trips_through_the_formatter():
    text = "model m\n\nnode N kv {\n    capture d batched batch=[1, 2] eager_above\n}\n"
    spec = parse(text, "m.mw", Diagnostics())
    assert spec is not None and spec.nodes[0].captures[0].is_eager_above and format_spec(spec) == text


