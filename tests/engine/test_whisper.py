"""Whisper end to end on the CPU against transformers (the oracle): the log-mel front end, the
encoder and the cross-attending decoder, greedy tokens with language detection, the timestamp
rules, and a WAV transcribed by `mstar run --plan generated/whisper.plan --weights DIR --prompts`.

The checkpoint is a tiny random `WhisperForConditionalGeneration` saved with `save_pretrained`, with
its generation config, tokenizer and feature extractor files (whisper_checkpoint.py); the plan is
the checked-in one at its spec dims, whose numbers the checkpoint's config.json replaces.
"""
import json
import os
import time
import wave
from pathlib import Path

import numpy as np
import pytest
import torch

from mstar.cli.mstar import main
from mstar.plan.io import load_plan
from mstar.runtime.conductor.request import Request
from mstar.runtime.engine.models.log_mel import log_mel, log_mel_frames
from mstar.runtime.engine.models.whisper import WhisperDecoder, WhisperEncoder
from mstar.runtime.engine.torch_engine import TorchEngine
from mstar.runtime.engine.whisper_checkpoint import load_part, read_whisper_dims
from mstar.runtime.serve.driver import Driver, Workload
from mstar.runtime.serve.workload import WorkloadError, read_prompts
from whisper_checkpoint import EOS, LANGUAGES, MEL_BINS, NO_TIMESTAMPS, START, TRANSCRIBE, save_tiny_whisper

ROOT = Path(__file__).resolve().parents[2]
PLAN = ROOT / "generated" / "whisper.plan"


def clip(seconds: float, seed: int = 0) -> np.ndarray:
    """A reproducible 16 kHz test signal: two tones and some noise."""
    t = np.arange(int(16000 * seconds)) / 16000
    noise = np.random.default_rng(seed).standard_normal(t.shape[0])
    return (0.3 * np.sin(2 * np.pi * 440 * t) + 0.2 * np.sin(2 * np.pi * 1250 * t) + 0.05 * noise).astype(np.float32)


def features(samples: np.ndarray, num_mel_bins: int = MEL_BINS) -> torch.Tensor:
    from transformers import WhisperFeatureExtractor

    extractor = WhisperFeatureExtractor(feature_size=num_mel_bins)
    return extractor(samples, sampling_rate=16000, return_tensors="pt").input_features


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    directory = tmp_path_factory.mktemp("whisper")
    return directory, save_tiny_whisper(directory)


def run_engine(directory, requests: list[Request]) -> dict:
    plan = load_plan(str(PLAN))
    driver = Driver(plan, TorchEngine(plan, weights_dir=str(directory)))
    driver.run(Workload(requests))
    return driver.conductor.records


@pytest.mark.parametrize("num_mel_bins", [80, 128])
@pytest.mark.parametrize("seconds", [3.0, 35.0])  # padded to 30 s, and cut to 30 s
def test_log_mel_matches_the_feature_extractor(num_mel_bins, seconds):
    samples = clip(seconds)
    expected = features(samples, num_mel_bins)[0]
    got = log_mel(torch.from_numpy(samples), num_mel_bins)
    assert got.shape == expected.shape == (num_mel_bins, 3000)
    assert torch.allclose(got, expected, atol=1e-5, rtol=0)


