"""The sub-models of a kv node (NodePlan.submodels): a second decoder per `submodel` line, or a
depth model per `submodel ... samples OUTPUT depth=N` line.

In:  the node's plan, the dims mode, the run's seed, the node's position in the plan, and the
     engine's model factory and placement (`new(name, factory)`, `place(model)`).
Out: `build_submodels(...) -> {walk: Decoder}`: for each walk a sub-model lists, the decoder its
     rows run; `submodel_dims(node, sub, mode)` -> that decoder's dims. A sub-model is the node's
     dims with the sub-model's widths (SubModelPlan.dims); its KV geometry (layers, KV heads, head
     size) is the node's, so it reads and writes the node's KV cache (Pi0.5's action expert attends
     over the prefix the main model wrote). Its weights are random from the seed (a checkpoint has
     none for it yet).
     `build_depth_models(...) -> {walk: {output: DepthModel}}`: the depth models that run after the
     node's model on a walk's rows and extend the token it sampled for an output (models/depth.py);
     `depth_dims(node, sub, mode, outer_hidden)` -> their dims: the sub-model's own numbers, the
     node's where it gives none. Seeded random weights as well.

`tiny` dims shrink every width of a node to the same small numbers (dims.py), which would make a
sub-model the node's twin; here its hidden and intermediate widths keep their ratio to the node's
(Pi0.5: an expert half as wide and a quarter as deep in its MLP stays so at tiny dims). A depth
model at `tiny` keeps at most TINY_QUANTIZERS - 1 inner positions and TINY_CODEBOOK tokens, as an
audio codec it feeds shrinks to TINY_QUANTIZERS codebooks of TINY_CODEBOOK codes (the compiler
checked depth + 1 = quantizers, MW125).
"""
from __future__ import annotations

from dataclasses import replace
from typing import Any, Callable, Optional

import torch

from mstar.plan.schema import NodePlan, SubModelPlan
from mstar.plan.dims import (
    TINY_CODEBOOK, TINY_QUANTIZERS, DecoderDims, DimsError, DimsMode, decoder_dims,
)
from mstar.runtime.engine.models.decoder import Decoder
from mstar.runtime.engine.models.depth import DepthDims, DepthModel
from mstar.runtime.engine.weights import init_random

# Widths at tiny dims are multiples of this (and at least this), so projections stay well formed.
TINY_WIDTH_STEP = 8
# Seeds of sub-models stand apart from the node's (the same seed and position would give equal weights).
SUBMODEL_SEED_STRIDE = 7919


def submodel_dims(node: NodePlan, sub: SubModelPlan, mode: DimsMode) -> DecoderDims:
    """The dims a sub-model's decoder is built with (the module docstring's rule for `tiny`)."""
    merged = node.model_copy(update={"dims": {**node.dims, **sub.dims}})
    dims = decoder_dims(merged, mode)
    if mode == "spec":
        return dims
    main_spec, sub_spec, main_tiny = decoder_dims(node, "spec"), decoder_dims(merged, "spec"), decoder_dims(node, mode)
    return replace(dims, hidden=_scaled(main_tiny.hidden, sub_spec.hidden, main_spec.hidden),
                   intermediate=_scaled(main_tiny.intermediate, sub_spec.intermediate, main_spec.intermediate))


def _scaled(tiny: int, sub: int, main: int) -> int:
    return max(TINY_WIDTH_STEP, round(tiny * sub / main / TINY_WIDTH_STEP) * TINY_WIDTH_STEP)


