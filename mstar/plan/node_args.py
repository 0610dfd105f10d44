"""The node arguments the runtime understands: names, value kinds, and the layer-pattern rule.

A node header's `(name=value, ...)` and a `state recurrent(...)` declaration carry the model's
dims. The compiler checks them against this registry (check_args.py, MW109-MW112) so that a typo
such as `kv_head=8` is an error at compile time instead of a silently used default at run time;
the runtime (mstar/plan/dims.py) takes its choices and the layer-pattern rule
from here, so the two cannot drift apart. tests/checks/test_node_args.py fails when the runtime
reads a dim this registry does not list.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Union

ArgValue = Union[int, float, str, list]

DECODER_STYLES = ("llama", "qwen3_5", "whisper")
# A stateless encoder's model: `whisper` is Whisper's audio encoder over a log-mel front end
# (without a style an encoder is the small stand-in of mstar/runtime/engine/models/encoders.py).
# `qwen3_asr` is Qwen3-ASR's chunked conv encoder and projector over the same log-mel front end.
ENCODER_STYLES = ("whisper", "qwen3_asr")
LAYER_KIND_FLAGS = {"full": 1, "linear": 0}
# A kv node's MLP width when its header leaves `intermediate` out: this many times `hidden`. The
# runtime builds its decoder so (dims.py) and the compiler's capture estimate sizes its MLP so.
MLP_WIDTH_PER_HIDDEN = 4


@dataclass(frozen=True)
class ArgKind:
    """What a value must be; `describe` reads after "must be"."""

    name: str  # "int", "index", "number", "fraction", "choice", "pattern"
    choices: tuple[str, ...] = ()

    @property
    def describe(self) -> str:
        if self.name == "choice":
            return "one of " + ", ".join(self.choices)
        return {
            "int": "a positive integer",
            "index": "an integer >= 0",
            "number": "a positive number",
            "fraction": "a number in (0, 1]",
            "token_ids": "a list of token ids (integers >= 0)",
            "pattern": "a list of 0 (linear) / 1 (full) such as [0, 0, 0, 1], or \"linear,full\"",
        }[self.name]


INT = ArgKind("int")
INDEX = ArgKind("index")
NUMBER = ArgKind("number")
FRACTION = ArgKind("fraction")
PATTERN = ArgKind("pattern")
TOKEN_IDS = ArgKind("token_ids")


def choice(*names: str) -> ArgKind:
    return ArgKind("choice", names)


# kv nodes (the KV pool's page size, page count and max_seq_len belong to the deployment, not
# here: a `page_size=` argument is MW109): a decoder (Llama-style, or a Qwen3.5 gated delta-net
# hybrid, optionally with BAGEL's image-flow head) over a paged KV cache.
KV_ARGS: dict[str, ArgKind] = {
    "layers": INT, "kv_heads": INT, "qo_heads": INT, "head_dim": INT, "hidden": INT,
    "intermediate": INT, "vocab": INT, "rope_theta": NUMBER, "partial_rotary": FRACTION,
    "style": choice(*DECODER_STYLES), "layer_pattern": PATTERN,
    "linear_heads": INT, "linear_value_heads": INT, "linear_key_dim": INT, "linear_value_dim": INT,
    "conv_kernel": INT, "latent_channels": INT, "latent_tokens": INT,
    "stop_token": INDEX, "stop_tokens": TOKEN_IDS,
    # the prompt's placeholder for media states: an embeddings input replaces the embeddings of
    # the prompt positions holding this id, in order (Qwen3-ASR's <|audio_pad|>), instead of
    # being added to the first positions
    "media_token": INDEX,
}

# stateless nodes: an encoder, an audio codec or an image decoder (the spec states which:
# `node NAME stateless KIND`).
STATELESS_ARGS: dict[str, ArgKind] = {
    "hidden": INT, "layers": INT, "heads": INT, "feature_dim": INT, "num_tokens": INT,
    "codebook": INT, "quantizers": INT, "samples_per_token": INT, "sample_rate": INT,
    "keep_frame": INDEX, "latent_channels": INT, "latent_tokens": INT, "upscale": INT,
    "token_offset": INDEX,  # an audio codec fed tokens: the id of code 0 (Orpheus: 128266)
    "style": choice(*ENCODER_STYLES),
}

# `submodel NAME(...)`: the widths a sub-model may set; the KV geometry (layers, KV heads, head
# size, layer pattern) stays the node's, so the sub-model attends over the node's KV cache.
SUBMODEL_ARGS: dict[str, ArgKind] = {
    "hidden": INT, "intermediate": INT, "qo_heads": INT, "vocab": INT, "latent_channels": INT,
    "latent_tokens": INT,
}

# `submodel NAME(...) samples OUTPUT depth=N`: a depth model keeps a small KV of its own, so it
# also sets its geometry (Qwen3-TTS's code predictor: 5 layers, 8 KV heads of 128 over 1024 wide).
DEPTH_SUBMODEL_ARGS: dict[str, ArgKind] = {
    "hidden": INT, "intermediate": INT, "qo_heads": INT, "vocab": INT, "layers": INT, "kv_heads": INT,
    "head_dim": INT, "rope_theta": NUMBER,
}

# `state recurrent(...)`: every argument is required (the slot size depends on all four).
RECURRENT_ARGS: dict[str, ArgKind] = {
    "layers": INT, "heads": INT, "key_dim": INT, "value_dim": INT,
}

ENGINE_ARGS: dict[str, dict[str, ArgKind]] = {"kv": KV_ARGS, "stateless": STATELESS_ARGS}


def value_fits(kind: ArgKind, value: ArgValue) -> bool:
    """Whether `value` is a valid value of `kind`."""
    if isinstance(value, bool):
        return False
    if kind.name == "int":
        return isinstance(value, int) and value > 0
    if kind.name == "index":
        return isinstance(value, int) and value >= 0
    if kind.name == "number":
        return isinstance(value, (int, float)) and value > 0
    if kind.name == "fraction":
        return isinstance(value, (int, float)) and 0 < value <= 1
    if kind.name == "choice":
        return isinstance(value, str) and value in kind.choices
    if kind.name == "token_ids":
        return isinstance(value, list) and bool(value) and all(
            isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in value)
    if kind.name == "pattern":
        return pattern_flags(value) is not None
    raise ValueError(f"unknown argument kind {kind.name}")


def pattern_flags(pattern: ArgValue) -> Optional[list[int]]:
    """`layer_pattern` as 0/1 flags, or None when it is not a valid pattern."""
    if isinstance(pattern, str):
        names = [p.strip() for p in pattern.split(",") if p.strip()]
        flags = [LAYER_KIND_FLAGS.get(p, -1) for p in names]
    elif isinstance(pattern, list):
        flags = list(pattern)
    else:
        return None
    if not flags or any(isinstance(f, bool) or f not in (0, 1) for f in flags):
        return None
    return flags


def layer_is_full(pattern: Optional[ArgValue], num_layers: int, has_recurrent: bool) -> Optional[tuple[bool, ...]]:
    """Per-layer flags, True = full (softmax) attention, False = gated delta-net linear attention.

    A list as long as `layers` gives every layer; a shorter list is a unit repeated to `layers`
    (`[0, 0, 0, 1]` = three linear layers then one full layer). Without a pattern every layer is
    full, except on a node with recurrent state, which gets the Qwen3.5 default: every 4th layer
    full. None when `pattern` is not a valid pattern.
    """
    if pattern is None:
        if not has_recurrent:
            return (True,) * num_layers
        return tuple((i + 1) % 4 == 0 for i in range(num_layers))
    flags = pattern_flags(pattern)
    if flags is None:
        return None
    return tuple(bool(flags[i % len(flags)]) for i in range(num_layers))

