"""A tiny Orpheus in its published layouts, for tests: a random Llama with Orpheus's vocabulary and
a tokenizer holding Orpheus's special tokens at their ids, and a random SNAC; and what Orpheus's
own code does with them (its prompt framing, its decoder's token-to-code mapping)."""
import json
from pathlib import Path

import torch

SNAC_CONFIG = {"sampling_rate": 24000, "encoder_dim": 4, "encoder_rates": [2, 2], "latent_dim": None,
               "decoder_dim": 32, "decoder_rates": [4, 2], "attn_window_size": None, "codebook_size": 4096,
               "codebook_dim": 4, "vq_strides": [4, 2, 1], "noise": False, "depthwise": True}
VOCAB = 156940  # Orpheus's: Llama 3's 128256 + its custom tokens
AUDIO_FIRST, AUDIO_LAST = 128266, 128266 + 7 * 4096 - 1
START_OF_HUMAN, END_OF_TEXT, END_OF_HUMAN, START_OF_AI, START_OF_SPEECH = 128259, 128009, 128260, 128261, 128257
WORDS = ["<unk>", "<|begin_of_text|>", "leo", "tara", ":", "hello", "there", "friend"]
# Orpheus's special tokens (start/end of speech, of human, of AI; the first audio token) and Llama 3's
# end of text, at their ids in Orpheus's tokenizer
SPECIALS = {f"<custom_token_{n}>": 128256 + n for n in (1, 2, 3, 4, 5, 10)} | {"<|eot_id|>": END_OF_TEXT}
NUM_TOKENS = 64


def save_tokenizer(directory: Path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers, processors

    vocab = {w: i for i, w in enumerate(WORDS)} | SPECIALS
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.WhitespaceSplit(),
                                                       pre_tokenizers.Punctuation()])
    tokenizer.add_special_tokens(["<unk>", "<|begin_of_text|>", *SPECIALS])
    tokenizer.post_processor = processors.TemplateProcessing(single="<|begin_of_text|> $A",
                                                             special_tokens=[("<|begin_of_text|>", 1)])
    tokenizer.save(str(directory / "tokenizer.json"))


def save_models(root: Path):
    """A tiny random Orpheus LLM (root/llm, with its tokenizer) and SNAC (root/snac); returns both."""
    import snac
    import transformers

    config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                      num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=False)
    torch.manual_seed(2)
    llm = transformers.LlamaForCausalLM(config).eval()
    with torch.no_grad():
        # Audio tokens' logits a little larger, so greedy decoding speaks mostly audio, with some
        # other tokens between (which the SNAC stream must skip).
        llm.lm_head.weight[AUDIO_FIRST:AUDIO_LAST + 1] *= 1.15
    llm.save_pretrained(root / "llm")
    save_tokenizer(root / "llm")
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


def hf_greedy(llm, prompt: list[int], num_new: int) -> list[int]:
    with torch.no_grad():
        out = llm.generate(torch.tensor([prompt]), max_new_tokens=num_new, do_sample=False, eos_token_id=None,
                           pad_token_id=0)
    return out[0, len(prompt):].tolist()
