"""The specs following the reference's other models run on the CPU engine at tiny dims:
Qwen3-TTS (audio through a left-context stream), Higgs-Audio (text, with an audio prefill),
Wan2.2 and Cosmos3 (stand-in image flows, each request denoising its own number of steps)."""
from pathlib import Path

import pytest

from mstar.plan.io import load_plan
from mstar.runtime.conductor.request import Request
from mstar.runtime.engine.torch_engine import TorchEngine
from mstar.runtime.serve.driver import Driver, Workload
from mstar.runtime.serve.media import is_audio, is_image

GENERATED = Path(__file__).resolve().parents[2] / "generated"


def run(name: str, requests: list[Request], node: str = "") -> tuple[dict, dict]:
    """Records by id, and per request the loop rows `node` ran (its flow steps)."""
    plan = load_plan(str(GENERATED / f"{name}.plan"))
    engine = TorchEngine(plan)
    steps: dict[str, int] = {}
    launch = engine.launch

    def counting(step):
        for row in step.rows:
            if step.node == node and row.loop_count:
                steps[row.request_id] = steps.get(row.request_id, 0) + 1
        return launch(step)

    engine.launch = counting  # type: ignore[method-assign]
    driver = Driver(plan, engine)
    driver.run(Workload(requests))
    records = driver.conductor.records
    for record in records.values():
        assert record.finish_reason in ("stop", "length", "done"), record.finish_reason
    return records, steps


def emitted(record, modality):
    return [e.value for e in record.emissions if e.modality == modality]


def test_qwen3_tts_speaks():
    records, _ = run("qwen3_tts", [Request(id="a", prompt_tokens=[1, 2, 3], max_tokens=40)])
    audio = emitted(records["a"], "audio")
    assert audio and all(is_audio(chunk) for chunk in audio)


def test_higgs_audio_transcribes_with_and_without_audio():
    records, _ = run("higgs_audio", [
        Request(id="audio", prompt_tokens=[1, 2], max_tokens=6, route={"LLM": ["prefill_text", "prefill_audio",
                                                                               "prefill_text", "decode"]}),
        Request(id="text", prompt_tokens=[3], max_tokens=4)])
    assert len(emitted(records["audio"], "text")) == 6 and len(emitted(records["text"], "text")) == 4


@pytest.mark.parametrize("name, route, count, default", [
    ("wan22", {"Wan": ["encode_text", "video_gen"]}, "num_inference_steps", 50),
    ("cosmos3", {"Cosmos": ["prefill", "image_gen"]}, "num_image_steps", 50),
])
def test_diffusion_stand_ins_denoise_each_requests_own_steps(name, route, count, default):
    node = "dit"
    records, steps = run(name, [
        Request(id="few", prompt_tokens=[1, 2, 3], max_tokens=4, route=route, loop_counts={count: 3}),
        Request(id="more", prompt_tokens=[4, 5], max_tokens=4, route=route, loop_counts={count: 5}),
        Request(id="default", prompt_tokens=[6], max_tokens=4, route=route)], node)
    assert steps == {"few": 3, "more": 5, "default": default}
    for record in records.values():
        images = emitted(record, "image")
        assert len(images) == 1 and is_image(images[0])


def test_wan22_image_to_video_and_cosmos3_video():
    records, _ = run("wan22", [Request(id="i2v", prompt_tokens=[1], max_tokens=4,
                                       loop_counts={"num_inference_steps": 2},
                                       route={"Wan": ["encode_text", "encode_image", "video_gen_i2v"]})])
    assert len(emitted(records["i2v"], "image")) == 1
    records, _ = run("cosmos3", [Request(id="v", prompt_tokens=[1, 2], max_tokens=4, guidance={"uncond": 1.0},
                                         loop_counts={"num_video_steps": 2},
                                         route={"Cosmos": ["prefill_cond_video", "video_gen"]})])
    assert len(emitted(records["v"], "image")) == 1
