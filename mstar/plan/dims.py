"""Model dimensions per node kind, read from a plan node's `dims` (or shrunk to `tiny` for the CPU).

In: a `NodePlan` (its `dims` dict, `recurrent` state, engine and flavour) and a mode, `"spec"` (the
spec's numbers as written) or `"tiny"` (small numbers that keep the structure: the query-head /
kv-head ratio, the linear/full layer pattern, the codec's window). Out: frozen dataclasses the torch
models are built from. Keys missing from a spec fall back to the defaults below, so a spec only
needs to state what makes its model different.

`layer_pattern` is a list of flags, 1 = full (softmax) attention, 0 = gated delta-net linear
attention. A list as long as `layers` gives every layer; a shorter list is a unit repeated to
`layers` (`[0, 0, 0, 1]` = three linear layers then one full layer).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any, Literal, Mapping, Optional, Protocol

from mstar.plan.node_args import DECODER_STYLES, MLP_WIDTH_PER_HIDDEN, layer_is_full
from mstar.plan.schema import RecurrentState

DimsMode = Literal["tiny", "spec"]
DIMS_MODES: tuple[DimsMode, ...] = ("tiny", "spec")


class DimsError(ValueError):
    """A node's dims cannot describe a model (bad type, bad ratio, bad pattern)."""


# A codec's codebook and quantizers at `tiny` dims (at most); a depth model feeding it shrinks alike
# (engine/submodels.py), so its frames still hold one code per quantizer.
TINY_CODEBOOK = 256
TINY_QUANTIZERS = 4

ROPE_KINDS = ("default", "linear", "dynamic", "yarn", "llama3")


@dataclass(frozen=True)
class RopeScaling:
    """How a checkpoint scales RoPE (config.json's `rope_scaling` / `rope_parameters`); the
    formulas are in `mstar.runtime.engine.models.rope`. `default` is plain RoPE."""

    kind: str = "default"  # one of ROPE_KINDS
    factor: float = 1.0
    original_max_position: int = 0  # llama3, yarn: the pre-training context length
    max_position: int = 0  # dynamic: max_position_embeddings, where the NTK stretch starts
    low_freq_factor: float = 1.0  # llama3
    high_freq_factor: float = 4.0  # llama3
    attention_factor: float = 1.0  # yarn: cos and sin are scaled by it
    beta_fast: float = 32.0  # yarn
    beta_slow: float = 1.0  # yarn
    is_truncated: bool = True  # yarn: round the correction range to whole dims


@dataclass(frozen=True)
class LayerStackDims:
    """What every Llama-style stack of layers states: its layers, heads, widths, vocabulary, RoPE
    base and norm epsilon. `DecoderDims` and a depth model's `DepthDims` (models/depth.py) add
    their own fields to these."""

    num_layers: int
    num_kv_heads: int
    num_qo_heads: int
    head_dim: int
    hidden: int
    intermediate: int
    vocab: int
    rope_theta: float = 10000.0
    rms_eps: float = 1e-5


