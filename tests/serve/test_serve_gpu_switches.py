"""`mstar serve`'s process-wide GPU switches, as `mstar run`'s (tests/runtime/test_run_gpu_switches.py):
`--no-blas-pdl` (the way back to ordinary edges into cuBLAS's products), `--nucleus` (the device
sampler's nucleus by search or by sort) and `--penalties` (torch ops or the Triton kernels); each
refused off the GPU with one error line, and set before the engine is built."""
from pathlib import Path

import pytest

from mstar.runtime.engine.gpu import blas_edges, penalties, sampler
from mstar.runtime.serve import api, server

ROOT = Path(__file__).resolve().parents[2]
PLAN = str(ROOT / "generated" / "llama.plan")
DEFAULTS = (blas_edges.ENABLED_BY_DEFAULT, sampler.NUCLEUS, penalties.PENALTIES)


@pytest.fixture
def switches_seen(monkeypatch):
    """LLM's construction replaced by a recorder of the switches as they stood then."""
    seen: list[tuple[bool, str, str]] = []

    class Recorder:
        def __init__(self, plan, **kwargs):
            seen.append((blas_edges._enabled, sampler.NUCLEUS, penalties.PENALTIES))
            raise server.SetupError("recorded")

    monkeypatch.setattr(api, "LLM", Recorder)
    yield seen
    blas_edges.set_enabled(DEFAULTS[0])
    sampler.set_nucleus(DEFAULTS[1])
    penalties.set_penalties(DEFAULTS[2])


@pytest.mark.parametrize("flags", [["--no-blas-pdl"], ["--nucleus", "sort"], ["--penalties", "kernels"]])
@pytest.mark.parametrize("options", [["--engine", "sim"], ["--device", "cpu"]], ids=["sim", "cpu"])
def test_a_switch_off_the_gpu_is_refused(capsys, switches_seen, flags, options):
    assert server.main(["--plan", PLAN, *flags, *options]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and flags[0] in err and "cuda" in err and "Traceback" not in err
    assert switches_seen == []  # refused before anything was built


@pytest.mark.parametrize("flags, expected", [([], DEFAULTS), (["--no-blas-pdl"], (False, *DEFAULTS[1:])),
                                             (["--nucleus", "sort"], (DEFAULTS[0], "sort", DEFAULTS[2])),
                                             (["--penalties", "kernels"], (*DEFAULTS[:2], "kernels"))])
def test_the_switches_are_set_before_the_engine_is_built(switches_seen, flags, expected):
    with pytest.raises(server.SetupError, match="recorded"):
        server.build(server.parser().parse_args(["--plan", PLAN, "--device", "cuda", *flags]))
    assert switches_seen == [expected]
