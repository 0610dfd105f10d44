"""Plan fields with a reader in the run loop: capture memory and TP groups in the run report,
`is_async` gating speculation."""
from __future__ import annotations

from mstar.plan.schema import Plan
from mstar.runtime.conductor.request import Request
from mstar.runtime.engine.sim import SimEngine
from mstar.runtime.serve.driver import Driver, Workload
from mstar.runtime.serve.plan_summary import plan_summary

from runtime_plans import generated


def test_the_run_report_carries_capture_memory_and_tp_groups():
    plan = generated("orpheus_tp2")
    summary = plan_summary(plan)
    worker = summary["workers"]["0"]
    decode = worker["captures"]["LLM:decode"]
    family = next(c for k in plan.workers[0].keys for c in k.captures if c.name == "LLM:decode")
    assert decode["num_graphs"] == family.num_graphs == len(family.batch_sizes)
    assert worker["capture_memory_mib"] == round(plan.workers[0].capture_memory_bytes / 2**20, 3)
    group = worker["tp_groups"][0]
    assert (group["node"], group["tp_size"], group["sp_size"], group["ranks"]) == ("LLM", 2, 1, [0, 1])
    assert summary["tp_nodes"] == ["LLM"]


def _speculative_steps(plan: Plan) -> int:
    driver = Driver(plan, SimEngine(plan))
    driver.run(Workload([Request(id=f"r{i}", prompt_tokens=[1, 2, 3], max_tokens=16) for i in range(4)]))
    assert all(r.finish_reason in ("stop", "length") for r in driver.conductor.records.values())
    return sum(driver.log.is_speculative)


def test_a_node_that_is_not_async_never_speculates():
    plan = generated("orpheus")
    assert _speculative_steps(plan) > 0
    data = plan.model_dump(mode="json", by_alias=True)
    for node in data["nodes"]:
        node["is_async"] = False
    assert _speculative_steps(Plan.model_validate(data)) == 0
