"""The GPU placement plumbing (mstar/runtime/engine/placement.py), exercised on the CPU: a model wrapped in
`OnDevice` (arguments moved in, results moved back to host fp32, methods delegated) gives exactly
the unwrapped reference's tokens. The GPU itself is tested in tests/gpu/."""
import pytest
import torch

from engine_plans import generate, hybrid_plan, llm_plan
from mstar.runtime.engine.torch_engine import EngineError, TorchEngine
from mstar.runtime.engine.placement import CPU, OnDevice, resolve_device, to_host

PROMPTS = {"a": [5, 6, 7, 8, 9], "b": [3, 1], "c": [11, 12, 13]}


@pytest.mark.filterwarnings("ignore:CUDA is not available")
@pytest.mark.parametrize("make_plan", [llm_plan, hybrid_plan])
def test_wrapped_models_give_the_reference_tokens(make_plan, monkeypatch):
    reference = generate(TorchEngine(make_plan()), PROMPTS, 6, start_every=1)
    # autocast("cuda") is disabled on a machine without CUDA, so the wrapped run is fp32 too
    monkeypatch.setattr(TorchEngine, "_place", lambda self, model: OnDevice(model, CPU))
    wrapped = generate(TorchEngine(make_plan()), PROMPTS, 6, start_every=1)
    assert wrapped == reference


def test_to_host_returns_fp32_and_keeps_integers():
    out = to_host({"x": torch.ones(2, dtype=torch.bfloat16), "n": [torch.tensor([1], dtype=torch.int16)]})
    assert out["x"].dtype == torch.float32 and out["n"][0].dtype == torch.int16


def test_device_names():
    assert resolve_device("cpu") is CPU
    with pytest.raises(ValueError, match="not a device name"):
        resolve_device("gpu0")
    with pytest.raises(ValueError, match="only cpu and cuda"):
        resolve_device("meta")
    if not torch.cuda.is_available():
        with pytest.raises(EngineError, match="no CUDA GPU"):
            TorchEngine(llm_plan(), device="cuda")
        with pytest.raises(EngineError, match="FlashInfer needs a CUDA device"):
            TorchEngine(llm_plan(), attention="flashinfer")
    with pytest.raises(EngineError, match="--attention 'fast'"):
        TorchEngine(llm_plan(), attention="fast")
