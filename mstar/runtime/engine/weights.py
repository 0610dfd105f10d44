"""Model weights: random from a seed, or a local checkpoint (config.json + *.safetensors).

Random: every parameter gets its own generator seeded from (seed, node, parameter name), so a
node's weights do not depend on which other nodes exist or in which order they are built. Matrices
are N(0, 1/fan_in) (embeddings N(0, 1)), biases zero, norm scales one.

Checkpoint: `read_checkpoint_config(dir)` gives the dims from config.json for a LlamaForCausalLM
(style `llama`) or a Qwen3.5 text model (Qwen3_5ForCausalLM, or the text part of
Qwen3_5ForConditionalGeneration: style `qwen3_5`), and refuses with a `WeightsError` anything else
(another architecture, biases, scaled RoPE, a non-SiLU activation); `load_checkpoint_weights(model,
dir)` copies the tensors in by name, checking every shape. The engine refuses a checkpoint whose
style is not the node's (a Llama checkpoint on the Qwen3.5 hybrid node, or the reverse).

Which node gets which checkpoint: `weights_by_node(kv_nodes, entries)` reads the `--weights`
entries, each `DIR` or `NODE=DIR`. A bare `DIR` needs a plan with exactly one kv node; with
several (Qwen3-Omni's Thinker and Talker) each checkpoint names its node, and the nodes without
one keep random weights.
"""
from __future__ import annotations

import json
import zlib
from pathlib import Path
from typing import Optional, Union

import torch
from torch import nn

from mstar.runtime.engine.dims import DecoderDims

ARCHITECTURE_STYLES = {
    "LlamaForCausalLM": "llama",
    "Qwen3_5ForCausalLM": "qwen3_5",
    "Qwen3_5ForConditionalGeneration": "qwen3_5",  # its text model; the vision tower is skipped
}
MODEL_TYPE_STYLES = {"llama": "llama", "qwen3_5": "qwen3_5", "qwen3_5_text": "qwen3_5"}


class WeightsError(ValueError):
    """A checkpoint is missing, malformed, or does not fit the node."""


def weights_by_node(kv_nodes: list[str], entries: Optional[Union[str, list[str]]]) -> dict[str, str]:
    """{kv node: checkpoint dir} from `--weights` entries (`DIR` or `NODE=DIR`); WeightsError
    for an unknown node, a node named twice, or a bare DIR when the plan has several kv nodes."""
    if entries is None:
        return {}
    if isinstance(entries, str):
        entries = [entries]
    assigned: dict[str, str] = {}
    for entry in entries:
        node, sep, directory = entry.partition("=")
        if not sep or (node not in kv_nodes and Path(entry).exists()):
            node, directory = "", entry  # a bare directory (its path may contain '=')
        if not node:
            if len(kv_nodes) != 1:
                raise WeightsError(
                    f"--weights {entry}: the plan has {len(kv_nodes)} kv nodes "
                    f"({', '.join(kv_nodes) or 'none'}); name the one it is for: --weights NODE=DIR")
            node = kv_nodes[0]
        elif node not in kv_nodes:
            raise WeightsError(f"--weights {entry}: {node!r} is not a kv node of the plan "
                               f"(kv nodes: {', '.join(kv_nodes) or 'none'})")
        if node in assigned:
            raise WeightsError(f"--weights {entry}: node {node} already gets {assigned[node]}")
        assigned[node] = directory
    return assigned


def param_seed(seed: int, node: str, name: str) -> int:
    return zlib.crc32(f"{seed}/{node}/{name}".encode())


def init_random(module: nn.Module, seed: int, node: str) -> None:
    """Fill every parameter of `module` deterministically (rules in the module docstring)."""
    embeddings = {name for name, m in module.named_modules() if isinstance(m, nn.Embedding)}
    with torch.no_grad():
        for name, param in module.named_parameters():
            if param.dim() < 2:
                # 1-D parameters keep their constructor values: norm scales 1, biases 0,
                # gated delta-net decay parameters at their documented starts.
                if name.endswith("bias") and "dt_bias" not in name:
                    param.zero_()
                continue
            generator = torch.Generator().manual_seed(param_seed(seed, node, name))
            fan_in = param[0].numel()
            std = 1.0 if name.rsplit(".", 1)[0] in embeddings else fan_in ** -0.5
            param.copy_(torch.randn(param.shape, generator=generator) * std)


def _style_of(config: dict, path: Path) -> str:
    architectures = config.get("architectures") or []
    for arch in architectures:
        if arch in ARCHITECTURE_STYLES:
            return ARCHITECTURE_STYLES[arch]
    model_type = config.get("model_type")
    if model_type in MODEL_TYPE_STYLES and not architectures:
        return MODEL_TYPE_STYLES[model_type]
    found = ", ".join(architectures) or model_type or "unknown"
    raise WeightsError(f"{path}: architecture {found} is not one the engine loads "
                       f"({', '.join(ARCHITECTURE_STYLES)})")


