"""Every checked-in spec runs end to end through the conductor, scheduler and torch engine on the
CPU with tiny dims: llama and qwen3_5 text, orpheus WAV audio, bagel a PNG image, qwen3_omni text and
audio. Media are written with mstar.runtime.serve.media as `mstar run --out` does."""
import wave
from pathlib import Path

import numpy as np
import pytest
import torch

from mstar.plan.io import load_plan
from mstar.runtime.serve.driver import Driver, Workload
from mstar.runtime.engine.torch_engine import TorchEngine
from mstar.runtime.serve.media import is_audio, is_image, write_png, write_wav
from mstar.runtime.conductor.request import Request

GENERATED = Path(__file__).resolve().parents[2] / "generated"


def run_plan(name, requests):
    path = GENERATED / f"{name}.plan"
    if not path.exists():
        pytest.skip(f"{path} not generated")
    plan = load_plan(str(path))
    driver = Driver(plan, TorchEngine(plan))
    driver.run(Workload(requests))
    records = driver.conductor.records
    for record in records.values():
        assert record.finish_reason in ("stop", "length", "done"), record.finish_reason
    return records


def emitted(record, modality):
    return [e.value for e in record.emissions if e.modality == modality]


@pytest.mark.parametrize("name", ["llama", "qwen3_5"])
def test_text_llms(name):
    requests = [Request(id=f"r{i}", prompt_tokens=[i + 1, 7, 9][: i + 1], max_tokens=6) for i in range(3)]
    records = run_plan(name, requests)
    for record in records.values():
        assert emitted(record, "text")


def test_orpheus_writes_wav(tmp_path):
    records = run_plan("orpheus", [Request(id="a", prompt_tokens=[128259, 5, 6], max_tokens=40),
                                   Request(id="b", prompt_tokens=[128259, 9], max_tokens=30)])
    for rid, record in records.items():
        chunks = emitted(record, "audio")
        assert chunks and all(is_audio(c) for c in chunks)
        num_samples = write_wav(tmp_path / f"{rid}.wav", chunks)
        with wave.open(str(tmp_path / f"{rid}.wav")) as wav:
            assert wav.getnframes() == num_samples > 0 and wav.getsampwidth() == 2


def test_bagel_writes_png(tmp_path):
    records = run_plan("bagel", [
        Request(id="img", prompt_tokens=[1, 2, 3], max_tokens=4,
                route={"LLM": ["prefill_vit", "prefill_text", "image_gen"]}),
        Request(id="txt", prompt_tokens=[4, 5], max_tokens=4),
    ])
    images = emitted(records["img"], "image")
    assert len(images) == 1 and is_image(images[0])
    assert write_png(tmp_path / "img.png", images[0]) == (32, 32)
    from PIL import Image

    with Image.open(tmp_path / "img.png") as png:  # RGB, as generated (matplotlib's imsave added an alpha channel)
        assert png.mode == "RGB" and png.size == (32, 32)
        want = (images[0].permute(1, 2, 0) if images[0].shape[0] == 3 else images[0]).clamp(0, 1) * 255
        assert (torch.tensor(np.asarray(png), dtype=torch.float32) - want.float()).abs().max() <= 0.5 + 1e-3
    assert (tmp_path / "img.png").read_bytes()[:4] == b"\x89PNG"
    assert emitted(records["txt"], "text")


def test_qwen3_omni_text_and_audio():
    records = run_plan("qwen3_omni", [Request(id="r", prompt_tokens=[1, 2, 3], max_tokens=2)])
    record = records["r"]
    assert emitted(record, "text")
    audio = emitted(record, "audio")
    assert audio and all(is_audio(c) for c in audio) and sum(c.numel() for c in audio) > 0


def test_small_kv_pool_holds_and_retries_and_an_oversized_request_fails_alone():
    path = GENERATED / "llama.plan"
    if not path.exists():
        pytest.skip("llama plan not generated")
    plan = load_plan(str(path))
    page_size = next(p.page_size for p in plan.deployment.kv_pools if p.node == "LLM")
    # Room for about two requests at a time; eight requests arrive together; one can never fit.
    num_pages = 2 * -(-(4 + 12) // page_size)
    engine = TorchEngine(plan, num_pages=num_pages)
    failed = []
    original = engine.wait

    def spy(handle):
        result = original(handle)
        failed.extend(result.allocation_failed)
        return result

    engine.wait = spy
    requests = [Request(id=f"r{i}", prompt_tokens=[i + 1] * 4, max_tokens=12) for i in range(8)]
    requests.append(Request(id="huge", prompt_tokens=[1] * (num_pages * page_size), max_tokens=8))
    driver = Driver(plan, engine)
    driver.run(Workload(requests))
    records = driver.conductor.records
    assert failed, "the small pool never filled up"
    assert records["huge"].finish_reason.startswith("error") and "can never fit" in records["huge"].finish_reason
    roomy = Driver(plan, TorchEngine(plan))
    roomy.run(Workload(requests[:8]))
    for i in range(8):
        assert records[f"r{i}"].finish_reason == "length"
        # held and retried rows lose nothing: the same tokens as with a roomy pool
        assert emitted(records[f"r{i}"], "text") == emitted(roomy.conductor.records[f"r{i}"], "text")
