"""Every node kind of the checked-in plans runs on the CPU with tiny dims: LLM tokens, the SNAC
codec's audio, encoders' embeddings, BAGEL's image flow and VAE image, Qwen3-Omni's Talker frames
and Code2Wav audio. Rows are built by hand (the conductor is not involved)."""
from pathlib import Path

import pytest
import torch

from engine_plans import step
from mstar.plan.io import load_plan
from mstar.runtime.engine.torch_engine import TorchEngine
from mstar.runtime.conductor.request import Request
from mstar.runtime.step import StepRow

GENERATED = Path(__file__).resolve().parents[2] / "generated"


def engine_for(name, **requests):
    plan_path = GENERATED / f"{name}.plan"
    if not plan_path.exists():
        pytest.skip(f"{plan_path} not generated")
    engine = TorchEngine(load_plan(str(plan_path)))
    for rid, prompt in (requests or {"r": [1, 2, 3]}).items():
        assert engine.add_request(rid, Request(id=rid, prompt_tokens=prompt, max_tokens=8, seed=7)) is None
    return engine


def run(engine, node, walk, inputs, rid="r"):
    result = engine.run_step(step(engine.plan, node, [StepRow(rid, walk, 1, 0, inputs)]))
    assert not result.allocation_failed and result.rows[0].error is None, result.rows[0].error
    return result.rows[0]


def test_orpheus_llm_tokens_and_snac_window_audio():
    engine = engine_for("orpheus")
    row = run(engine, "LLM", "prefill", {"text_inputs": [128259, 1, 2, 3]})
    assert isinstance(row.outputs["new_token"], list) and len(row.outputs["new_token"]) == 1
    audio = run(engine, "snac_decoder", "snac_chunk", {"new_token": list(range(28))}).outputs["audio_chunk"]
    # window(28, stride 7): one frame of 7 codes is kept, 32 samples per code with tiny dims
    assert audio.dtype == torch.int16 and audio.shape == (7 * 32,) and audio.abs().sum() > 0
    short = run(engine, "snac_decoder", "snac_chunk", {"new_token": list(range(10))}).outputs["audio_chunk"]
    assert short.shape == (7 * 32,)  # a short final window is padded to 28 codes


def test_bagel_encoders_image_flow_and_vae_decoder():
    engine = engine_for("bagel")
    emb = run(engine, "vit_encoder", "prefill_vit", {"image_inputs": None}).outputs["img_emb"]
    again = run(engine, "vit_encoder", "prefill_vit", {"image_inputs": None}).outputs["img_emb"]
    assert emb.shape == (8, 64) and torch.equal(emb, again)  # synthesised media is deterministic
    row = run(engine, "LLM", "prefill_vit", {"img_emb": emb})
    assert len(row.outputs["new_token"]) == 1
    pages_before = engine.runners["LLM"].pool.num_tokens(("r", "main"))
    flow = run(engine, "LLM", "image_gen", {"latents": None, "time_index": None})
    latents, time_index = flow.outputs["latents"], flow.outputs["time_index"]
    assert latents.shape == (16, 4) and time_index == 1
    flow = run(engine, "LLM", "image_gen", {"latents": latents, "time_index": time_index})
    assert flow.outputs["time_index"] == 2 and not torch.equal(flow.outputs["latents"], latents)
    assert engine.runners["LLM"].pool.num_tokens(("r", "main")) == pages_before  # flow reads KV only
    image = run(engine, "vae_decoder", "image_gen", {"latents": flow.outputs["latents"]}).outputs["image_output"]
    assert image.shape == (3, 32, 32) and 0 <= float(image.min()) and float(image.max()) <= 1


def test_qwen3_omni_encoders_thinker_talker_and_code2wav():
    engine = engine_for("qwen3_omni")
    audio = run(engine, "audio_encoder", "prefill_audio", {"audio_features": None, "audio_seqlens": None})
    vision = run(engine, "vision_encoder", "prefill_vision", {"pixel_values": None, "image_grid_thw": None})
    assert audio.outputs["audio_embeds"].shape == (8, 64)
    assert set(vision.outputs) == {"vision_embeds", "deepstack"}
    thinker = run(engine, "Thinker", "prefill_text", {"text_inputs": [1, 2, 3]})
    assert thinker.outputs["thinker_states"].shape == (3, 64) and thinker.outputs["thinker_mask"].all()
    run(engine, "Thinker", "prefill_vision", {"vision_embeds": vision.outputs["vision_embeds"],
                                              "deepstack": vision.outputs["deepstack"],
                                              "video_second_per_grid": None, "image_grid_thw": None})
    talker = run(engine, "Talker", "talker_last_prefill",
                 {"thinker_states": [thinker.outputs["thinker_states"]], "thinker_mask": [], "talker_trigger": None})
    frame = talker.outputs["codec_tokens"]
    assert frame.shape == (4,) and talker.outputs["talker_input_embeds"].shape == (1, 64)
    first = run(engine, "Code2Wav", "code2wav_chunk", {"codec_tokens": [frame] * 25}).outputs["audio_chunk"]
    later = run(engine, "Code2Wav", "code2wav_chunk", {"codec_tokens": [frame] * 50}).outputs["audio_chunk"]
    # left_context(chunk 25, context 25): the second chunk's 25 context frames are not decoded again
    assert first.shape == later.shape == (25 * 32,)


