"""`batching WALK same RULE...` end to end: compiled into KeyPlan.batch_rules, read by the
scheduler through the conductor's batch classes, so rows of different shapes never share a step."""
import pytest
from spec_text import plan_of

from mstar.lang.diagnostics import Diagnostics
from mstar.lang.fmt import format_spec
from mstar.lang.parser import parse
from mstar.runtime.conductor.request import Request
from mstar.runtime.engine.torch_engine import TorchEngine
from mstar.runtime.serve.driver import Driver, Workload

SPEC = """model ruled
node LLM kv(layers=1, kv_heads=2, qo_heads=2, head_dim=8, hidden=16, vocab=64) {
    in text_inputs: tokens prompt text
    out text_inputs: tokens
    out new_token: tokens
    RULESbatching prefill same shape
}
walk prefill {
    LLM(text_inputs) -> new_token: client text persist
}
walk decode {
    loop decode_loop max=3 {
        LLM(text_inputs) -> text_inputs: LLM -> new_token: client text
    }
}
partition P = prefill -> decode
"""
CONFIG = "model: ruled\nmax_seq_len: 64\nnode_groups:\n  - node_names: [LLM]\n    ranks: [0]\n"


def prefill_steps(tmp_path, rules: str) -> list[list[int]]:
    plan = plan_of(tmp_path, SPEC.replace("RULES", rules), CONFIG)
    engine = TorchEngine(plan)
    steps = []
    launch = engine.launch

    def recording(step):
        if step.rows and step.rows[0].walk == "prefill":
            steps.append([row.num_tokens for row in step.rows])
        return launch(step)

    engine.launch = recording  # type: ignore[method-assign]
    driver = Driver(plan, engine)
    driver.run(Workload([Request(id=f"r{i}", prompt_tokens=[1] * n, max_tokens=8) for i, n in enumerate([2, 3, 2])]))
    assert all(r.finish_reason in ("done", "stop", "length") for r in driver.conductor.records.values())
    return steps


def test_rows_of_different_shapes_never_share_a_step(tmp_path):
    steps = prefill_steps(tmp_path / "with", "")
    assert sorted(steps) == [[2, 2], [3]]


def test_without_the_rule_they_do(tmp_path):
    steps = prefill_steps(tmp_path / "without", "#")
    assert steps == [[2, 3, 2]]


def test_the_plan_carries_the_rules(tmp_path):
    plan = plan_of(tmp_path, SPEC.replace("RULES", ""), CONFIG)
    key = plan.workers[0].keys[0]
    assert key.batch_rules == {"prefill": ["shape"]}


@pytest.mark.parametrize("line", ["batching prefill same shape", "batching image_gen same shape, iteration, guidance"])
def test_batching_round_trips_through_the_formatter(line):
    text = f"model m\n\nnode N kv {{\n    {line}\n}}\n"
    spec = parse(text, "m.mw", Diagnostics())
    assert spec is not None and format_spec(spec) == text
