"""Model weights: random from a seed, or a local Llama-layout checkpoint (config.json + *.safetensors).

Random: every parameter gets its own generator seeded from (seed, node, parameter name), so a
node's weights do not depend on which other nodes exist or in which order they are built. Matrices
are N(0, 1/fan_in) (embeddings N(0, 1)), biases zero, norm scales one.

Checkpoint: `read_llama_config(dir)` refuses with a `WeightsError` anything that is not a plain
LlamaForCausalLM (another architecture, biases, scaled RoPE, a non-SiLU activation) and gives the
dims from config.json; `load_llama_weights(model, dir)` copies the tensors in by name, checking
every shape. A node with linear-attention layers is refused by the engine before loading.
"""
from __future__ import annotations

import json
import zlib
from pathlib import Path

import torch
from torch import nn

from mstar.runtime.dims import DecoderDims

LLAMA_ARCHITECTURES = ("LlamaForCausalLM",)


class WeightsError(ValueError):
    """A checkpoint is missing, malformed, or does not fit the node."""


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


def read_llama_config(weights_dir: str) -> DecoderDims:
    """Dims of the Llama checkpoint in `weights_dir`, or a WeightsError saying why it cannot load."""
    path = Path(weights_dir) / "config.json"
    if not path.is_file():
        raise WeightsError(f"--weights {weights_dir}: no config.json there (expected a Llama-layout checkpoint)")
    try:
        config = json.loads(path.read_text())
    except json.JSONDecodeError as error:
        raise WeightsError(f"{path}: not valid JSON ({error})") from None
    architectures = config.get("architectures") or []
    if not (set(architectures) & set(LLAMA_ARCHITECTURES) or config.get("model_type") == "llama"):
        found = ", ".join(architectures) or config.get("model_type", "unknown")
        raise WeightsError(f"{path}: architecture {found} does not fit a Llama decoder node (need LlamaForCausalLM)")
    for flag in ("attention_bias", "mlp_bias"):
        if config.get(flag):
            raise WeightsError(f"{path}: {flag}=true is not supported by the engine's Llama decoder")
    if config.get("hidden_act", "silu") != "silu":
        raise WeightsError(f"{path}: hidden_act={config['hidden_act']!r}; the engine's Llama decoder uses silu")
    rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type != "default":
        raise WeightsError(f"{path}: rope_type {rope_type!r} is not supported (only unscaled RoPE)")
    try:
        hidden = int(config["hidden_size"])
        num_heads = int(config["num_attention_heads"])
        num_layers = int(config["num_hidden_layers"])
        return DecoderDims(
            num_layers=num_layers,
            num_kv_heads=int(config.get("num_key_value_heads") or num_heads),
            num_qo_heads=num_heads,
            head_dim=int(config.get("head_dim") or hidden // num_heads),
            hidden=hidden,
            intermediate=int(config["intermediate_size"]),
            vocab=int(config["vocab_size"]),
            layer_is_full=(True,) * num_layers,
            rope_theta=float(rope.get("rope_theta", config.get("rope_theta", 10000.0))),
            rms_eps=float(config.get("rms_norm_eps", 1e-6)),
            is_tied_embeddings=bool(config.get("tie_word_embeddings", False)),
        )
    except (KeyError, TypeError, ValueError) as error:
        raise WeightsError(f"{path}: missing or bad field ({error})") from None


def load_llama_weights(model: nn.Module, weights_dir: str, is_tied: bool) -> None:
    """Copy the checkpoint's tensors into a `Decoder` built from `read_llama_config`'s dims."""
    from safetensors.torch import load_file

    files = sorted(Path(weights_dir).glob("*.safetensors"))
    if not files:
        raise WeightsError(f"--weights {weights_dir}: no *.safetensors files")
    tensors: dict[str, torch.Tensor] = {}
    for file in files:
        tensors.update(load_file(str(file)))
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