def read_checkpoint_config(weights_dir: str) -> DecoderDims:
    """Dims (and style) of the checkpoint in `weights_dir`, or a WeightsError saying why it cannot load."""
    path = Path(weights_dir) / "config.json"
    if not path.is_file():
        raise WeightsError(f"--weights {weights_dir}: no config.json there (expected a Llama-layout checkpoint)")
    try:
        config = json.loads(path.read_text())
    except json.JSONDecodeError as error:
        raise WeightsError(f"{path}: not valid JSON ({error})") from None
    if not isinstance(config, dict):
        raise WeightsError(f"{path}: not a JSON object")
    style = _style_of(config, path)
    if isinstance(config.get("text_config"), dict):  # a VLM checkpoint: the text model's config
        config = {**config["text_config"], "tie_word_embeddings": config.get(
            "tie_word_embeddings", config["text_config"].get("tie_word_embeddings", False))}
    for flag in ("attention_bias", "mlp_bias"):
        if config.get(flag):
            raise WeightsError(f"{path}: {flag}=true is not supported by the engine's decoder")
    if config.get("hidden_act", "silu") != "silu":
        raise WeightsError(f"{path}: hidden_act={config['hidden_act']!r}; the engine's decoder uses silu")
    rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type != "default":
        raise WeightsError(f"{path}: rope_type {rope_type!r} is not supported (only unscaled RoPE)")
    try:
        return _dims(config, style, rope)
    except (KeyError, TypeError, ValueError) as error:
        raise WeightsError(f"{path}: missing or bad field ({error})") from None


def _dims(config: dict, style: str, rope: dict) -> DecoderDims:
    hidden = int(config["hidden_size"])
    num_heads = int(config["num_attention_heads"])
    num_layers = int(config["num_hidden_layers"])
    common = dict(
        num_layers=num_layers,
        num_kv_heads=int(config.get("num_key_value_heads") or num_heads),
        num_qo_heads=num_heads,
        head_dim=int(config.get("head_dim") or hidden // num_heads),
        hidden=hidden,
        intermediate=int(config["intermediate_size"]),
        vocab=int(config["vocab_size"]),
        rope_theta=float(rope.get("rope_theta", config.get("rope_theta", 10000.0))),
        rms_eps=float(config.get("rms_norm_eps", 1e-6)),
        is_tied_embeddings=bool(config.get("tie_word_embeddings", False)),
        style=style,
    )
    if style == "llama":
        return DecoderDims(layer_is_full=(True,) * num_layers, **common)
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
        partial_rotary=float(rope.get("partial_rotary_factor", config.get("partial_rotary_factor", 0.25))),
        num_linear_heads=num_linear_heads,
        num_linear_value_heads=num_value_heads,
        linear_key_dim=int(config["linear_key_head_dim"]),
        linear_value_dim=int(config["linear_value_head_dim"]),
        conv_kernel=int(config.get("linear_conv_kernel_dim", 4)),
        **common,
    )


def _checkpoint_name(name: str) -> str:
    """A VLM checkpoint keeps its text model under `model.language_model.`."""
    prefix = "model.language_model."
    return "model." + name[len(prefix):] if name.startswith(prefix) else name


def load_checkpoint_weights(model: nn.Module, weights_dir: str, is_tied: bool) -> None:
    """Copy the checkpoint's tensors into a `Decoder` built from `read_checkpoint_config`'s dims.

    Tensors the decoder has no use for (a vision tower, multi-token-prediction layers) are skipped.
    """
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    files = sorted(Path(weights_dir).glob("*.safetensors"))
    if not files:
        raise WeightsError(f"--weights {weights_dir}: no *.safetensors files")
    tensors: dict[str, torch.Tensor] = {}
    for file in files:
        try:
            loaded = load_file(str(file))
        except (SafetensorError, OSError) as error:  # a truncated, corrupt or unreadable file
            raise WeightsError(f"--weights {weights_dir}: cannot read {file.name}: {error}") from None
        tensors.update({_checkpoint_name(k): v for k, v in loaded.items()})
    if is_tied and "lm_head.weight" not in tensors and "model.embed_tokens.weight" in tensors:
        tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"]
    params = {name: p for name, p in model.named_parameters() if not name.startswith("flow.")}
    missing = sorted(set(params) - set(tensors))
    if missing:
        raise WeightsError(f"--weights {weights_dir}: missing tensors {', '.join(missing[:4])}"
                           + (f" and {len(missing) - 4} more" if len(missing) > 4 else ""))
    with torch.no_grad():
        for name, param in params.items():
            tensor = tensors[name]
            if tuple(tensor.shape) != tuple(param.shape):
                raise WeightsError(f"--weights {weights_dir}: {name} has shape {tuple(tensor.shape)}, "
                                   f"config.json implies {tuple(param.shape)}")
            param.copy_(tensor.to(param.dtype))
