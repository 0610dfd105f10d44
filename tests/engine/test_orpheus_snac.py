"""Orpheus with its real parts: `mstar run` on the Orpheus plan with a tiny random Llama (Orpheus's
vocabulary, with a tokenizer) and a tiny random SNAC, each saved in its published file layout
(`--weights LLM=DIR --weights snac_decoder=DIR`), prompted with text and a voice.

- The prompt is framed as Orpheus frames it (the spec's `prompt_format`): start of human, the
  tokenizer's BOS and "voice: text", end of text, end of human, start of AI, start of speech;
  the generated tokens equal transformers' greedy generation from that framed prompt.
- The WAV equals the `snac` package decoding the codes taken from the generated tokens the way
  Orpheus's decoder takes them: non-audio tokens skipped (the stream's `keep` range), then
  windows of 28 tokens every 7, each token `128266 + slot * 4096 + code` in SNAC's depth-first
  frame order, samples of the window's second frame kept."""
import json
import wave
from pathlib import Path

import pytest
import torch

from mstar.cli.mstar import main
from orpheus_checkpoint import (
    AUDIO_FIRST,
    AUDIO_LAST,
    END_OF_HUMAN,
    END_OF_TEXT,
    NUM_TOKENS,
    START_OF_AI,
    START_OF_HUMAN,
    START_OF_SPEECH,
    hf_greedy,
    orpheus_decode,
    save_models,
)

transformers = pytest.importorskip("transformers")
snac = pytest.importorskip("snac")
pytest.importorskip("tokenizers")

PLAN = Path(__file__).resolve().parents[2] / "generated" / "orpheus.plan"


def test_text_prompt_with_voice_speaks_through_snac(tmp_path, capsys):
    if not PLAN.exists():
        pytest.skip(f"{PLAN} not generated")
    llm, codec = save_models(tmp_path)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"id": "p", "prompt": "hello there friend", "voice": "leo",
                                   "max_tokens": NUM_TOKENS, "temperature": 0}) + "\n")
    status = main(["run", "--plan", str(PLAN), "--weights", f"LLM={tmp_path / 'llm'}",
                   "--weights", f"snac_decoder={tmp_path / 'snac'}", "--prompts", str(prompts),
                   "--out", str(tmp_path / "out"), "--no-progress"])
    assert status == 0, capsys.readouterr()
    line = json.loads((tmp_path / "out" / "outputs.jsonl").read_text())
    tokens = line["output_tokens"]
    framed = [START_OF_HUMAN, 1, 2, 4, 5, 6, 7, END_OF_TEXT, END_OF_HUMAN, START_OF_AI, START_OF_SPEECH]
    assert tokens == hf_greedy(llm, framed, len(tokens))
    audio = [t for t in tokens if AUDIO_FIRST <= t <= AUDIO_LAST]
    # the test is only meaningful when the stream both skips tokens and fills several windows
    assert len(audio) < len(tokens) and len(audio) >= 35, (len(audio), len(tokens))
    [wav_path] = (tmp_path / "out").glob("*.wav")
    with wave.open(str(wav_path)) as wav:
        assert (wav.getframerate(), wav.getsampwidth(), wav.getnchannels()) == (24000, 2, 1)
        samples = torch.frombuffer(bytearray(wav.readframes(wav.getnframes())), dtype=torch.int16)
    expected = orpheus_decode(codec, tokens)
    assert samples.shape == expected.shape
    assert torch.equal(samples, expected)
