"""`mstar serve --no-blas-pdl`: as `mstar run`'s flag (tests/runtime/test_run_gpu_switches.py), the
way back to ordinary edges into cuBLAS's products; refused off the GPU with one error line, and set
before the engine is built."""
from pathlib import Path

import pytest

from mstar.runtime.engine.gpu import blas_edges
from mstar.runtime.serve import api, server

ROOT = Path(__file__).resolve().parents[2]
PLAN = str(ROOT / "generated" / "llama.plan")


@pytest.fixture
def switch_seen(monkeypatch):
    """LLM's construction replaced by a recorder of the switch as it stood then."""
    seen: list[bool] = []

    class Recorder:
        def __init__(self, plan, **kwargs):
            seen.append(blas_edges._enabled)
            raise server.SetupError("recorded")

    monkeypatch.setattr(api, "LLM", Recorder)
    yield seen
    blas_edges.set_enabled(blas_edges.ENABLED_BY_DEFAULT)


@pytest.mark.parametrize("options", [["--engine", "sim"], ["--device", "cpu"]], ids=["sim", "cpu"])
def test_no_blas_pdl_off_the_gpu_is_refused(capsys, switch_seen, options):
    assert server.main(["--plan", PLAN, "--no-blas-pdl", *options]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--no-blas-pdl" in err and "cuda" in err and "Traceback" not in err
    assert switch_seen == []  # refused before anything was built


@pytest.mark.parametrize("no_blas_pdl", [False, True], ids=["default", "no-blas-pdl"])
def test_the_switch_is_set_before_the_engine_is_built(switch_seen, no_blas_pdl):
    argv = ["--plan", PLAN, "--device", "cuda"] + (["--no-blas-pdl"] if no_blas_pdl else [])
    with pytest.raises(server.SetupError, match="recorded"):
        server.build(server.parser().parse_args(argv))
    assert switch_seen == [not no_blas_pdl]