# Keyword-only: a field without a default (`layer_is_full`) may then follow the base's defaults.
@dataclass(frozen=True, kw_only=True)
class DecoderDims(LayerStackDims):
    """A Llama-style decoder, optionally with gated delta-net layers and an image-flow head."""

    layer_is_full: tuple[bool, ...]  # per layer: softmax attention (True) or gated delta-net
    is_tied_embeddings: bool = False
    # "llama", or "qwen3_5": zero-centred norms (1 + w), q/k norms, a sigmoid output gate per
    # attention head, partial rotary
    style: str = "llama"
    partial_rotary: float = 1.0  # fraction of head_dim that rotates
    rope: RopeScaling = RopeScaling()
    # per-architecture attention details (a checkpoint's config.json sets them; specs keep the
    # defaults of their style): RMSNorm of each q/k head before RoPE (Qwen3; the qwen3_5 style
    # always has it, zero-centred), biases on q/k/v, on o_proj, on the MLP projections
    has_qk_norm: bool = False
    has_qkv_bias: bool = False
    has_o_bias: bool = False
    has_mlp_bias: bool = False
    architecture: str = ""  # the checkpoint's model type, for messages ("" for a spec's random model)
    # gated delta-net layers (unused when every layer is full attention)
    num_linear_heads: int = 2  # q/k heads
    num_linear_value_heads: int = 2  # v heads (a multiple of the q/k heads)
    linear_key_dim: int = 16
    linear_value_dim: int = 16
    conv_kernel: int = 4
    # image-flow head (BAGEL image_gen): latents are `latent_tokens` rows of `latent_channels`
    latent_channels: int = 4
    latent_tokens: int = 16

    @property
    def rotary_dim(self) -> int:
        return max(2, int(self.head_dim * self.partial_rotary) // 2 * 2)

    @property
    def num_full_layers(self) -> int:
        return sum(self.layer_is_full)

    @property
    def num_linear_layers(self) -> int:
        return len(self.layer_is_full) - self.num_full_layers

    @property
    def has_linear_layers(self) -> bool:
        return self.num_linear_layers > 0


@dataclass(frozen=True)
class CodecDims:
    """A SNAC-like codec decoder: codes in, audio samples out."""

    codebook: int
    hidden: int
    num_quantizers: int  # codes per frame (Qwen3-Omni's Code2Wav: 16; SNAC's flattened stream: 1)
    samples_per_token: int  # samples per frame
    sample_rate: int
    keep_frame: int  # which frame of a sliding window the codec keeps (SNAC keeps the 2nd of 4)


@dataclass(frozen=True)
class SnacDims:
    """The SNAC audio decoder (hubertsiuzdak/snac), from its checkpoint's config.json."""

    sampling_rate: int
    latent_dim: int  # width of the summed codebook latents
    decoder_dim: int  # channels after the first conv; halved by every decoder block
    decoder_rates: tuple[int, ...]  # upsampling of each decoder block
    codebook_size: int
    codebook_dim: int
    vq_strides: tuple[int, ...]  # time stride of each codebook, coarsest first (24 kHz: 4, 2, 1)
    has_noise: bool  # noise blocks after each upsampling
    is_depthwise: bool  # depthwise first conv and residual convs

    @property
    def samples_per_frame(self) -> int:
        """Audio samples per coarse code (one Orpheus frame): the decoder's upsampling x the first stride."""
        return math.prod(self.decoder_rates) * self.vq_strides[0]


@dataclass(frozen=True)
class EncoderDims:
    """A small transformer encoder over patches (vision) or feature frames (audio)."""

    hidden: int
    num_layers: int
    num_heads: int
    feature_dim: int  # width of one input patch / frame
    num_tokens: int  # patches or frames synthesised when the media is absent


@dataclass(frozen=True)
class ImageDecoderDims:
    """A VAE-like decoder: a latent grid to an RGB image."""

    latent_channels: int
    latent_tokens: int  # a square grid: sqrt must be an integer
    hidden: int
    upscale: int  # image pixels per latent cell along each side

    @property
    def image_side(self) -> int:
        """Pixels along each side of the square image it makes."""
        return math.isqrt(self.latent_tokens) * self.upscale


class DimsSource(Protocol):
    """What a node's dims are read from: a plan's `NodePlan`, or the compiler's reading of a
    declaration before there is a plan (check_deployment's TP split check)."""

    @property
    def name(self) -> str: ...

    @property
    def dims(self) -> Mapping[str, Any]: ...

    @property
    def recurrent(self) -> Optional[RecurrentState]: ...


def _int(node: DimsSource, key: str, default: int) -> int:
    value = node.dims.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise DimsError(f"node {node.name}: dims {key}={value!r} must be a positive integer")
    return value


def _float(node: DimsSource, key: str, default: float) -> float:
    value = node.dims.get(key, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
        raise DimsError(f"node {node.name}: dims {key}={value!r} must be a positive number")
    return float(value)


def attention_layer_params(hidden: int, qo_width: int, kv_width: int, intermediate: int) -> int:
    """Parameters of one full-attention layer's matrices, which every token runs: q and o (hidden x
    qo width each), k and v (hidden x kv width each) and the MLP's three (hidden x intermediate).
    The sim's roofline (engine/sim_cost.py) and the chunk cost (compiler/chunk_cost.py) share it."""
    return 2 * hidden * qo_width + 2 * hidden * kv_width + 3 * hidden * intermediate


def attention_flops_per_key(qo_width: int, num_full_layers: int) -> int:
    """FLOPs of one query token against one cached key over the full-attention layers (QK^T, PV)."""
    return 4 * qo_width * num_full_layers


def layer_pattern(node: DimsSource, num_layers: int) -> tuple[bool, ...]:
    """Per-layer `is_full` flags (the rule is node_args.layer_is_full, shared with the compiler)."""
    pattern = node.dims.get("layer_pattern")
    flags = layer_is_full(pattern, num_layers, node.recurrent is not None)
    if flags is None:
        raise DimsError(
            f"node {node.name}: layer_pattern={pattern!r} must be a list of 0 (linear) / 1 (full)"
        )
    return flags


def decoder_dims(node: DimsSource, mode: DimsMode) -> DecoderDims:
    """Dims of a kv node's decoder. `tiny` keeps the head ratio and one unit of the layer pattern."""
    num_layers = _int(node, "layers", 2)
    num_kv_heads = _int(node, "kv_heads", 1)
    num_qo_heads = _int(node, "qo_heads", num_kv_heads)
    if num_qo_heads % num_kv_heads:
        raise DimsError(
            f"node {node.name}: qo_heads={num_qo_heads} is not a multiple of kv_heads={num_kv_heads}"
        )
    head_dim = _int(node, "head_dim", 64)
    hidden = _int(node, "hidden", num_qo_heads * head_dim)
    full = layer_pattern(node, num_layers)
    recurrent = node.recurrent
    style = node.dims.get("style", "llama" if all(full) else "qwen3_5")
    if style not in DECODER_STYLES:
        raise DimsError(f"node {node.name}: style={style!r} is not one of {', '.join(DECODER_STYLES)}")
    num_linear_heads = recurrent.num_heads if recurrent else _int(node, "linear_heads", 2)
    dims = DecoderDims(
        num_layers=num_layers,
        num_kv_heads=num_kv_heads,
        num_qo_heads=num_qo_heads,
        head_dim=head_dim,
        hidden=hidden,
        intermediate=_int(node, "intermediate", MLP_WIDTH_PER_HIDDEN * hidden),
        vocab=_int(node, "vocab", 32000),
        layer_is_full=full,
        rope_theta=_float(node, "rope_theta", 10000.0),
        style=style,
        partial_rotary=_float(node, "partial_rotary", 0.25 if style == "qwen3_5" else 1.0),
        num_linear_heads=num_linear_heads,
        num_linear_value_heads=_int(node, "linear_value_heads", num_linear_heads),
        linear_key_dim=recurrent.key_dim if recurrent else _int(node, "linear_key_dim", 16),
        linear_value_dim=recurrent.value_dim if recurrent else _int(node, "linear_value_dim", 16),
        conv_kernel=_int(node, "conv_kernel", 4),
        latent_channels=_int(node, "latent_channels", 16),
        latent_tokens=_int(node, "latent_tokens", 4096),
    )
    if dims.num_linear_value_heads % dims.num_linear_heads:
        raise DimsError(f"node {node.name}: linear_value_heads={dims.num_linear_value_heads} is not a multiple "
                        f"of the {dims.num_linear_heads} linear q/k heads")
    if recurrent is not None and recurrent.num_layers != dims.num_linear_layers:
        raise DimsError(
            f"node {node.name}: recurrent state declares {recurrent.num_layers} layers but the "
            f"layer pattern has {dims.num_linear_layers} linear-attention layers"
        )
    return dims if mode == "spec" else _tiny_decoder_dims(node, dims)


def _tiny_decoder_dims(node: DimsSource, dims: DecoderDims) -> DecoderDims:
    """`tiny` dims: the head ratio and one unit of the layer pattern kept, every width small."""
    unit = _pattern_unit(dims.layer_is_full)
    ratio = dims.num_qo_heads // dims.num_kv_heads
    tiny_kv = min(dims.num_kv_heads, 2)
    return replace(
        dims,
        num_layers=len(unit) if node.recurrent or "layer_pattern" in node.dims else 2,
        num_kv_heads=tiny_kv,
        num_qo_heads=tiny_kv * min(ratio, 4),
        head_dim=16,
        hidden=64,
        intermediate=128,
        vocab=min(dims.vocab, 512),
        layer_is_full=unit if node.recurrent or "layer_pattern" in node.dims else (True, True),
        num_linear_heads=2,
        num_linear_value_heads=2 * (dims.num_linear_value_heads // dims.num_linear_heads),
        linear_key_dim=16,
        linear_value_dim=16,
        latent_channels=4,
        latent_tokens=16,
    )


def _pattern_unit(full: tuple[bool, ...]) -> tuple[bool, ...]:
    """The shortest prefix that repeats to `full` (one block of the 3:1 pattern)."""
    for size in range(1, len(full) + 1):
        if all(full[i] == full[i % size] for i in range(len(full))):
            return full[:size]
    return full


def codec_dims(node: DimsSource, mode: DimsMode) -> CodecDims:
    """Dims of an audio codec; `tiny` makes few samples per token and a narrow network."""
    keep_frame = node.dims.get("keep_frame", 1)
    dims = CodecDims(
        codebook=_int(node, "codebook", 4096),
        hidden=_int(node, "hidden", 256),
        num_quantizers=_int(node, "quantizers", 1),
        samples_per_token=_int(node, "samples_per_token", 292),
        sample_rate=_int(node, "sample_rate", 24000),
        keep_frame=keep_frame if isinstance(keep_frame, int) else 1,
    )
    if mode == "spec":
        return dims
    return replace(dims, codebook=min(dims.codebook, TINY_CODEBOOK), hidden=32,
                   num_quantizers=min(dims.num_quantizers, TINY_QUANTIZERS), samples_per_token=32)


def encoder_dims(node: DimsSource, mode: DimsMode, is_audio: bool) -> EncoderDims:
    """Dims of a vision or audio encoder."""
    # Defaults that always fit each other: hidden 1024 (or 64 per head when only `heads` is given),
    # heads 16 (or the largest count below it that divides `hidden`). The compiler checks `hidden`
    # against `heads` when a spec gives both (MW112).
    heads = node.dims.get("heads")
    hidden = _int(node, "hidden", 64 * heads if isinstance(heads, int) else 1024)
    default_heads = next(h for h in range(16, 0, -1) if hidden % h == 0)
    dims = EncoderDims(
        hidden=hidden,
        num_layers=_int(node, "layers", 4),
        num_heads=_int(node, "heads", default_heads),
        feature_dim=_int(node, "feature_dim", 128 if is_audio else 588),
        num_tokens=_int(node, "num_tokens", 256),
    )
    if dims.hidden % dims.num_heads:
        raise DimsError(f"node {node.name}: hidden={dims.hidden} is not a multiple of heads={dims.num_heads}")
    if mode == "spec":
        return dims
    return replace(dims, hidden=32, num_layers=1, num_heads=2, feature_dim=16 if is_audio else 48, num_tokens=8)


def image_decoder_dims(node: DimsSource, mode: DimsMode, latent: Optional[DecoderDims]) -> ImageDecoderDims:
    """Dims of a latents-to-image decoder; the latent shape follows the producing LLM's flow head."""
    dims = ImageDecoderDims(
        latent_channels=latent.latent_channels if latent else _int(node, "latent_channels", 16),
        latent_tokens=latent.latent_tokens if latent else _int(node, "latent_tokens", 4096),
        hidden=_int(node, "hidden", 128),
        upscale=_int(node, "upscale", 16),
    )
    side = round(dims.latent_tokens ** 0.5)
    if side * side != dims.latent_tokens:
        raise DimsError(f"node {node.name}: latent_tokens={dims.latent_tokens} is not a square grid")
    if mode == "spec":
        return dims
    return replace(dims, hidden=16, upscale=8)


def tp_split_problem(d: DecoderDims, size: int) -> str:
    """Why a decoder of dims `d` cannot be split over `size` tensor-parallel ranks ("" when it
    can): the runtime's shard layout (engine/tp/layout.py) and the compiler's check (MW326) both ask."""
    if size < 1:
        return "the group size must be at least 1"
    if d.num_full_layers and d.num_qo_heads % size:
        return f"qo_heads={d.num_qo_heads} is not a multiple of {size}"
    kv = d.num_kv_heads
    if d.num_full_layers and kv % size and size % kv:
        return (f"kv_heads={kv}: each rank needs whole kv heads, so kv_heads must be a multiple of {size} "
                f"(split) or divide it (each kv head replicated on {size} // kv_heads ranks)")
    if d.intermediate % size:
        return f"intermediate={d.intermediate} is not a multiple of {size}"
    if d.has_linear_layers and (d.num_linear_heads % size or d.num_linear_value_heads % size):
        return (f"the gated delta-net's {d.num_linear_heads} q/k heads and {d.num_linear_value_heads} value "
                f"heads must both be multiples of {size}")
    return ""
