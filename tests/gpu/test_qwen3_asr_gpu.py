"""Qwen3-ASR (generated/qwen3_asr.plan, a tiny random checkpoint in the published layout) on a CUDA
GPU: the LLM takes the general runner (two inputs: not the fast path), the audio states replace
its prompt's placeholders on the device, and greedy tokens follow the CPU run (the first agree;
later ones may drift with rounding). Skipped without a GPU (CI has none)."""
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "engine"))
from qwen3_asr_checkpoint import AUDIO_PAD, save_tiny_qwen3_asr  # noqa: E402

from mstar.plan.io import load_plan  # noqa: E402
from mstar.runtime.conductor.request import Request  # noqa: E402
from mstar.runtime.engine.models.qwen3_asr import num_states  # noqa: E402
from mstar.runtime.engine.torch_engine import TorchEngine  # noqa: E402
from mstar.runtime.serve.driver import Driver, Workload  # noqa: E402

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]
PLAN = Path(__file__).resolve().parents[2] / "generated" / "qwen3_asr.plan"


def test_qwen3_asr_on_the_gpu_follows_the_cpu(tmp_path):
    pytest.importorskip("transformers.models.qwen3_asr")
    save_tiny_qwen3_asr(tmp_path)
    plan = load_plan(str(PLAN))
    samples = torch.from_numpy((0.1 * np.random.default_rng(0).standard_normal(32000)).astype(np.float32))
    prompt = [151644, 41, 151669] + [AUDIO_PAD] * num_states(32000) + [151670, 151645, 151644, 42]
    tokens = {}
    for device in ("cpu", "cuda"):
        driver = Driver(plan, TorchEngine(plan, weights_dir=str(tmp_path), device=device))
        driver.run(Workload([Request(id="r", prompt_tokens=prompt, max_tokens=6, media={"audio": samples})]))
        record = driver.conductor.records["r"]
        assert record.finish_reason == "length", record.finish_reason
        tokens[device] = [e.value[0] for e in record.emissions]
    assert tokens["cpu"][0] == tokens["cuda"][0], tokens
