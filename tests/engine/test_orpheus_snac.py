"""Orpheus with its real parts: `mstar run` on the Orpheus plan with a tiny random Llama and a tiny
random SNAC, each saved in its published file layout (`--weights LLM=DIR --weights
snac_decoder=DIR`). The WAV it writes equals the `snac` package decoding the codes taken from the
generated tokens the way Orpheus's decoder takes them: windows of 28 tokens every 7, each token
`128266 + slot * 4096 + code` in SNAC's depth-first frame order, samples of the window's second
frame kept."""
import json
import wave
from pathlib import Path

import pytest
import torch

from mstar.cli.mstar import main

transformers = pytest.importorskip("transformers")
snac = pytest.importorskip("snac")

PLAN = Path(__file__).resolve().parents[2] / "generated" / "orpheus.plan"
SNAC_CONFIG = {"sampling_rate": 24000, "encoder_dim": 4, "encoder_rates": [2, 2], "latent_dim": None,
               "decoder_dim": 32, "decoder_rates": [4, 2], "attn_window_size": None, "codebook_size": 4096,
               "codebook_dim": 4, "vq_strides": [4, 2, 1], "noise": False, "depthwise": True}
NUM_TOKENS = 42  # 6 frames: windows at 0, 7, 14


def save_models(root: Path):
    config = transformers.LlamaConfig(vocab_size=512, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                      num_attention_heads=2, num_key_value_heads=1)
    torch.manual_seed(2)
    transformers.LlamaForCausalLM(config).save_pretrained(root / "llm")
    codec = snac.SNAC(**SNAC_CONFIG).eval()
    with torch.no_grad():
        for param in codec.parameters():
            param.add_(torch.randn_like(param) * 0.1)
    (root / "snac").mkdir()
    (root / "snac" / "config.json").write_text(json.dumps(SNAC_CONFIG))
    torch.save(codec.state_dict(), root / "snac" / "pytorch_model.bin")
    return codec


def orpheus_decode(codec, tokens: list[int]) -> torch.Tensor:
    """What Orpheus's decoder does with a token stream: per 28-token window every 7 tokens, codes
    by slot (0 | 1 | 2 2 | 1 | 2 2), decode, keep the second frame's samples."""
    spf = 4 * 2 * 4  # decoder upsampling (rates 4, 2) x the coarse stride
    chunks = []
    for start in range(0, len(tokens) - 27, 7):
        window = tokens[start:start + 28]
        codes = [(t - 128266 - (i % 7) * 4096) % 4096 for i, t in enumerate(window)]
        frames = [codes[i:i + 7] for i in range(0, 28, 7)]
        levels = [[f[0] for f in frames], [c for f in frames for c in (f[1], f[4])],
                  [c for f in frames for c in (f[2], f[3], f[5], f[6])]]
        with torch.no_grad():
            audio = codec.decode([torch.tensor([level]) for level in levels])[0, 0]
        chunks.append((audio[spf:2 * spf] * 32767.0).round().to(torch.int16))
    return torch.cat(chunks)


def test_wav_equals_snac_decoding_of_generated_tokens(tmp_path, capsys):
    if not PLAN.exists():
        pytest.skip(f"{PLAN} not generated")
    codec = save_models(tmp_path)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"id": "p", "prompt_tokens": [3, 14, 15, 92], "max_tokens": NUM_TOKENS}) + "\n")
    status = main(["run", "--plan", str(PLAN), "--weights", f"LLM={tmp_path / 'llm'}",
                   "--weights", f"snac_decoder={tmp_path / 'snac'}", "--prompts", str(prompts),
                   "--out", str(tmp_path / "out"), "--no-progress"])
    assert status == 0, capsys.readouterr()
    line = json.loads((tmp_path / "out" / "outputs.jsonl").read_text())
    assert len(line["output_tokens"]) == NUM_TOKENS
    [wav_path] = (tmp_path / "out").glob("*.wav")
    with wave.open(str(wav_path)) as wav:
        assert (wav.getframerate(), wav.getsampwidth(), wav.getnchannels()) == (24000, 2, 1)
        samples = torch.frombuffer(bytearray(wav.readframes(wav.getnframes())), dtype=torch.int16)
    expected = orpheus_decode(codec, line["output_tokens"])
    assert samples.shape == expected.shape
    assert torch.equal(samples, expected)
