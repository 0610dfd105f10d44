"""A GPU fast path that cannot start (FlashInfer's kernel build fails, CUDA runs out of memory at
graph capture) is an EngineError naming the node and the cause, which the CLI prints as one line,
not an internal error."""
import pytest
import torch

from mstar.plan.io import load_plan
from mstar.runtime.engine import torch_engine
from mstar.runtime.engine.gpu import setup
from mstar.runtime.engine.placement import Placement

from pathlib import Path

PLAN = Path(__file__).resolve().parents[2] / "generated" / "llama.plan"


def test_a_failed_kernel_build_is_an_engine_error(monkeypatch):
    engine = torch_engine.TorchEngine(load_plan(PLAN, verify=False))

    def failing(*args, **kwargs):
        raise RuntimeError("Ninja build failed. Ninja output:\nfatal error: flashinfer/page.cuh: No such file")

    monkeypatch.setattr(setup, "fast_runner", failing)
    # a CUDA placement (nothing touches the device: the fast runner is the failing stand-in)
    monkeypatch.setattr(engine, "placement", Placement(torch.device("cuda")))
    node = engine.plan.nodes[0]
    with pytest.raises(torch_engine.EngineError) as raised:
        engine._fast_gpu_runner(node, engine.runners[node.name].dims, None, 0, None, "tiny")
    message = str(raised.value)
    assert message.startswith(f"node {node.name}: the GPU fast path could not start")
    assert "Ninja build failed" in message and "\n" not in message
