"""`mstar bench kv` on a CUDA GPU (skipped without one): its engines draw their random weights with
the device's generator by default, `--reference-weights` keeps the CPU reference's host draws, and
the prefix scenario runs either way (the 2nd request starts on the 1st one's cached pages)."""
import json

import pytest
import torch

from mstar.runtime.engine.gpu import device_model
from mstar.runtime.serve import bench_kv

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]
PREFIX = ["--engine", "torch", "--device", "cuda", "--dims", "spec", "--scenario", "prefix",
          "--prefix-requests", "2", "--prefix-len", "256", "--prefix-rounds", "1", "--json"]


@pytest.fixture(autouse=True)
def reference_weights_after():
    """The switch is process-wide: the tests after these build decoders with the reference's draws."""
    yield
    device_model.set_random_on_device(False)


@pytest.mark.parametrize("extra, weights", [([], "device random"), (["--reference-weights"], "reference")])
def test_the_prefix_scenario_runs_with_either_weights(extra, weights, capsys):
    assert bench_kv.main(PREFIX + extra) == 0
    results = json.loads(capsys.readouterr().out)
    assert results["weights"] == weights
    assert device_model._draws_on_device == (weights == "device random")
    assert results["prefix"]["cached_tokens"][1] == 256
