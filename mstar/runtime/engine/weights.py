"""Model weights: random from a seed, or a local checkpoint (config.json + *.safetensors).

Random: every parameter gets its own generator seeded from (seed, the node's position in the plan,
the parameter's module path), so a node's weights do not depend on the order they are built in nor
on any name the spec's author chose. Matrices
are N(0, 1/fan_in) (embeddings N(0, 1)), biases zero, norm scales one.

Checkpoint: `read_checkpoint_config(dir)` (in `checkpoint_config`) gives the dims from
config.json, or refuses with a `WeightsError`; `load_decoder(factory, dir, ...)` builds the decoder
on the meta device and fills it shard by shard from memory-mapped files, straight into the target
dtype and device (`load_checkpoint_weights` copies the tensors in by name, checking every shape,
the layer count and every value: `checkpoint_files` says which files are read and refuses NaN
and Inf). The engine refuses a checkpoint whose
style is not the node's (a Llama checkpoint on the Qwen3.5 hybrid node, or the reverse).

Which node gets which checkpoint: `weights_by_node(kv_nodes, entries)` reads the `--weights`
entries, each `DIR` or `NODE=DIR`. A bare `DIR` needs a plan with exactly one kv node; with
several (Qwen3-Omni's Thinker and Talker) each checkpoint names its node, and the nodes without
one keep random weights.
"""
from __future__ import annotations

import math
import os
import zlib
from typing import Callable, Optional, Sequence, Union

import torch
from torch import nn

from mstar.arg_types import shown, shown_path
from mstar.runtime.engine.checkpoint_config import WeightsError, read_checkpoint_config
from mstar.runtime.engine.checkpoint_files import check_finite, tensor_index, wanted_by_file
from mstar.runtime.engine.models.decoder import Decoder

_CPU = torch.device("cpu")  # the default device (a module constant: one object, not a call per signature)

__all__ = ["WeightsError", "init_random", "load_checkpoint_weights", "load_decoder", "read_checkpoint_config",
           "weights_by_node"]


def weights_by_node(kv_nodes: list[str], entries: Optional[Union[str, list[str]]],
                    codec_nodes: Sequence[str] = ()) -> dict[str, str]:
    """{node: checkpoint dir} from `--weights` entries (`DIR` or `NODE=DIR`); a NODE is a kv node
    or an audio codec node (a SNAC checkpoint), a bare DIR goes to the plan's one kv node.
    WeightsError for an unknown node, a node named twice, an empty DIR, or a bare DIR when the plan
    has several kv nodes."""
    if entries is None:
        return {}
    if isinstance(entries, str):
        entries = [entries]
    loadable = list(kv_nodes) + list(codec_nodes)
    assigned: dict[str, str] = {}
    for entry in entries:
        node, sep, directory = entry.partition("=")
        # os.path.exists, not Path.exists: False for a name the OS cannot take (ENAMETOOLONG raised)
        if not sep or (node not in loadable and os.path.exists(entry)):
            node, directory = "", entry  # a bare directory (its path may contain '=')
        if not directory:  # Path("") is the working directory: `--weights ""` read ./config.json
            raise WeightsError(f"--weights {shown(entry)}: no checkpoint directory given (--weights DIR, or NODE=DIR)")
        if not node:
            if len(kv_nodes) != 1:
                raise WeightsError(
                    f"--weights {shown_path(entry)}: the plan has {len(kv_nodes)} kv nodes "
                    f"({', '.join(kv_nodes) or 'none'}); name the one it is for: --weights NODE=DIR")
            node = kv_nodes[0]
        elif node not in loadable:
            raise WeightsError(f"--weights {shown_path(entry)}: {shown(node)} is not a kv or audio codec node of the "
                               f"plan (those nodes: {', '.join(loadable) or 'none'})")
        if node in assigned:
            raise WeightsError(f"--weights {shown_path(entry)}: node {node} already gets {shown_path(assigned[node])}")
        assigned[node] = directory
    return assigned


def param_seed(seed: int, position: int, name: str) -> int:
    """The seed of parameter `name` (a torch module path) of the plan's node at `position`."""
    return zlib.crc32(f"{seed}/{position}/{name}".encode())


