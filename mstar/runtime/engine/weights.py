"""Model weights: random from a seed, or a local checkpoint (config.json + *.safetensors).

Random: every parameter gets its own generator seeded from (seed, node, parameter name), so a
node's weights do not depend on which other nodes exist or in which order they are built. Matrices
are N(0, 1/fan_in) (embeddings N(0, 1)), biases zero, norm scales one.

Checkpoint: `read_checkpoint_config(dir)` (in `checkpoint_config`) gives the dims from
config.json, or refuses with a `WeightsError`; `load_checkpoint_weights(model, dir)` copies the
tensors in by name, checking every shape. The engine refuses a checkpoint whose
style is not the node's (a Llama checkpoint on the Qwen3.5 hybrid node, or the reverse).

Which node gets which checkpoint: `weights_by_node(kv_nodes, entries)` reads the `--weights`
entries, each `DIR` or `NODE=DIR`. A bare `DIR` needs a plan with exactly one kv node; with
several (Qwen3-Omni's Thinker and Talker) each checkpoint names its node, and the nodes without
one keep random weights.
"""
from __future__ import annotations

import zlib
from pathlib import Path
from typing import Optional, Union

import torch
from torch import nn

from mstar.runtime.engine.checkpoint_config import WeightsError, read_checkpoint_config

__all__ = ["WeightsError", "init_random", "load_checkpoint_weights", "read_checkpoint_config", "weights_by_node"]


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