@pytest.mark.parametrize("num_mel_bins", [80, 128])
def test_log_mel_of_a_long_clip_matches_the_feature_extractor(num_mel_bins):
    """Long-form input: the whole clip's features (truncation off), floored at its own maximum."""
    samples = clip(65.3)
    expected = long_features(samples, num_mel_bins)[0]
    got = log_mel_frames(torch.from_numpy(samples), num_mel_bins)
    assert got.shape == expected.shape == (num_mel_bins, len(samples) // 160)
    assert torch.allclose(got, expected, atol=1e-5, rtol=0)


def long_features(samples: np.ndarray, num_mel_bins: int = MEL_BINS) -> torch.Tensor:
    from transformers import WhisperFeatureExtractor

    extractor = WhisperFeatureExtractor(feature_size=num_mel_bins)
    return extractor(samples, sampling_rate=16000, return_tensors="pt", truncation=False,
                     padding="longest").input_features


def test_encoder_and_decoder_match_transformers(checkpoint):
    directory, model = checkpoint
    encoder_dims, decoder_dims = read_whisper_dims(str(directory))
    encoder, decoder = WhisperEncoder(encoder_dims), WhisperDecoder(decoder_dims)
    load_part(encoder, str(directory), "model.encoder.")
    load_part(decoder, str(directory), "model.decoder.")
    samples = clip(4.0)
    tokens = torch.tensor([START, LANGUAGES["<|de|>"], TRANSCRIBE, NO_TIMESTAMPS, 7, 8])
    with torch.no_grad():
        expected_states = model.model.encoder(features(samples)).last_hidden_state[0]
        states = encoder(log_mel(torch.from_numpy(samples), MEL_BINS))
        expected = model(encoder_outputs=(expected_states[None],), decoder_input_ids=tokens[None]).logits[0]
        kv = decoder.empty_kv()
        kv.cross = decoder.cross_pool(states)
        prefix = decoder.logits(decoder(tokens[:4], kv))  # a prompt, then one token a call
        steps = [decoder.logits(decoder(tokens[i:i + 1], kv)) for i in range(4, 6)]
    assert torch.allclose(states, expected_states, atol=1e-4)
    assert torch.allclose(torch.cat([prefix, *steps]), expected, atol=1e-4)


def oracle(model, samples: np.ndarray, prompt: list[int], max_new_tokens: int, timestamps: bool) -> list[int]:
    """Greedy decoding with transformers' model and its own logits processors, from the start
    sequence `prompt` as generate builds it: what generate computes for a clip of at most 30 s,
    without its long-form re-decoding after a timestamp pair (see the tests below)."""
    from transformers import GenerationConfig
    from transformers.generation.logits_process import (
        SuppressTokensAtBeginLogitsProcessor, SuppressTokensLogitsProcessor, WhisperTimeStampLogitsProcessor,
    )

    config = model.generation_config
    processors = [SuppressTokensAtBeginLogitsProcessor(config.begin_suppress_tokens, len(prompt)),
                  SuppressTokensLogitsProcessor(config.suppress_tokens)]
    if timestamps:
        stamped = GenerationConfig(**{**config.to_dict(), "return_timestamps": True})
        processors.append(WhisperTimeStampLogitsProcessor(stamped, begin_index=len(prompt)))
    tokens = torch.tensor([prompt])
    with torch.no_grad():
        states = model.model.encoder(features(samples)).last_hidden_state
        for _ in range(max_new_tokens):
            scores = model(encoder_outputs=(states,), decoder_input_ids=tokens).logits[:, -1]
            for processor in processors:
                scores = processor(tokens, scores)
            tokens = torch.cat([tokens, scores.argmax(-1, keepdim=True)], dim=1)
            if int(tokens[0, -1]) == EOS:
                break
    return tokens[0].tolist()


def test_greedy_tokens_with_language_detection_match_transformers(checkpoint):
    """Without forced ids, generate detects the language and starts from `[start, language,
    notimestamps]`. The oracle is transformers' detect_language, then greedy decoding through its
    model and processors (`oracle`). generate itself, in transformers 5.24 on these tiny random
    models, runs the decoder over the start sequence twice and returns the second pass, whose tokens
    differ from its first (the first equals `oracle`); docs/models.md records this."""
    directory, model = checkpoint
    samples = clip(5.0)
    detected = int(model.detect_language(features(samples))[0])
    expected = oracle(model, samples, [START, detected, NO_TIMESTAMPS], 40, timestamps=False)
    records = run_engine(directory, [Request(id="a", prompt_tokens=[], max_tokens=len(expected) - 1,
                                             media={"audio": torch.from_numpy(samples)})])
    assert records["a"].output_tokens == expected[1:]  # the start token is the prompt
    assert len(set(expected)) > 8


def test_forced_start_sequence_detects_then_transcribes(tmp_path):
    """Published checkpoints force `[null, transcribe]`: detect the language, then transcribe."""
    model = save_tiny_whisper(tmp_path, forced=True)
    samples = clip(5.0, seed=1)
    detected = int(model.detect_language(features(samples))[0])
    expected = oracle(model, samples, [START, detected, TRANSCRIBE, NO_TIMESTAMPS], 40, timestamps=False)
    records = run_engine(tmp_path, [Request(id="a", prompt_tokens=[], max_tokens=len(expected) - 1,
                                            media={"audio": torch.from_numpy(samples)})])
    assert records["a"].output_tokens == expected[1:]


def test_timestamp_rules_match_the_logits_processors(checkpoint):
    """A start sequence without `<|notimestamps|>` turns the timestamp rules on (generate would go
    on to re-decode the audio after the last timestamp pair, a long-form step this engine does not
    take, so the oracle is its processors)."""
    directory, model = checkpoint
    samples = clip(6.0, seed=2)
    prompt = [START, LANGUAGES["<|de|>"], TRANSCRIBE]
    expected = oracle(model, samples, prompt, 40, timestamps=True)[len(prompt):]
    assert sum(t > NO_TIMESTAMPS for t in expected) >= 4  # the rules had timestamps to order
    records = run_engine(directory, [Request(id="t", prompt_tokens=prompt, max_tokens=len(expected),
                                             media={"audio": torch.from_numpy(samples)})])
    assert records["t"].output_tokens == expected


def write_wav(path: Path, samples: np.ndarray, rate: int = 16000) -> np.ndarray:
    """16-bit PCM; returns the samples as the file holds them."""
    pcm = np.clip(np.round(samples * 32767), -32768, 32767).astype(np.int16)
    with wave.open(str(path), "wb") as out:
        out.setnchannels(1)
        out.setsampwidth(2)
        out.setframerate(rate)
        out.writeframes(pcm.tobytes())
    return pcm.astype(np.float32) / 32768


def test_mstar_run_transcribes_a_wav(tmp_path, capsys):
    from transformers import AutoTokenizer

    directory = tmp_path / "checkpoint"
    model = save_tiny_whisper(directory, forced=True, text_only=True)
    heard = write_wav(tmp_path / "speech.wav", clip(7.0, seed=3))
    detected = int(model.detect_language(features(heard))[0])
    expected = oracle(model, heard, [START, detected, TRANSCRIBE, NO_TIMESTAMPS], 30, timestamps=False)
    text = AutoTokenizer.from_pretrained(directory).decode(expected, skip_special_tokens=True)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"id": "clip", "audio": "speech.wav", "max_tokens": len(expected) - 1}) + "\n")
    status = main(["run", "--plan", str(PLAN), "--weights", str(directory), "--prompts", str(prompts),
                   "--out", str(tmp_path / "out")])
    assert status == 0, capsys.readouterr().err
    line = json.loads((tmp_path / "out" / "outputs.jsonl").read_text())
    assert line["output_tokens"] == expected[1:]
    assert line["text"] == text and len(text.split()) > 5