def init_random(module: nn.Module, seed: int, position: int, names: Optional[set[str]] = None) -> None:
    """Fill every parameter of `module` (or only those in `names`) deterministically (rules in the
    module docstring); `position`: the node's index in the plan."""
    embeddings = {name for name, m in module.named_modules() if isinstance(m, nn.Embedding)}
    with torch.no_grad():
        for name, param in module.named_parameters():
            if names is not None and name not in names:
                continue
            if param.dim() < 2:
                # 1-D parameters keep their constructor values: norm scales 1, biases 0,
                # gated delta-net decay parameters at their documented starts.
                if name.endswith("bias") and "dt_bias" not in name:
                    param.zero_()
                continue
            param.copy_(random_matrix(name, tuple(param.shape), name.rsplit(".", 1)[0] in embeddings, seed, position))


def random_matrix(name: str, shape: tuple[int, ...], is_embedding: bool, seed: int, position: int) -> torch.Tensor:
    """The seeded value of the parameter `name` (2-D or more) of `shape`: N(0, 1) for an embedding,
    else N(0, 1/fan_in). A tensor-parallel rank draws the full tensor and keeps its part of it."""
    generator = torch.Generator().manual_seed(param_seed(seed, position, name))
    std = 1.0 if is_embedding else math.prod(shape[1:]) ** -0.5
    return torch.randn(shape, generator=generator) * std


def load_decoder(factory: Callable[[], Decoder], weights_dir: str, is_tied: bool,
                 device: torch.device = _CPU, dtype: torch.dtype = torch.float32,
                 seed: int = 0, position: int = 0) -> Decoder:
    """A decoder built by `factory` with the checkpoint's weights, on `device` in `dtype`.

    The model is built on the meta device (no memory, no initialisation), given uninitialised
    storage on `device`, then filled shard by shard and tensor by tensor from memory-mapped files,
    each tensor converted to `dtype` as it is copied in: host memory holds the model (when
    `device` is the CPU) and one checkpoint tensor at a time, never a second copy of the model.
    Parameters the checkpoint does not have (the image-flow head) get random weights from `seed`.
    """
    with torch.device("meta"):
        model = factory().to(dtype)
    model = model.to_empty(device=device)
    not_loaded = load_checkpoint_weights(model, weights_dir, is_tied)
    init_random(model, seed, position, not_loaded)
    return model


def load_checkpoint_weights(model: Decoder, weights_dir: str, is_tied: bool) -> set[str]:
    """Copy the checkpoint's tensors into a `Decoder` built from `read_checkpoint_config`'s dims,
    shard by shard (see `load_decoder`). With tied embeddings and no `lm_head.weight` in the
    checkpoint, the LM head shares the embedding's storage. Returns the names of the parameters
    the checkpoint has no tensor for (only the image-flow head's `flow.*` may be absent).

    Tensors the decoder has no use for (a vision tower, multi-token-prediction layers) are skipped.
    Which files are read (the safetensors index honoured) and NaN/Inf refused: checkpoint_files;
    the checkpoint's layer count must be the decoder's (config.json's num_hidden_layers: fewer
    would drop layers silently).
    """
    from safetensors import SafetensorError, safe_open

    index = tensor_index(weights_dir)
    if is_tied and "lm_head.weight" not in index:
        model.lm_head.weight = model.model.embed_tokens.weight
    params = dict(model.named_parameters())  # a tied head is listed once, as the embedding
    wanted = {name for name in params if not name.startswith("flow.")}
    by_file = wanted_by_file(weights_dir, index, wanted)
    with torch.no_grad():
        for file, names in by_file.items():
            try:
                with safe_open(str(file), framework="pt", device="cpu") as shard:
                    for name in names:
                        key, param = index[name][1], params[name]
                        shape = tuple(shard.get_slice(key).get_shape())
                        if shape != tuple(param.shape):
                            raise WeightsError(f"--weights {shown_path(weights_dir)}: {name} has shape {shape}, "
                                               f"config.json implies {tuple(param.shape)}")
                        param.copy_(shard.get_tensor(key))
                        check_finite(weights_dir, file, key, param)
            except (SafetensorError, OSError) as error:
                raise WeightsError(f"--weights {shown_path(weights_dir)}: cannot read {file.name}: {error}") from None
    return set(params) - wanted
