"""A Hugging Face checkpoint's config.json -> the `DecoderDims` its weights need.

In: a checkpoint directory. Out: `DecoderDims` (style, dims, RoPE kind, per-architecture attention
details), or a `WeightsError` saying why the engine cannot load it.

Architectures (config.json's `architectures`, else its `model_type`):
- `LlamaForCausalLM` (style `llama`): `attention_bias` (q/k/v/o) and `mlp_bias` as configured;
- `Qwen2ForCausalLM` (style `llama`): biases on q/k/v, none on o_proj;
- `Qwen3ForCausalLM` (style `llama`): RMSNorm of every q/k head before RoPE, `attention_bias`;
- `Qwen3ASRForConditionalGeneration`: its Qwen3 text model (`text_config`, tensors below
  `model.language_model.`); the audio tower loads through qwen3_asr_setup.py;
- `Qwen3_5ForCausalLM`, or the text model of `Qwen3_5ForConditionalGeneration` (style `qwen3_5`):
  the gated delta-net hybrid, its layer types, linear-attention dims and partial rotary.
RoPE: `rope_parameters` (transformers 5) or `rope_scaling` (older files), of kind `default`,
`linear`, `dynamic`, `yarn` or `llama3`; `rope_theta` and `partial_rotary_factor` may sit inside
it or at the top level. Refused: other architectures and RoPE kinds, sliding-window attention, an
activation other than SiLU.

Values are checked before they are used (`_check_values`), each refusal naming the file and the
field: dims (`hidden_size`, `num_hidden_layers`, `num_attention_heads`, `intermediate_size`,
`vocab_size`, and `num_key_value_heads`, `head_dim` and the linear-attention dims when given)
are positive integers (not floats or booleans), `num_attention_heads` a multiple of
`num_key_value_heads`; `rope_theta` and `rms_norm_eps` finite and positive;
`partial_rotary_factor` in (0, 1]. config.json is read through mstar.files' bounded reader (a
regular file of at most MAX_JSON_CONFIG_BYTES). Whether `num_hidden_layers` matches the layers
the checkpoint holds is checked when the tensors are loaded (weights.py).
"""
from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, TypedDict

from mstar.arg_types import shown_path
from mstar.files import MAX_JSON_CONFIG_BYTES, InputFileError, read_text_bounded
from mstar.plan.dims import ROPE_KINDS, DecoderDims, RopeScaling


class WeightsError(ValueError):
    """A checkpoint is missing, malformed, or does not fit the node."""


# architecture -> (style, model type)
ARCHITECTURES = {
    "LlamaForCausalLM": ("llama", "llama"),
    "Qwen2ForCausalLM": ("llama", "qwen2"),
    "Qwen3ForCausalLM": ("llama", "qwen3"),
    "Qwen3ASRForConditionalGeneration": ("llama", "qwen3"),  # its text model; the audio tower loads apart
    "Qwen3_5ForCausalLM": ("qwen3_5", "qwen3_5"),
    "Qwen3_5ForConditionalGeneration": ("qwen3_5", "qwen3_5"),  # its text model; the vision tower is skipped
}
# dims that must be positive integers: always, and when present (None: derived from the others)
MAX_DIM = 2**31 - 1  # the largest size a config.json dimension may give (a tensor index's range)
POSITIVE_DIMS = ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "vocab_size")
OPTIONAL_POSITIVE_DIMS = ("num_key_value_heads", "head_dim", "max_position_embeddings")
QWEN3_5_POSITIVE_DIMS = ("linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim",
                         "linear_value_head_dim")
QWEN3_5_OPTIONAL_POSITIVE_DIMS = ("linear_conv_kernel_dim", "full_attention_interval")
MODEL_TYPES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
               "qwen3_asr": "Qwen3ASRForConditionalGeneration",
               "qwen3_5": "Qwen3_5ForConditionalGeneration", "qwen3_5_text": "Qwen3_5ForCausalLM"}


def _architecture_of(config: dict, path: Path) -> tuple[str, str]:
    architectures = config.get("architectures") or []
    for arch in architectures:
        if arch in ARCHITECTURES:
            return ARCHITECTURES[arch]
    model_type = config.get("model_type")
    if model_type in MODEL_TYPES and not architectures:
        return ARCHITECTURES[MODEL_TYPES[model_type]]
    found = ", ".join(architectures) or model_type or "unknown"
    raise WeightsError(f"{path}: architecture {found} is not one the engine loads "
                       f"({', '.join(ARCHITECTURES)})")