def test_qwen3_5_hybrid_llm_runs_with_recurrent_slots():
    engine = engine_for("qwen3_5")
    runner = engine.runners["LLM"]
    assert runner.dims.layer_is_full == (False, False, False, True) and runner.slots is not None
    row = run(engine, "LLM", "prefill_text", {"text_inputs": [5, 6, 7]})
    assert len(row.outputs["new_token"]) == 1 and runner.slots.slot_of("r") != 0


def test_every_checked_in_plan_builds_an_engine():
    plans = sorted(GENERATED.glob("*.plan"))
    if not plans:
        pytest.skip("no generated plans")
    for path in plans:
        engine = TorchEngine(load_plan(str(path)))
        assert set(engine.runners) == {node.name for node in engine.plan.nodes}


def test_a_requests_own_bad_input_is_flagged_apart_from_a_value_another_node_passed():
    """`values.RequestInputError`: audio the request brought that the encoder cannot take (2-D
    samples, more states than its `num_tokens`) fails the row flagged `is_input_fault`, which the
    server answers as a 400; latents of the wrong shape from another node fail it unflagged (a 500)."""
    engine = engine_for("qwen3_asr")
    for audio in (torch.zeros(2, 16000), torch.zeros(16000 * 31)):
        result = engine.run_step(step(engine.plan, "audio_encoder", [StepRow("r", "prefill", 1, 0,
                                                                            {"audio_features": audio})]))
        row = result.rows[0]
        assert row.error is not None and row.error.startswith("node audio_encoder: ") and row.is_input_fault
    engine = engine_for("bagel")
    result = engine.run_step(step(engine.plan, "vae_decoder", [StepRow("r", "image_gen", 1, 0,
                                                                      {"latents": torch.zeros(3, 3)})]))
    row = result.rows[0]
    assert row.error is not None and "latents of shape (3, 3)" in row.error and not row.is_input_fault


def _omni_audio_row(plan, features):
    """Qwen3-Omni's audio encoder's row on `features` (feature frames 16 wide at tiny dims)."""
    engine = TorchEngine(plan)
    assert engine.add_request("r", Request(id="r", prompt_tokens=[1, 2, 3], max_tokens=8, seed=7)) is None
    rows = [StepRow("r", "prefill_audio", 1, 0, {"audio_features": features})]
    return engine.run_step(step(plan, "audio_encoder", rows)).rows[0]


@pytest.mark.parametrize("shape", [(10, 7), (10,), (2, 3, 16)])
def test_a_stand_in_encoders_bad_media_is_the_clients_only_where_the_request_brought_it(shape):
    """The stateless stand-in encoder's media of a shape it cannot take (7 frames' width where it
    takes 16, one frame of 10, a 3-D tensor) failed the row as the deployment's fault, so the
    server answered the client's bad audio with a 500. Now the plan decides (`CallInfo.
    request_inputs`): Qwen3-Omni's `audio_features` takes the request's audio and nothing else, so
    the row is flagged `is_input_fault` (a 400); where an edge of the plan persists a value of that
    name (audio a codec made, which the conductor hands the input before the request's own), the
    same value is another node's and the deployment's fault (unflagged)."""
    plan = load_plan(str(GENERATED / "qwen3_omni.plan"))
    features = torch.zeros(shape)
    own = _omni_audio_row(plan, features)
    assert own.error is not None and own.error.startswith("node audio_encoder: ") and own.is_input_fault
    assert run(engine_for("qwen3_omni"), "audio_encoder", "prefill_audio",
               {"audio_features": torch.zeros(10, 16)}).outputs  # the width it takes runs
    codec = plan.model_copy(deep=True)
    call = next(c for w in codec.walks for c in w.calls if c.node == "Code2Wav")
    made = call.edges[0].model_copy(update={"name": "audio_features", "is_persist": True})
    call.edges.append(made)  # the codec's audio persisted under the encoder's input name
    other = _omni_audio_row(codec, features)
    assert other.error == own.error and not other.is_input_fault
    fed = plan.model_copy(deep=True)  # an edge of the walk fills the input (a run slot): not the request's
    audio = next(c for w in fed.walks if w.name == "prefill_audio" for c in w.calls if c.node == "audio_encoder")
    index = next(k for k, i in enumerate(audio.inputs) if i.name == "audio_features")
    audio.inputs[index] = audio.inputs[index].model_copy(update={"slots": [0]})
    assert not _omni_audio_row(fed, features).is_input_fault
