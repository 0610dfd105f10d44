"""`mstarc init --from-checkpoint LLM_DIR --codec-checkpoint SNAC_DIR`: Orpheus's spec and deployment.

In: an Orpheus checkpoint directory (a Llama: config.json, tokenizer.json with Orpheus's added
tokens `<custom_token_N>`) and a SNAC checkpoint directory (config.json with `codebook_size` and
`vq_strides`), and a model name. Out: `InitFiles`, or an `InitError` naming the file and field.

What Orpheus's own code does, written as spec lines (docs/models.md "Orpheus"):
- the prompt: `<custom_token_3>` (start of human), the tokenizer's BOS and "voice: text",
  `<|eot_id|>`, `<custom_token_4>` (end of human), `<custom_token_5>` (start of AI),
  `<custom_token_1>` (start of speech): a `prompt_format` with voice "tara" by default;
- generation stops on `<custom_token_2>` (end of speech);
- audio token j of a frame is `<custom_token_10>` + j * codebook_size + code, a frame has one
  token per code of SNAC's codebooks in depth-first order (1 + 2 + 4 = 7 for strides 4, 2, 1),
  and the decoder runs on windows of 4 frames moving by one frame, skipping every token that is not
  an audio token (`keep`).
The token ids come from the checkpoint's tokenizer.json (its added tokens, else its vocabulary), so
a checkpoint whose tokenizer lacks them is refused rather than guessed at.
"""
from __future__ import annotations

from pathlib import Path

from mstar.arg_types import shown_path
from mstar.compiler.from_checkpoint import InitError, InitFiles, node_header, positive_int, read_decoder, read_json
from mstar.compiler.memory_bounds import MAX_DIM
from mstar.files import MAX_TOKENIZER_BYTES

FRAMES_PER_WINDOW = 4  # Orpheus decodes 4 frames and keeps the second (the codec's `keep_frame`)
ROLES = {"start_of_speech": "<custom_token_1>", "end_of_speech": "<custom_token_2>",
         "start_of_human": "<custom_token_3>", "end_of_human": "<custom_token_4>",
         "start_of_ai": "<custom_token_5>", "audio_offset": "<custom_token_10>", "end_of_text": "<|eot_id|>"}


