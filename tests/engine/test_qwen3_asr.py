"""Qwen3-ASR on the CPU engine against transformers' `qwen3_asr` (tests/engine/qwen3_asr_checkpoint.py).

The front end against Qwen3ASRFeatureExtractor as its processor calls it; the audio encoder and
projector loaded from a save_pretrained directory against `get_audio_features` (clips under a
second, across chunks and across attention windows); `mstar run --plan generated/qwen3_asr.plan`
on a WAV file against `generate` (greedy), token for token and in the decoded text; the prompt's
placeholder repeated once per state; refusals.
"""
from __future__ import annotations

import json
import wave
from pathlib import Path

import numpy as np
import pytest
import torch

from mstar.cli.mstar import main
from mstar.plan.io import load_plan
from mstar.runtime.engine.checkpoint_config import WeightsError
from mstar.runtime.engine.models import qwen3_asr
from mstar.runtime.engine.qwen3_asr_setup import encoder_runner
from mstar.runtime.serve.audio_prompt import AudioPromptError, audio_layout_of, expand
from qwen3_asr_checkpoint import AUDIO_PAD, FRAME, save_tiny_qwen3_asr

pytest.importorskip("transformers.models.qwen3_asr")
ROOT = Path(__file__).resolve().parents[2]
PLAN = ROOT / "generated" / "qwen3_asr.plan"


def clip(seconds: float, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    t = np.arange(int(seconds * 16000)) / 16000
    return (0.3 * np.sin(2 * np.pi * 220 * t) + 0.05 * rng.standard_normal(t.shape)).astype(np.float32)


def extract(samples: np.ndarray):
    from transformers.models.qwen3_asr.feature_extraction_qwen3_asr import Qwen3ASRFeatureExtractor

    return Qwen3ASRFeatureExtractor()(samples, sampling_rate=16000, padding=True, truncation=False,
                                      return_attention_mask=True)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    directory = tmp_path_factory.mktemp("qwen3_asr")
    return directory, save_tiny_qwen3_asr(directory)


@pytest.mark.parametrize("seconds", [0.2, 1.0, 2.37, 9.05])
def test_front_end_matches_the_feature_extractor(seconds):
    samples = clip(seconds)
    expected = extract(samples)
    feats, num_valid = qwen3_asr.features(torch.from_numpy(samples), 128)
    assert feats.shape == expected["input_features"].shape[1:]
    assert num_valid == int(expected["attention_mask"].sum()) == qwen3_asr.num_frames(len(samples))
    assert torch.allclose(feats, expected["input_features"][0], atol=1e-5)
    assert qwen3_asr.num_states(len(samples)) == _states_of(expected["attention_mask"].sum(-1))


def _states_of(num_frames: torch.Tensor) -> int:
    from transformers.models.qwen3_asr.modeling_qwen3_asr import _get_feat_extract_output_lengths

    return int(_get_feat_extract_output_lengths(num_frames)[0])


@pytest.mark.parametrize("seconds", [0.3, 1.0, 2.37, 3.5])  # windows of 2 chunks: 3.5 s spans two
def test_encoder_loaded_by_name_matches_transformers(checkpoint, seconds):
    directory, model = checkpoint
    plan = load_plan(str(PLAN))
    node = next(n for n in plan.nodes if n.model_kind == "audio_encoder")
    runner = encoder_runner(node, "spec", str(directory), seed=0, position=0, out_width=32,
                            new=lambda name, make: make())
    samples = clip(seconds, seed=1)
    inputs = extract(samples)
    with torch.no_grad():
        expected = model.get_audio_features(inputs["input_features"], inputs["attention_mask"]).pooler_output
        states = runner.model(torch.from_numpy(samples))
    assert states.shape == expected.shape == (qwen3_asr.num_states(len(samples)), 32)
    assert torch.allclose(states, expected, atol=1e-5), (states - expected).abs().max()


def write_wav(path: Path, samples: np.ndarray) -> np.ndarray:
    pcm = np.clip(np.round(samples * 32767), -32768, 32767).astype(np.int16)
    with wave.open(str(path), "wb") as out:
        out.setnchannels(1)
        out.setsampwidth(2)
        out.setframerate(16000)
        out.writeframes(pcm.tobytes())
    return pcm.astype(np.float32) / 32768


def test_mstar_run_transcribes_a_wav_as_transformers_generates(checkpoint, tmp_path, capsys):
    from transformers import AutoTokenizer

    directory, model = checkpoint
    tokenizer = AutoTokenizer.from_pretrained(directory)
    runs = {"plain": ("", 2.37), "forced": ("language English<asr_text>", 3.5)}
    expected, prompt_ids = {}, {}
    for name, (prefill, seconds) in runs.items():
        heard = write_wav(tmp_path / f"{name}.wav", clip(seconds, seed=3))
        inputs = extract(heard)
        pads = "<|audio_pad|>" * qwen3_asr.num_states(len(heard))
        ids = tokenizer(FRAME.format(audio=pads, prompt=prefill), return_tensors="pt").input_ids
        out = model.generate(input_ids=ids, input_features=inputs["input_features"],
                             input_features_mask=inputs["attention_mask"], max_new_tokens=16, do_sample=False)
        expected[name] = out[0, ids.shape[1]:].tolist()
        prompt_ids[name] = ids[0].tolist()
    lines = [{"id": "plain", "audio": "plain.wav", "max_tokens": 16},
             {"id": "forced", "audio": "forced.wav", "prompt": runs["forced"][0], "max_tokens": 16}]
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps(line) + "\n" for line in lines))
    status = main(["run", "--plan", str(PLAN), "--weights", str(directory), "--prompts", str(prompts),
                   "--out", str(tmp_path / "out")])
    assert status == 0, capsys.readouterr().err
    outputs = {o["id"]: o for o in map(json.loads, (tmp_path / "out" / "outputs.jsonl").read_text().splitlines())}
    for name, tokens in expected.items():
        assert outputs[name]["output_tokens"] == tokens
        # the text the output adds to its prompt's (the test tokenizer joins words with spaces)
        whole, prompt = (tokenizer.decode(ids, skip_special_tokens=True)
                         for ids in (prompt_ids[name] + tokens, prompt_ids[name]))
        text = whole[len(prompt):]
        assert outputs[name]["text"] == text and len(text.split()) > 3


