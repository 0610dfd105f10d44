"""`mstar run --no-blas-pdl`: the way back to ordinary edges into cuBLAS's products
(engine/gpu/blas_edges.py, on by default). Refused off the GPU; set before the engine is built, in
this process and in every rank process (`RankOptions.blas_pdl`)."""
import argparse
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from mstar.cli import mstar as cli
from mstar.plan.io import load_plan
from mstar.runtime.engine import torch_engine
from mstar.runtime.engine.gpu import blas_edges
from mstar.runtime.serve.ranks import worker

ROOT = Path(__file__).resolve().parents[2]
PLAN = ROOT / "generated" / "llama.plan"


@pytest.fixture
def switch_seen(monkeypatch):
    """The engine's construction replaced by a recorder of the switch as it stood then."""
    seen: list[bool] = []
    monkeypatch.setattr(torch_engine, "build", lambda plan, args: seen.append(blas_edges._enabled) or "engine")
    monkeypatch.setattr(torch_engine, "TorchEngine", lambda plan, **kwargs: seen.append(blas_edges._enabled))
    monkeypatch.setattr(torch_engine, "plan_glue", lambda plan, path, device: None)
    monkeypatch.setattr(worker, "RankExecutor", lambda plan, engine, channel: engine)
    yield seen
    blas_edges.set_enabled(blas_edges.ENABLED_BY_DEFAULT)


def test_no_blas_pdl_on_the_cpu_is_refused():
    result = subprocess.run([sys.executable, "-m", "mstar.cli.mstar", "run", "--plan", "generated/llama.plan",
                             "--requests", "1", "--no-blas-pdl", "--no-progress"],
                            capture_output=True, text=True, cwd=ROOT)
    assert result.returncode == 1, result.stderr
    assert "--no-blas-pdl" in result.stderr and "cuda" in result.stderr and "Traceback" not in result.stderr


@pytest.mark.parametrize("no_blas_pdl", [False, True], ids=["default", "no-blas-pdl"])
def test_the_switch_is_set_before_the_engine_is_built(switch_seen, no_blas_pdl):
    args = argparse.Namespace(engine="torch", dims="tiny", device="cuda", seed=0, kv_pages=None,
                              no_blas_pdl=no_blas_pdl)
    assert cli._engine(load_plan(str(PLAN)), args) == "engine"
    assert switch_seen == [not no_blas_pdl]


@pytest.mark.parametrize("blas_pdl", [True, False])
def test_a_rank_process_takes_the_switch_from_its_options(switch_seen, blas_pdl):
    blas_edges.set_enabled(not blas_pdl)  # whatever the process held before
    options = worker.RankOptions(device="cuda", plan_path=str(PLAN), blas_pdl=blas_pdl)
    worker.build_executor(load_plan(str(PLAN)), 0, options, None, "cuda:0", {})
    assert switch_seen == [blas_pdl]


def test_mstar_run_hands_the_flag_to_the_ranks():
    args = SimpleNamespace(dims="tiny", weights=None, seed=0, kv_pages=None, device="cuda", attention="auto",
                           rank_timeout=8.0, plan=str(PLAN), no_blas_pdl=True)
    assert cli._rank_options(args).blas_pdl is False
    assert worker.RankOptions().blas_pdl is True