def read_tts_checkpoints(llm_dir: str, codec_dir: str, name: str) -> InitFiles:
    """The Orpheus spec and deployment for these two directories (module docstring)."""
    ids = _token_ids(Path(llm_dir) / "tokenizer.json")
    codec_path = Path(codec_dir) / "config.json"
    if not codec_path.exists():
        raise InitError(f"--codec-checkpoint {codec_dir}: no config.json there (expected a SNAC checkpoint)")
    codec = read_json(codec_path, "codec config")
    codebook = positive_int(codec, "codebook_size", codec_path)
    strides = codec.get("vq_strides")
    if not isinstance(strides, list) or not strides or not all(isinstance(s, int) and s > 0 for s in strides) \
            or any(max(strides) % s for s in strides):
        raise InitError(f"{codec_path}: vq_strides must be positive integers that divide the largest, got {strides!r}")
    per_frame = sum(max(strides) // s for s in strides)
    decoder = read_decoder(llm_dir, eos_ids=[ids["end_of_speech"]])
    if decoder.style != "llama":
        raise InitError(f"{decoder.source}: a TTS checkpoint with a codec is a Llama-style decoder")
    last_audio = ids["audio_offset"] + per_frame * codebook - 1
    vocab = int(next(a for a in decoder.args if a.startswith("vocab=")).split("=")[1])
    if last_audio >= vocab:
        raise InitError(f"{decoder.source}: vocab_size {vocab} has no room for {per_frame} x {codebook} audio "
                        f"tokens from id {ids['audio_offset']}")
    source = f"{decoder.source} and {Path(codec_dir).resolve().name}/config.json (SNAC)"
    return InitFiles(_spec_text(name, source, decoder.args, ids, per_frame, last_audio),
                     _deployment_text(name, source, decoder.max_seq_len), decoder.architecture + " + SNAC")


def _token_ids(path: Path) -> dict[str, int]:
    if not path.exists():
        raise InitError(f"{shown_path(path)}: missing; the TTS prompt format and audio tokens are read from the "
                        "tokenizer")
    tokenizer = read_json(path, "tokenizer", max_bytes=MAX_TOKENIZER_BYTES)
    found: dict[str, int] = {}
    added = tokenizer.get("added_tokens")
    for token in added if isinstance(added, list) else []:
        if isinstance(token, dict) and isinstance(token.get("content"), str) and isinstance(token.get("id"), int):
            found.setdefault(token["content"], token["id"])
    model = tokenizer.get("model")
    vocab = model.get("vocab") if isinstance(model, dict) else None
    for content, token_id in (vocab.items() if isinstance(vocab, dict) else []):
        if isinstance(token_id, int):
            found.setdefault(content, token_id)
    missing = [content for content in ROLES.values() if content not in found]
    if missing:
        raise InitError(f"{shown_path(path)}: no token {missing[0]} (Orpheus's tokenizer adds <custom_token_N> tokens; "
                        "is this an Orpheus checkpoint?)")
    for content in ROLES.values():  # a bool is an int to Python; token ids are int32 on the device
        token_id = found[content]
        if isinstance(token_id, bool) or not 0 <= token_id <= MAX_DIM:
            raise InitError(f"{shown_path(path)}: token {content} has id {token_id!r}, not a token id")
    return {role: found[content] for role, content in ROLES.items()}


def _spec_text(name: str, source: str, args: list[str], ids: dict[str, int], per_frame: int, last: int) -> str:
    window = FRAMES_PER_WINDOW * per_frame
    after = ", ".join(str(ids[role]) for role in ("end_of_text", "end_of_human", "start_of_ai", "start_of_speech"))
    frame = f"before=[{ids['start_of_human']}] after=[{after}]"
    return f"""# Written by `mstarc init` from {source}.
# A TTS decoder emitting audio codec tokens, and the codec decoding them in sliding windows of
# {FRAMES_PER_WINDOW} frames x {per_frame} tokens, streamed between partitions.
model {name}

param max_output_tokens = 2048

{node_header("node LLM kv(", args)}
    in text_inputs: tokens prompt text
    out text_inputs: tokens
    out new_token: tokens
    # start of human, "voice: text" (the tokenizer adds its BOS), end of text, end of human,
    # start of AI, start of speech
    prompt_format "{{voice}}: {{prompt}}" {frame} voice="tara"
    kv_sequences main
    cap prefill 16
    cap decode 64
    capture decode batched batch=[1, 2, 4, 8, 16, 32, 64]
    capture prefill packed batch=[1, 2, 4, 8, 16] tokens=[32, 64, 128, 256, 512, 1024]
}}

node snac_decoder stateless audio_codec(token_offset={ids["audio_offset"]}) {{
    in new_token stream: tokens
    out audio_chunk: audio
    cap snac_chunk 16
    capture snac_chunk batched batch=[1, 2, 4, 8, 16]
}}

walk prefill {{
    LLM(text_inputs)
        -> new_token: conductor persist count_tokens
        -> new_token: snac_decoder stream
}}

walk decode {{
    loop decode_loop max=max_output_tokens stop {{
        LLM(text_inputs)
            -> text_inputs: LLM device  # the sampled token loops back without visiting the host
            -> new_token: snac_decoder stream
    }}
}}

walk snac_chunk {{
    snac_decoder(new_token) -> audio_chunk: client audio
}}

partition LLM = prefill -> decode
partition SNAC = snac_chunk
    <- LLM.new_token window({window}, stride={per_frame}) keep {ids["audio_offset"]}..{last}  # audio tokens only
"""


def _deployment_text(name: str, source: str, max_seq_len: int) -> str:
    return f"""# Written by `mstarc init` from {source}.
# The decoder and the codec on one GPU.
model: "{name}"
max_seq_len: {max_seq_len}
node_groups:
  - node_names: [LLM, snac_decoder]
    ranks: [0]

kv_pool:
  page_size: 16
  num_pages: 8192           # 131072 tokens
capture_memory_budget_mb: 4096
speculation_mixes_walks: [LLM.decode]
"""