def test_the_placeholder_is_repeated_once_per_state():
    layout = audio_layout_of(load_plan(str(PLAN)))
    assert layout is not None and layout.placeholder == AUDIO_PAD
    count = qwen3_asr.num_states(16000 * 3)
    assert count == 39
    assert expand(layout, [1, AUDIO_PAD, 2], 16000 * 3) == [1] + [AUDIO_PAD] * count + [2]
    laid_out = [1] + [AUDIO_PAD] * count
    assert expand(layout, laid_out, 16000 * 3) == laid_out
    with pytest.raises(AudioPromptError, match="holds it 0 times"):
        expand(layout, [1, 2], 16000 * 3)


def test_a_prompt_without_the_placeholder_is_refused(checkpoint, tmp_path, capsys):
    directory, _ = checkpoint
    write_wav(tmp_path / "a.wav", clip(1.0))
    prompts = tmp_path / "prompts.jsonl"
    good = {"id": "w", "audio": "a.wav", "prompt_tokens": [1, AUDIO_PAD, 2], "max_tokens": 4}
    prompts.write_text(json.dumps(good) + "\n\n" + json.dumps({"id": "x", "audio": "a.wav", "prompt_tokens": [1, 2],
                                                              "max_tokens": 4}) + "\n")
    status = main(["run", "--plan", str(PLAN), "--weights", str(directory), "--prompts", str(prompts),
                   "--out", str(tmp_path / "out")])
    assert status != 0
    # named by its line, as every bad line is (it said "--prompts: request x: ...")
    assert f"prompts.jsonl:3: the prompt must hold the audio placeholder (token {AUDIO_PAD}) once" in \
        capsys.readouterr().err


