"""A tiny random Qwen3-ASR checkpoint in the published layout, for the parity tests.

`save_tiny_qwen3_asr(directory, seed, n_window_infer)` saves transformers'
`Qwen3ASRForConditionalGeneration` with `save_pretrained` (audio tower: 128 mel bins, width 32, 2
layers, 16 conv channels; text model: Qwen3 of width 32, 2 layers, 4 query / 2 KV heads, the
published vocabulary size so that generated/qwen3_asr.plan's token ids hold), the feature
extractor's `preprocessor_config.json` and a word-level tokenizer: 40 words, the chat and audio
special tokens at their published ids. Token embeddings outside the tokenizer's vocabulary are
zero, so the tied LM head mostly picks words and the decoded transcript has some. Returns the model.
"""
from __future__ import annotations

import torch

WORDS = [f"w{i}" for i in range(40)] + ["system", "user", "assistant", "language", "English"]
SPECIALS = {"<|endoftext|>": 151643, "<|im_start|>": 151644, "<|im_end|>": 151645, "<|audio_start|>": 151669,
            "<|audio_end|>": 151670, "<|audio_pad|>": 151676, "<asr_text>": 151704}
AUDIO_PAD = SPECIALS["<|audio_pad|>"]
STOPS = [151643, 151645]
VOCAB = 151936
FRAME = ("<|im_start|>system\n<|im_end|>\n<|im_start|>user\n<|audio_start|>{audio}<|audio_end|><|im_end|>\n"
         "<|im_start|>assistant\n{prompt}")


def save_tiny_qwen3_asr(directory, seed: int = 0, n_window_infer: int = 200, n_window: int = 50):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast, Qwen3ASRConfig, Qwen3ASRForConditionalGeneration
    from transformers.models.qwen3_asr.feature_extraction_qwen3_asr import Qwen3ASRFeatureExtractor

    torch.manual_seed(seed)
    config = Qwen3ASRConfig(
        audio_config=dict(num_mel_bins=128, d_model=32, encoder_layers=2, encoder_attention_heads=4,
                          encoder_ffn_dim=64, downsample_hidden_size=16, output_dim=32, n_window=n_window,
                          n_window_infer=n_window_infer),
        text_config=dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=4096,
                         rope_theta=1000000.0, tie_word_embeddings=True, initializer_range=0.5),
        audio_token_id=AUDIO_PAD, eos_token_id=STOPS, pad_token_id=STOPS[1], initializer_range=0.5)
    model = Qwen3ASRForConditionalGeneration(config).eval()
    vocab = {word: i for i, word in enumerate(WORDS)} | SPECIALS
    with torch.no_grad():  # rows outside the tokenizer's vocabulary: zero logits through the tied head
        keep = torch.zeros(VOCAB, dtype=torch.bool)
        keep[list(vocab.values())] = True
        model.model.language_model.embed_tokens.weight[~keep] = 0.0
    model.save_pretrained(directory)
    Qwen3ASRFeatureExtractor().save_pretrained(directory)
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token="w0"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.add_special_tokens(list(SPECIALS))
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<|im_end|>").save_pretrained(directory)
    return model