def read_checkpoint_config(weights_dir: str) -> DecoderDims:
    """Dims (and style) of the checkpoint in `weights_dir`, or a WeightsError saying why it cannot load."""
    path = Path(weights_dir) / "config.json"
    if not path.exists():
        raise WeightsError(f"--weights {shown_path(weights_dir)}: no config.json there (expected a Hugging Face "
                           "checkpoint)")
    config = read_json_object(path, "checkpoint config")
    style, architecture = _architecture_of(config, path)
    if isinstance(config.get("text_config"), dict):  # a VLM checkpoint: the text model's config
        config = {**config["text_config"], "tie_word_embeddings": config.get(
            "tie_word_embeddings", config["text_config"].get("tie_word_embeddings", False))}
    _check_values(config, style, path)
    if config.get("hidden_act", "silu") != "silu":
        raise WeightsError(f"{path}: hidden_act={config['hidden_act']!r}; the engine's decoder uses silu")
    if config.get("use_sliding_window") or "sliding_attention" in (config.get("layer_types") or []):
        raise WeightsError(f"{path}: sliding-window attention is not supported by the engine's decoder")
    try:
        rope = _rope_parameters(config)
        return _dims(config, style, architecture, rope, _rope_scaling(config, rope))
    except (KeyError, TypeError, ValueError, ZeroDivisionError) as error:
        raise WeightsError(f"{path}: missing or bad field ({error})") from None


def read_json_object(path: Path, what: str) -> dict:
    """A JSON object from a small file (config.json, a safetensors index), read bounded; a
    WeightsError naming the file otherwise."""
    try:
        config = json.loads(read_text_bounded(path, max_bytes=MAX_JSON_CONFIG_BYTES, what=what))
    except InputFileError as error:
        raise WeightsError(str(error)) from None
    except json.JSONDecodeError as error:
        raise WeightsError(f"{path}: not valid JSON ({error})") from None
    except (ValueError, RecursionError):  # a number past the digit limit; nesting past the stack
        raise WeightsError(f"{path}: not JSON the engine can read (a number too long or nesting too deep)") from None
    if not isinstance(config, dict):
        raise WeightsError(f"{path}: not a JSON object")
    return config


def _check_values(config: dict, style: str, path: Path) -> None:
    """Refuse values that would build a wrong model silently, or fail later without a reason."""
    required = POSITIVE_DIMS + (QWEN3_5_POSITIVE_DIMS if style == "qwen3_5" else ())
    optional = OPTIONAL_POSITIVE_DIMS + (QWEN3_5_OPTIONAL_POSITIVE_DIMS if style == "qwen3_5" else ())
    for name in required + optional:
        value = config.get(name)
        if value is None and name in optional:
            continue
        if value is None:
            raise WeightsError(f"{path}: missing field {name!r}")
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise WeightsError(f"{path}: {name} must be a positive integer, got {_shown(value)}")
        if value > MAX_DIM:  # (a vocab_size of 2**62 overflowed the memory probe's sizes: "a bug in mstar")
            raise WeightsError(f"{path}: {name} is {_shown(value)}, past any model's ({MAX_DIM})")
    num_kv_heads = config.get("num_key_value_heads") or config["num_attention_heads"]
    if config["num_attention_heads"] % num_kv_heads:
        raise WeightsError(f"{path}: num_attention_heads {config['num_attention_heads']} is not a multiple of "
                           f"num_key_value_heads {num_kv_heads}")
    rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
    rope = rope if isinstance(rope, dict) else {}  # not an object: refused by _rope_parameters
    for name, value in (("rope_theta", rope.get("rope_theta", config.get("rope_theta"))),
                        ("rms_norm_eps", config.get("rms_norm_eps"))):
        if value is not None and not _is_finite_positive(value):
            raise WeightsError(f"{path}: {name} must be a finite positive number, got {_shown(value)}")
    partial = rope.get("partial_rotary_factor", config.get("partial_rotary_factor"))
    if partial is not None and not (_is_finite_positive(partial) and partial <= 1):
        raise WeightsError(f"{path}: partial_rotary_factor must be in (0, 1], got {_shown(partial)}")


def _is_finite_positive(value: Any) -> bool:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    try:
        return math.isfinite(value) and value > 0
    except OverflowError:  # an int past the float range
        return False


def _shown(value: Any) -> str:
    text = json.dumps(value) if not isinstance(value, float) else repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _rope_parameters(config: dict) -> dict:
    rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
    if not isinstance(rope, dict):
        raise ValueError(f"rope_parameters {rope!r} is not an object")
    if set(rope) & {"full_attention", "sliding_attention"}:
        raise ValueError("RoPE parameters per layer type are not supported")
    return rope


