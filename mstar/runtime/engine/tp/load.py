"""A tensor-parallel rank's weights: its part of the same full model every other rank has.

In: a `ShardedDecoder` (built from the layout's local dims) and where the weights come from.
Out: its parameters filled; no rank ever holds a whole sharded tensor of a checkpoint.

- Random (`fill_random_shard`): each parameter is drawn exactly as the one-process engine draws it
  (`weights.random_matrix`: the full shape, its generator seeded by (seed, node position, name)),
  then cut to the rank's part; 1-D parameters keep their constructor values (biases zero). So a
  TP group computes what one process with the same seed computes. One full tensor at a time.
- Checkpoint (`load_checkpoint_shard`): the safetensors files `checkpoint_files.tensor_index`
  picks, each tensor opened as a slice (`safe_open(...).get_slice`) and only the rank's ranges read
  (`ShardLayout.take`); full shapes checked against the full model's, NaN/Inf refused, the layer
  count checked, tied embeddings: the LM head shares the embedding's (vocabulary) slice.
"""
from __future__ import annotations

from pathlib import Path
from typing import Optional

import torch
from torch import nn

from mstar.arg_types import shown_path
from mstar.runtime.engine.checkpoint_config import WeightsError
from mstar.runtime.engine.checkpoint_files import check_finite, tensor_index, wanted_by_file
from mstar.runtime.engine.models.decoder import Decoder
from mstar.runtime.engine.tp.layout import ShardLayout
from mstar.runtime.engine.weights import random_matrix


def full_shapes(layout: ShardLayout) -> dict[str, tuple[int, ...]]:
    """Parameter name -> its shape in the full (unsharded) model (built on the meta device)."""
    with torch.device("meta"):
        full = Decoder(layout.dims)
    return {name: tuple(p.shape) for name, p in full.named_parameters()}


def fill_random_shard(model: Decoder, layout: ShardLayout, seed: int, position: int,
                      names: Optional[set[str]] = None) -> None:
    """Every parameter (or those in `names`) set to the rank's part of the seeded full model."""
    shapes = full_shapes(layout)
    embeddings = {name for name, m in model.named_modules() if isinstance(m, nn.Embedding)}
    with torch.no_grad():
        for name, param in model.named_parameters():
            if names is not None and name not in names:
                continue
            if param.dim() < 2:  # constructor values, biases zero (weights.init_random's rule)
                if name.endswith("bias") and "dt_bias" not in name:
                    param.zero_()
                continue
            full = random_matrix(name, shapes[name], name.rsplit(".", 1)[0] in embeddings, seed, position)
            param.copy_(layout.take(name, full, shapes[name]))


def load_checkpoint_shard(model: Decoder, layout: ShardLayout, weights_dir: str, is_tied: bool) -> set[str]:
    """Copy the rank's part of every checkpoint tensor into `model` (module docstring). Returns the
    parameters the checkpoint has no tensor for (only the image-flow head's `flow.*` may be absent)."""
    index = tensor_index(weights_dir)
    if is_tied and "lm_head.weight" not in index:
        model.lm_head.weight = model.model.embed_tokens.weight
    params = dict(model.named_parameters())  # a tied head is listed once, as the embedding
    wanted = {name for name in params if not name.startswith("flow.")}
    by_file = wanted_by_file(weights_dir, index, wanted)
    shapes = full_shapes(layout)
    for file, names in by_file.items():
        _read_file(weights_dir, file, [(name, index[name][1], params[name]) for name in names], layout, shapes)
    return set(params) - wanted


def _read_file(weights_dir: str, file: Path, items: list[tuple[str, str, torch.Tensor]], layout: ShardLayout,
               shapes: dict[str, tuple[int, ...]]) -> None:
    """The rank's slices of `items` (parameter name, tensor name in the file, parameter) from one file."""
    from safetensors import SafetensorError, safe_open

    try:
        with torch.no_grad(), safe_open(str(file), framework="pt", device="cpu") as handle:
            for name, key, param in items:
                source = handle.get_slice(key)
                shape = tuple(source.get_shape())
                if shape != shapes[name]:
                    raise WeightsError(f"--weights {shown_path(weights_dir)}: {name} has shape {shape}, "
                                       f"config.json implies {shapes[name]}")
                param.copy_(layout.take(name, source, shape))
                check_finite(weights_dir, file, key, param)
    except (SafetensorError, OSError) as error:
        raise WeightsError(f"--weights {shown_path(weights_dir)}: cannot read {file.name}: {error}") from None