@pytest.mark.parametrize("problem, data", [
    ("44100 Hz; the audio input takes 16000 Hz", "rate"),
    ("not a WAV file", b"RIFX...."),
    ("runs past the end of the file", "truncated"),
    ("holds no samples", "empty"),  # it ran, and the request failed in the audio encoder
])
def test_a_bad_wav_is_refused_with_its_reason(tmp_path, problem, data):
    path = tmp_path / "bad.wav"
    if data == "rate":
        write_wav(path, clip(0.5), rate=44100)
    elif data == "empty":
        write_wav(path, clip(0.5)[:0])
    elif data == "truncated":
        write_wav(path, clip(0.5))
        path.write_bytes(path.read_bytes()[:-100])
    else:
        path.write_bytes(data)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"id": "a", "audio": "bad.wav", "max_tokens": 4}\n')
    with pytest.raises(WorkloadError, match=problem):
        read_prompts(str(prompts))


@pytest.mark.slow
@pytest.mark.skipif(not os.environ.get("MSTAR_SLOW"), reason="minutes on a CPU: set MSTAR_SLOW=1")
@pytest.mark.parametrize("name", ["whisper", "whisper_turbo"])
def test_spec_dims_run_a_30_second_clip(name):
    """Random weights at the spec's dims (large-v3: 32 + 32 layers, width 1280): a 30 s clip's 1500
    encoder states fill the cross-attention pool, beside a 448-position decoder sequence."""
    plan = load_plan(str(ROOT / "generated" / f"{name}.plan"))
    driver = Driver(plan, TorchEngine(plan, dims="spec"))
    started = time.perf_counter()
    audio = {"audio": torch.from_numpy(clip(30.0))}
    driver.run(Workload([Request(id="a", prompt_tokens=[], max_tokens=8, media=audio)]))
    record = driver.conductor.records["a"]
    elapsed = time.perf_counter() - started
    print(f"{name} at spec dims: 30 s clip, {len(record.output_tokens)} tokens in {elapsed:.1f} s")
    assert record.finish_reason in ("stop", "length"), record.finish_reason
    assert len(record.output_tokens) >= 3