def depth_dims(node: NodePlan, sub: SubModelPlan, mode: DimsMode, outer_hidden: int) -> DepthDims:
    """A depth model's dims (module docstring); `outer_hidden` is the width of the node's model as built."""
    spec = decoder_dims(node.model_copy(update={"dims": {**_geometry(node.dims), **sub.dims}}), "spec")
    dims = DepthDims(num_layers=spec.num_layers, num_kv_heads=spec.num_kv_heads, num_qo_heads=spec.num_qo_heads,
                     head_dim=spec.head_dim, hidden=spec.hidden, intermediate=spec.intermediate, vocab=spec.vocab,
                     depth=sub.depth, outer_hidden=outer_hidden, rope_theta=spec.rope_theta)
    if mode == "spec":
        return dims
    main_spec, main_tiny = decoder_dims(node, "spec"), decoder_dims(node, mode)
    num_kv_heads = min(dims.num_kv_heads, 2)
    return replace(dims, num_layers=min(dims.num_layers, 2), num_kv_heads=num_kv_heads,
                   num_qo_heads=num_kv_heads * min(dims.num_qo_heads // dims.num_kv_heads, 4), head_dim=16,
                   hidden=_scaled(main_tiny.hidden, dims.hidden, main_spec.hidden),
                   intermediate=_scaled(main_tiny.intermediate, dims.intermediate, main_spec.intermediate),
                   vocab=min(dims.vocab, TINY_CODEBOOK), depth=min(dims.depth, TINY_QUANTIZERS - 1))


def _geometry(node_dims: dict) -> dict:
    """The node's numbers a depth model falls back on: widths and heads, not its layer pattern,
    recurrent layers or flow head (a depth model is plain full attention)."""
    keys = ("layers", "kv_heads", "qo_heads", "head_dim", "hidden", "intermediate", "vocab", "rope_theta")
    return {key: value for key, value in node_dims.items() if key in keys}


def build_submodels(node: NodePlan, mode: DimsMode, seed: int, position: int,
                    new: Callable[[str, Callable[[], Decoder]], Decoder],
                    place: Callable[[torch.nn.Module], Any],
                    shard: Optional[Callable[[str, DecoderDims, int], Decoder]] = None) -> dict[str, Decoder]:
    """shard: on a tensor-parallel rank, `shard(name, dims, seed)` builds this rank's part of a
    sub-model (engine/tp/) as the node's own model is built; None builds the whole model."""
    main = decoder_dims(node, mode)
    by_walk: dict[str, Decoder] = {}
    for index, sub in enumerate(node.submodels):
        if sub.samples is not None:
            continue  # a depth model (build_depth_models)
        dims = submodel_dims(node, sub, mode)
        if (dims.num_layers, dims.num_kv_heads, dims.head_dim) != (main.num_layers, main.num_kv_heads, main.head_dim):
            raise DimsError(f"node {node.name}: sub-model {sub.name} does not share the node's KV geometry")
        sub_seed = seed + SUBMODEL_SEED_STRIDE * (index + 1)
        if shard is not None:
            by_walk.update({walk: shard(f"{node.name}.{sub.name}", dims, sub_seed) for walk in sub.walks})
            continue
        model = new(f"{node.name}.{sub.name}", lambda dims=dims: Decoder(dims))  # type: ignore[misc]
        init_random(model, sub_seed, position)
        placed = place(model)  # the decoder itself, or on a GPU a wrapper that looks like it
        by_walk.update({walk: placed for walk in sub.walks})
    return by_walk


def build_depth_models(node: NodePlan, mode: DimsMode, seed: int, position: int, outer_hidden: int,
                       new: Callable[[str, Callable[[], DepthModel]], DepthModel],
                       place: Callable[[torch.nn.Module], Any]) -> dict[str, dict[str, DepthModel]]:
    by_walk: dict[str, dict[str, DepthModel]] = {}
    for index, sub in enumerate(node.submodels):
        if sub.samples is None:
            continue
        dims = depth_dims(node, sub, mode, outer_hidden)
        if dims.num_qo_heads % dims.num_kv_heads:
            raise DimsError(f"node {node.name}: depth model {sub.name}: qo_heads={dims.num_qo_heads} is not a "
                            f"multiple of kv_heads={dims.num_kv_heads}")
        model = new(f"{node.name}.{sub.name}", lambda dims=dims: DepthModel(dims))  # type: ignore[misc]
        init_random(model, seed + SUBMODEL_SEED_STRIDE * (index + 1), position)
        placed = place(model)
        for walk in sub.walks:
            by_walk.setdefault(walk, {})[sub.samples] = placed
    return by_walk
