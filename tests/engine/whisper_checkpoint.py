"""A tiny random Whisper checkpoint in the published layout, for the parity tests.

`save_tiny_whisper(directory, forced, seed, text_only)` saves transformers' `WhisperForConditionalGeneration`
(2 + 2 layers, width 64, 128 mel bins, 1500 encoder positions, 448 decoder positions) with
`save_pretrained`, its generation config, a `tokenizer.json` / `tokenizer_config.json` (a word-level
vocabulary of 50 words then Whisper's special tokens, in the multilingual order) and the feature
extractor's `preprocessor_config.json`; it returns the model. Token layout: 0..49 words, 50
`<|endoftext|>`, 51 `<|startoftranscript|>`, 52..54 three languages, 55 translate, 56 transcribe,
57..59 startoflm / startofprev / nospeech, 60 `<|notimestamps|>`, 61.. the 1501 timestamps.
"""
from __future__ import annotations

import torch

EOS, START, TRANSLATE, TRANSCRIBE, NO_TIMESTAMPS = 50, 51, 55, 56, 60
LANGUAGES = {"<|en|>": 52, "<|de|>": 53, "<|fr|>": 54}
VOCAB = NO_TIMESTAMPS + 1 + 1501
MEL_BINS = 128
SPECIALS = (["<|endoftext|>", "<|startoftranscript|>", *LANGUAGES, "<|translate|>", "<|transcribe|>",
             "<|startoflm|>", "<|startofprev|>", "<|nospeech|>", "<|notimestamps|>"]
            + [f"<|{i * 0.02:.2f}|>" for i in range(1501)])


def generation_fields(forced: bool, text_only: bool = False) -> dict:
    fields = dict(decoder_start_token_id=START, eos_token_id=EOS, pad_token_id=EOS, bos_token_id=EOS,
                  lang_to_id=LANGUAGES, task_to_id={"translate": TRANSLATE, "transcribe": TRANSCRIBE},
                  no_timestamps_token_id=NO_TIMESTAMPS, suppress_tokens=[1, 2, 3], begin_suppress_tokens=[0, EOS],
                  is_multilingual=True, max_initial_timestamp_index=50, max_length=448)
    if text_only:  # a random model mostly picks timestamps (1501 of 1562 ids): keep it to words
        fields["suppress_tokens"] = [1, 2, 3, *range(NO_TIMESTAMPS + 1, VOCAB)]
    if forced:  # what published checkpoints carry: detect the language, then transcribe
        fields["forced_decoder_ids"] = [[1, None], [2, TRANSCRIBE]]
    return fields


def save_tiny_whisper(directory, forced: bool = False, seed: int = 0, text_only: bool = False):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import (
        GenerationConfig, PreTrainedTokenizerFast, WhisperConfig, WhisperFeatureExtractor,
        WhisperForConditionalGeneration,
    )

    torch.manual_seed(seed)
    config = WhisperConfig(vocab_size=VOCAB, num_mel_bins=MEL_BINS, encoder_layers=2, encoder_attention_heads=4,
                           decoder_layers=2, decoder_attention_heads=4, d_model=64, encoder_ffn_dim=128,
                           decoder_ffn_dim=128, max_source_positions=1500, max_target_positions=448,
                           pad_token_id=EOS, bos_token_id=EOS, eos_token_id=EOS, decoder_start_token_id=START,
                           begin_suppress_tokens=None, suppress_tokens=None,
                           init_std=0.3)  # wide enough that greedy tokens vary
    model = WhisperForConditionalGeneration(config).eval()
    model.generation_config = GenerationConfig(**generation_fields(forced, text_only))
    model.save_pretrained(directory)
    WhisperFeatureExtractor(feature_size=MEL_BINS).save_pretrained(directory)
    words = {f"w{i}": i for i in range(EOS)}
    tokenizer = Tokenizer(models.WordLevel(vocab=words, unk_token="w0"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.add_special_tokens(SPECIALS)
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<|endoftext|>").save_pretrained(directory)
    return model