# Long form: a clip past 30 s, decoded window by window (specs/whisper.mw `repeat while audio_left`).
# Each window may generate WINDOW_TOKENS tokens: transformers' `max_new_tokens`, and here a deployment
# whose decoder holds the start sequence (3 tokens: start, language, transcribe) plus that many.
WINDOW_TOKENS = 32


@pytest.fixture(scope="module")
def long_form(tmp_path_factory):
    """A checkpoint in the published layout, a 65 s WAV, a plan whose decoder stops each window
    after WINDOW_TOKENS tokens, and what transformers' long-form generate makes of the WAV's samples
    (greedy, timestamps on, no temperature fallback, not conditioned on previous tokens)."""
    from transformers import AutoTokenizer

    directory = tmp_path_factory.mktemp("whisper_long")
    model = save_tiny_whisper(directory / "checkpoint", forced=True)
    heard = write_wav(directory / "speech.wav", clip(65.0, seed=4))
    for max_windows in (1000, 1, 2):
        compile_whisper(directory / f"windows{max_windows}", max_windows)
    with torch.no_grad():
        out = model.generate(long_features(heard), return_timestamps=True, return_segments=True,
                             max_new_tokens=WINDOW_TOKENS)
    expected = out["sequences"][0].tolist()
    segments = out["segments"][0]
    # a window's first segment starts at its first generated token (after the 3 start tokens)
    windows = []
    for segment in segments:
        if segment["idxs"][0] == 3:
            windows.append([])
        windows[-1].extend(segment["tokens"].tolist())
    text = AutoTokenizer.from_pretrained(directory / "checkpoint").decode(expected, skip_special_tokens=True)
    return directory, heard, expected, windows, text


def compile_whisper(directory: Path, max_windows: int) -> None:
    """specs/whisper.mw with `max_windows` rounds at most, its decoder given 3 + WINDOW_TOKENS
    positions, compiled into directory/whisper.plan."""
    from mstar.compiler.driver import compile_spec
    from mstar.compiler.emit import write_outputs
    from mstar.lang.diagnostics import Diagnostics

    for folder in ("specs", "configs"):
        (directory / folder).mkdir(parents=True)
    spec = (ROOT / "specs" / "whisper.mw").read_text()
    (directory / "specs" / "whisper.mw").write_text(spec.replace("param max_windows = 1000",
                                                                 f"param max_windows = {max_windows}"))
    config = (ROOT / "configs" / "whisper.yaml").read_text()
    (directory / "configs" / "whisper.yaml").write_text(config.replace("max_seq_len: 448",
                                                                       f"max_seq_len: {3 + WINDOW_TOKENS}"))
    diags = Diagnostics()
    result = compile_spec(directory / "specs" / "whisper.mw", directory / "configs" / "whisper.yaml", diags,
                          directory / "whisper.plan")
    assert result is not None, diags.render()
    write_outputs(result.plan_path, result.plan_text, result.glue_path, result.glue_text)