def test_a_checkpoint_whose_chunks_differ_from_the_front_end_is_refused(tmp_path):
    save_tiny_qwen3_asr(tmp_path, n_window=25, n_window_infer=200)
    node = next(n for n in load_plan(str(PLAN)).nodes if n.model_kind == "audio_encoder")
    with pytest.raises(WeightsError, match="n_window=25; the front end chunks by 50"):
        encoder_runner(node, "spec", str(tmp_path), seed=0, position=0, out_width=32, new=lambda name, make: make())


CHUNKED = """model: "qwen3_asr"
max_seq_len: 512
max_step_tokens: 64
scheduler_owns_chunking: true
max_prefill_chunk_size: 8
node_groups:
  - node_names: [audio_encoder, LLM]
    ranks: [0]
kv_pool:
  page_size: 8
  num_pages: 64
prefix_cache: true
"""


def test_chunked_prompts_and_the_prefix_cache_keep_each_clips_states(checkpoint, tmp_path, capsys):
    """Prompts cut into chunks of 8 tokens (each chunk's placeholders take their own states), and two
    clips of one length run one after the other: their prompts' ids are equal, yet the second
    claims no cached page from its first placeholder on (its states differ); tokens as transformers'."""
    from transformers import AutoTokenizer

    from mstar.cli.mstarc import main as mstarc
    from mstar.runtime.conductor.request import Request
    from mstar.runtime.engine.torch_engine import TorchEngine
    from mstar.runtime.serve.driver import Driver, Workload

    directory, model = checkpoint
    (tmp_path / "specs").mkdir()
    (tmp_path / "configs").mkdir()
    (tmp_path / "specs" / "qwen3_asr.mw").write_text((ROOT / "specs" / "qwen3_asr.mw").read_text())
    (tmp_path / "configs" / "qwen3_asr.yaml").write_text(CHUNKED)
    path = tmp_path / "qwen3_asr.plan"
    assert mstarc(["compile", str(tmp_path / "specs" / "qwen3_asr.mw"), "--config",
                   str(tmp_path / "configs" / "qwen3_asr.yaml"), "-o", str(path)]) == 0, capsys.readouterr().err
    tokenizer = AutoTokenizer.from_pretrained(directory)
    requests, expected = [], {}
    for seed in (4, 5):
        heard = clip(2.0, seed=seed)
        inputs = extract(heard)
        pads = "<|audio_pad|>" * qwen3_asr.num_states(len(heard))
        ids = tokenizer(FRAME.format(audio=pads, prompt=""), return_tensors="pt").input_ids
        out = model.generate(input_ids=ids, input_features=inputs["input_features"],
                             input_features_mask=inputs["attention_mask"], max_new_tokens=8, do_sample=False)
        expected[f"c{seed}"] = out[0, ids.shape[1]:].tolist()
        requests.append(Request(id=f"c{seed}", prompt_tokens=ids[0].tolist(), max_tokens=8,
                                media={"audio": torch.from_numpy(heard)}))
    assert requests[0].prompt_tokens == requests[1].prompt_tokens and len(requests[0].prompt_tokens) > 32
    plan = load_plan(str(path))
    engine = TorchEngine(plan, weights_dir=str(directory))
    runner = engine.runners["LLM"]
    claims: list[int] = []
    claim = runner.claim_prefix

    def recorded(request, tokens):
        claims.append(claim(request, tokens))
        return claims[-1]

    runner.claim_prefix = recorded
    chunks: list[int] = []  # prompt tokens fed per row and step
    start_rows = runner.start

    def recorded_start(rows, *args, **kwargs):
        chunks.extend(row.num_tokens for row, _, _ in rows if row.walk == "prefill")
        return start_rows(rows, *args, **kwargs)

    runner.start = recorded_start
    driver = Driver(plan, engine)
    driver.run(Workload(requests, closed_concurrency=1))
    records = driver.conductor.records
    assert {name: [e.value[0] for e in records[name].emissions] for name in expected} == expected
    first_placeholder = requests[0].prompt_tokens.index(AUDIO_PAD)
    assert claims and max(claims) <= first_placeholder  # whole pages before it (none here: it is at 6)
    assert runner.pool.cache is not None  # the deployment's prefix cache is on
    assert max(chunks) == 8 and sum(chunks) == 2 * len(requests[0].prompt_tokens) - sum(claims)