def _rope_scaling(config: dict, rope: dict) -> RopeScaling:
    """The RoPE kind and its numbers, with transformers' defaults for the optional ones."""
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind not in ROPE_KINDS:
        raise ValueError(f"rope_type {kind!r} is not supported (the engine has {', '.join(ROPE_KINDS)})")
    if kind == "default":
        return RopeScaling()
    max_position = int(config.get("max_position_embeddings", 0))
    # A top-level original_max_position_embeddings wins (Phi-3 keeps it there), as in transformers.
    original = int(config.get("original_max_position_embeddings") or rope.get("original_max_position_embeddings")
                   or max_position)
    factor = rope.get("factor")
    if kind == "yarn" and factor is None:
        factor = max_position / original
    if factor is None:
        raise ValueError(f"{kind} RoPE needs a factor")
    factor = float(factor)
    if factor <= 0:
        raise ValueError(f"rope factor {factor} must be positive")
    if kind == "dynamic" and max_position <= 0:
        raise ValueError("dynamic RoPE needs max_position_embeddings")
    if kind in ("llama3", "yarn") and original <= 0:
        raise ValueError(f"{kind} RoPE needs original_max_position_embeddings")
    if kind == "llama3":
        return RopeScaling(kind=kind, factor=factor, original_max_position=original,
                           low_freq_factor=float(rope["low_freq_factor"]),
                           high_freq_factor=float(rope["high_freq_factor"]))
    if kind == "yarn":
        return RopeScaling(kind=kind, factor=factor, original_max_position=original,
                           attention_factor=_yarn_attention_factor(rope, factor),
                           beta_fast=float(rope.get("beta_fast") or 32), beta_slow=float(rope.get("beta_slow") or 1),
                           is_truncated=bool(rope.get("truncate", True)))
    return RopeScaling(kind=kind, factor=factor, max_position=max_position)  # linear, dynamic


def _yarn_attention_factor(rope: dict, factor: float) -> float:
    """YaRN's cos/sin scale: given, or 0.1 ln(factor) + 1 (with DeepSeek's mscale ratio when set)."""
    if rope.get("attention_factor") is not None:
        return float(rope["attention_factor"])

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    if rope.get("mscale") and rope.get("mscale_all_dim"):
        return float(mscale(factor, rope["mscale"]) / mscale(factor, rope["mscale_all_dim"]))
    return mscale(factor)


class _SharedDims(TypedDict):
    """The `DecoderDims` fields both decoder styles read the same way from config.json."""

    num_layers: int
    num_kv_heads: int
    num_qo_heads: int
    head_dim: int
    hidden: int
    intermediate: int
    vocab: int
    rope_theta: float
    rope: RopeScaling
    rms_eps: float
    is_tied_embeddings: bool
    style: str
    architecture: str


def _dims(config: dict, style: str, architecture: str, rope: dict, scaling: RopeScaling) -> DecoderDims:
    hidden = int(config["hidden_size"])
    num_heads = int(config["num_attention_heads"])
    num_layers = int(config["num_hidden_layers"])
    has_attention_bias = bool(config.get("attention_bias", False))
    common = _SharedDims(
        num_layers=num_layers,
        num_kv_heads=int(config.get("num_key_value_heads") or num_heads),
        num_qo_heads=num_heads,
        head_dim=int(config.get("head_dim") or hidden // num_heads),
        hidden=hidden,
        intermediate=int(config["intermediate_size"]),
        vocab=int(config["vocab_size"]),
        rope_theta=float(rope.get("rope_theta", config.get("rope_theta", 10000.0))),
        rope=scaling,
        rms_eps=float(config.get("rms_norm_eps", 1e-6)),
        is_tied_embeddings=bool(config.get("tie_word_embeddings", False)),
        style=style,
        architecture=architecture,
    )
    partial = rope.get("partial_rotary_factor", config.get("partial_rotary_factor"))
    if style == "llama":
        return DecoderDims(
            layer_is_full=(True,) * num_layers,
            partial_rotary=float(partial if partial is not None else 1.0),
            has_qk_norm=architecture == "qwen3",
            has_qkv_bias=has_attention_bias or architecture == "qwen2",
            has_o_bias=has_attention_bias and architecture != "qwen2",
            has_mlp_bias=bool(config.get("mlp_bias", False)),
            **common,
        )
    if has_attention_bias or config.get("mlp_bias"):
        raise ValueError("attention_bias / mlp_bias on a Qwen3.5 model")
    if config.get("attn_output_gate", True) is not True:
        raise ValueError("attn_output_gate=false is not supported")
    types = config.get("layer_types") or [
        "full_attention" if (i + 1) % int(config.get("full_attention_interval", 4)) == 0 else "linear_attention"
        for i in range(num_layers)]
    if len(types) != num_layers or set(types) - {"full_attention", "linear_attention"}:
        raise ValueError(f"layer_types {types!r}")
    num_linear_heads = int(config["linear_num_key_heads"])
    num_value_heads = int(config["linear_num_value_heads"])
    if num_value_heads % num_linear_heads:
        raise ValueError("linear_num_value_heads is not a multiple of linear_num_key_heads")
    return DecoderDims(
        layer_is_full=tuple(t == "full_attention" for t in types),
        partial_rotary=float(partial if partial is not None else 0.25),
        num_linear_heads=num_linear_heads,
        num_linear_value_heads=num_value_heads,
        linear_key_dim=int(config["linear_key_head_dim"]),
        linear_value_dim=int(config["linear_value_head_dim"]),
        conv_kernel=int(config.get("linear_conv_kernel_dim", 4)),
        **common,
    )