def transcribe(plan_dir: Path, checkpoint: Path, samples: np.ndarray):
    plan = load_plan(str(plan_dir / "whisper.plan"))
    driver = Driver(plan, TorchEngine(plan, weights_dir=str(checkpoint)))
    driver.run(Workload([Request(id="a", prompt_tokens=[], max_tokens=10_000,
                                 media={"audio": torch.from_numpy(samples)})]))
    return driver.conductor.records["a"]


def test_long_form_matches_transformers_generate(long_form):
    """65 s of audio: windows from 0 s, each decoded with the timestamp rules, the next one starting
    at the last complete segment's first timestamp; the transcript is the segments joined."""
    directory, heard, expected, windows, _ = long_form
    assert len(windows) >= 3 and sum(t > NO_TIMESTAMPS for t in expected) >= 10
    record = transcribe(directory / "windows1000", directory / "checkpoint", heard)
    assert record.output_tokens == expected, record.error
    assert record.finish_reason == "stop"


def test_a_long_clips_features_are_computed_once(long_form, monkeypatch):
    """Each window is cut from the clip's features computed at its first window (a window each, the
    whole clip's features were computed again: the square of its length), dropped when it ends."""
    from mstar.runtime.engine.runners import whisper as whisper_runners

    directory, heard, expected, windows, _ = long_form
    calls = []
    original = whisper_runners.log_mel_frames
    monkeypatch.setattr(whisper_runners, "log_mel_frames", lambda *args: calls.append(1) or original(*args))
    plan = load_plan(str(directory / "windows1000" / "whisper.plan"))
    engine = TorchEngine(plan, weights_dir=str(directory / "checkpoint"))
    driver = Driver(plan, engine)
    driver.run(Workload([Request(id="a", prompt_tokens=[], max_tokens=10_000,
                                 media={"audio": torch.from_numpy(heard)})]))
    assert driver.conductor.records["a"].output_tokens == expected
    assert len(calls) == 1 and len(windows) >= 3
    encoders = [r for r in engine.runners.values() if isinstance(r, whisper_runners.WhisperEncoderRunner)]
    assert encoders and all(not runner._clip_features for runner in encoders)


@pytest.mark.parametrize("max_windows", [1, 2])
def test_the_repeat_bound_stops_after_its_windows(long_form, max_windows):
    """`repeat while audio_left max=max_windows`: the partition runs at most that many windows."""
    directory, heard, expected, windows, _ = long_form
    record = transcribe(directory / f"windows{max_windows}", directory / "checkpoint", heard)
    assert record.output_tokens == [t for window in windows[:max_windows] for t in window], record.error


def test_mstar_run_transcribes_a_long_wav(long_form, capsys):
    directory, _, expected, _, text = long_form
    prompts = directory / "prompts.jsonl"
    prompts.write_text(json.dumps({"id": "long", "audio": "speech.wav", "max_tokens": 10_000}) + "\n")
    status = main(["run", "--plan", str(directory / "windows1000" / "whisper.plan"),
                   "--weights", str(directory / "checkpoint"), "--prompts", str(prompts),
                   "--out", str(directory / "out")])
    assert status == 0, capsys.readouterr().err
    line = json.loads((directory / "out" / "outputs.jsonl").read_text())
    assert line["output_tokens"] == expected
    assert line["text"] == text and len(text.split()) > 5
