"""`mstar run`'s process-wide GPU switches: `--no-blas-pdl`, the way back to ordinary edges into
cuBLAS's products (engine/gpu/blas_edges.py, on by default), and `--nucleus search`, the device
sampler's nucleus by the Triton kernels' search (the default, engine/gpu/sampler.py NUCLEUS) or
`--nucleus sort` by torch's sort, and `--penalties`, the penalties by two Triton kernels (the
default) or `torch` ops (engine/gpu/penalties.py PENALTIES). Each is refused off the GPU and set
before the engine is built, in this process and in every rank process (`RankOptions.blas_pdl`,
`.nucleus`, `.penalties`; left out, the module's default holds)."""
import argparse
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from mstar.cli import mstar as cli
from mstar.plan.io import load_plan
from mstar.runtime.engine import torch_engine
from mstar.runtime.engine.gpu import blas_edges, penalties, sampler
from mstar.runtime.serve.ranks import worker

ROOT = Path(__file__).resolve().parents[2]
PLAN = ROOT / "generated" / "llama.plan"
DEFAULT_NUCLEUS = sampler.NUCLEUS  # (as this process imported it)
DEFAULT_PENALTIES = penalties.PENALTIES


@pytest.fixture
def switches_seen(monkeypatch):
    """The engine's construction replaced by a recorder of the switches as they stood then."""
    seen: list[tuple[bool, str, str]] = []

    def record(*args, **kwargs):
        seen.append((blas_edges._enabled, sampler.NUCLEUS, penalties.PENALTIES))
        return "engine"

    monkeypatch.setattr(torch_engine, "build", record)
    monkeypatch.setattr(torch_engine, "TorchEngine", record)
    monkeypatch.setattr(torch_engine, "plan_glue", lambda plan, path, device: None)
    monkeypatch.setattr(worker, "RankExecutor", lambda plan, engine, channel: engine)
    yield seen
    blas_edges.set_enabled(blas_edges.ENABLED_BY_DEFAULT)
    sampler.set_nucleus(DEFAULT_NUCLEUS)
    penalties.set_penalties(DEFAULT_PENALTIES)


def cli_args(**switches):
    return argparse.Namespace(**{**dict(engine="torch", dims="tiny", device="cuda", seed=0, kv_pages=None,
                                        no_blas_pdl=False, nucleus=None, penalties=None), **switches})


def rank_args(**switches):
    return SimpleNamespace(**{**dict(dims="tiny", weights=None, seed=0, kv_pages=None, device="cuda",
                                     attention="auto", rank_timeout=8.0, plan=str(PLAN), no_blas_pdl=False,
                                     nucleus=None, penalties=None), **switches})


@pytest.mark.parametrize("flags", [["--no-blas-pdl"], ["--nucleus", "search"], ["--nucleus", "sort"],
                                   ["--penalties", "kernels"], ["--penalties", "torch"]])
def test_a_switch_off_the_gpu_is_refused(flags):
    result = subprocess.run([sys.executable, "-m", "mstar.cli.mstar", "run", "--plan", "generated/llama.plan",
                             "--requests", "1", *flags, "--no-progress"],
                            capture_output=True, text=True, cwd=ROOT)
    assert result.returncode == 1, result.stderr
    assert flags[0] in result.stderr and "cuda" in result.stderr and "Traceback" not in result.stderr


@pytest.mark.parametrize("switches, expected", [({}, (True, "search", "kernels")),
                                                ({"no_blas_pdl": True}, (False, "search", "kernels")),
                                                ({"nucleus": "sort"}, (True, "sort", "kernels")),
                                                ({"nucleus": "search"}, (True, "search", "kernels")),
                                                ({"penalties": "torch"}, (True, "search", "torch"))])
def test_the_switches_are_set_before_the_engine_is_built(switches_seen, switches, expected):
    assert cli._engine(load_plan(str(PLAN)), cli_args(**switches)) == "engine"
    assert switches_seen == [expected]


@pytest.mark.parametrize("blas_pdl, nucleus, way", [(True, "search", "kernels"), (False, "sort", "torch")])
def test_a_rank_process_takes_the_switches_from_its_options(switches_seen, blas_pdl, nucleus, way):
    blas_edges.set_enabled(not blas_pdl)  # whatever the process held before
    sampler.set_nucleus("sort" if nucleus == "search" else "search")
    penalties.set_penalties("torch" if way == "kernels" else "kernels")
    options = worker.RankOptions(device="cuda", plan_path=str(PLAN), blas_pdl=blas_pdl, nucleus=nucleus,
                                 penalties=way)
    worker.build_executor(load_plan(str(PLAN)), 0, options, None, "cuda:0", {})
    assert switches_seen == [(blas_pdl, nucleus, way)]


def test_mstar_run_hands_the_switches_to_the_ranks():
    options = cli._rank_options(rank_args(no_blas_pdl=True, nucleus="search", penalties="kernels"))
    assert options.blas_pdl is False and options.nucleus == "search" and options.penalties == "kernels"
    assert worker.RankOptions().blas_pdl is True and worker.RankOptions().nucleus is None
    assert cli._rank_options(rank_args()).nucleus is None  # (the rank's sampler keeps its default)
    assert worker.RankOptions().penalties is None and cli._rank_options(rank_args()).penalties is None


def test_the_search_is_the_default_nucleus_and_the_kernels_the_default_penalties():
    assert DEFAULT_NUCLEUS == "search" and DEFAULT_PENALTIES == "kernels"


def test_an_unknown_nucleus_is_refused():
    with pytest.raises(ValueError, match="sort, search"):
        sampler.set_nucleus("bubble")
    assert sampler.NUCLEUS == DEFAULT_NUCLEUS


def test_unknown_penalties_are_refused():
    with pytest.raises(ValueError, match="torch, kernels"):
        penalties.set_penalties("numpy")
    assert penalties.PENALTIES == DEFAULT_PENALTIES
