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

transformers = pytest.importorskip("transformers")
snac = pytest.importorskip("snac")
pytest.importorskip("tokenizers")

PLAN = Path(__file__).resolve().parents[2] / "generated" / "orpheus.plan"
SNAC_CONFIG = {"sampling_rate": 24000, "encoder_dim": 4, "encoder_rates": [2, 2], "latent_dim": None,
               "decoder_dim": 32, "decoder_rates": [4, 2], "attn_window_size": None, "codebook_size": 4096,
               "codebook_dim": 4, "vq_strides": [4, 2, 1], "noise": False, "depthwise": True}
VOCAB = 156940  # Orpheus's: Llama 3's 128256 + its custom tokens
AUDIO_FIRST, AUDIO_LAST = 128266, 128266 + 7 * 4096 - 1
START_OF_HUMAN, END_OF_TEXT, END_OF_HUMAN, START_OF_AI, START_OF_SPEECH = 128259, 128009, 128260, 128261, 128257
WORDS = ["<unk>", "<|begin_of_text|>", "leo", "tara", ":", "hello", "there", "friend"]
NUM_TOKENS = 64


def _tokenizer(directory: Path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers, processors

    tokenizer = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.WhitespaceSplit(),
                                                       pre_tokenizers.Punctuation()])
    tokenizer.add_special_tokens(["<unk>", "<|begin_of_text|>"])
    tokenizer.post_processor = processors.TemplateProcessing(single="<|begin_of_text|> $A",
                                                             special_tokens=[("<|begin_of_text|>", 1)])
    tokenizer.save(str(directory / "tokenizer.json"))


def save_models(root: Path):
    config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                      num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=False)
    torch.manual_seed(2)
    llm = transformers.LlamaForCausalLM(config).eval()
    with torch.no_grad():
        # Audio tokens' logits a little larger, so greedy decoding speaks mostly audio, with some
        # other tokens between (which the SNAC stream must skip).
        llm.lm_head.weight[AUDIO_FIRST:AUDIO_LAST + 1] *= 1.15
    llm.save_pretrained(root / "llm")
    _tokenizer(root / "llm")
    codec = snac.SNAC(**SNAC_CONFIG).eval()
    with torch.no_grad():
        for param in codec.parameters():
            param.add_(torch.randn_like(param) * 0.1)
    (root / "snac").mkdir()
    (root / "snac" / "config.json").write_text(json.dumps(SNAC_CONFIG))
    torch.save(codec.state_dict(), root / "snac" / "pytorch_model.bin")
    return llm, codec


def orpheus_decode(codec, tokens: list[int]) -> torch.Tensor:
    """What Orpheus's decoder does with a token stream: only audio tokens count; per 28-token window
    every 7 tokens, codes by slot (0 | 1 | 2 2 | 1 | 2 2), decode, keep the second frame's samples."""
    tokens = [t for t in tokens if AUDIO_FIRST <= t <= AUDIO_LAST]
    spf = 4 * 2 * 4  # decoder upsampling (rates 4, 2) x the coarse stride
    chunks = []
    for start in range(0, len(tokens) - 27, 7):
        window = tokens[start:start + 28]
        codes = [(t - AUDIO_FIRST - (i % 7) * 4096) % 4096 for i, t in enumerate(window)]
        frames = [codes[i:i + 7] for i in range(0, 28, 7)]
        levels = [[f[0] for f in frames], [c for f in frames for c in (f[1], f[4])],
                  [c for f in frames for c in (f[2], f[3], f[5], f[6])]]
        with torch.no_grad():
            audio = codec.decode([torch.tensor([level]) for level in levels])[0, 0]
        chunks.append((audio[spf:2 * spf] * 32767.0).round().to(torch.int16))
    return torch.cat(chunks)


def _hf_greedy(llm, prompt: list[int], num_new: int) -> list[int]:
    with torch.no_grad():
        out = llm.generate(torch.tensor([prompt]), max_new_tokens=num_new, do_sample=False, eos_token_id=None,
                           pad_token_id=0)
    return out[0, len(prompt):].tolist()


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
    assert tokens == _hf_greedy(llm, framed, len(tokens))
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
