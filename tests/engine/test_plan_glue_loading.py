"""Every way of starting the torch engine off the CPU hands it the plan's generated glue: `mstar
run` (`torch_engine.build`), `mstar serve` and the Python API (`engine_setup.build_engine`), and a
rank process (`ranks.worker.build_executor`). On the CPU, or for a plan with no path, none."""
from pathlib import Path
from types import SimpleNamespace

import pytest

from mstar.plan.io import load_plan
from mstar.runtime.engine import torch_engine
from mstar.runtime.engine.torch_engine import EngineError, plan_glue
from mstar.runtime.serve import engine_setup
from mstar.runtime.serve.ranks import worker

PLAN = Path(__file__).resolve().parents[2] / "generated" / "llama.plan"


@pytest.fixture
def built(monkeypatch):
    """TorchEngine replaced by a recorder of its keyword arguments (no model is built)."""
    calls: list[dict] = []

    def record(plan, **kwargs):
        calls.append(kwargs)
        return SimpleNamespace(plan=plan)

    monkeypatch.setattr(torch_engine, "TorchEngine", record)
    return calls


def test_the_glue_is_loaded_off_the_cpu_only():
    plan = load_plan(str(PLAN))
    assert plan_glue(plan, str(PLAN), "cpu") is None
    assert plan_glue(plan, None, "cuda") is None
    glue = plan_glue(plan, str(PLAN), "cuda")
    assert glue is not None and "LLM:mixed" in glue.GLUE_BY_WORKER[0]


def test_a_missing_glue_file_is_a_clear_refusal(tmp_path):
    plan = load_plan(str(PLAN))
    moved = tmp_path / "llama.plan"
    moved.write_bytes(PLAN.read_bytes())
    with pytest.raises(EngineError, match="run `mstarc regen`"):
        plan_glue(plan, str(moved), "cuda")


def test_run_serve_and_ranks_pass_the_glue(built, monkeypatch):
    plan = load_plan(str(PLAN))
    torch_engine.build(plan, SimpleNamespace(plan=str(PLAN), device="cuda"))
    engine_setup.build_engine(plan, "torch", device="cuda", plan_path=str(PLAN))
    engine_setup.build_engine(plan, "torch", device="cpu", plan_path=str(PLAN))
    monkeypatch.setattr(worker, "RankExecutor", lambda plan, engine, channel: engine)
    worker.build_executor(plan, 0, worker.RankOptions(device="cuda", plan_path=str(PLAN)), None, "cuda:0", {})
    assert [call["glue"] is not None for call in built] == [True, True, False, True]
