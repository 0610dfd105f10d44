"""The sub-models of a kv node (NodePlan.submodels): a second decoder per `submodel` line.

In:  the node's plan, the dims mode, the run's seed, the node's position in the plan, and the
     engine's model factory and placement (`new(name, factory)`, `place(model)`).
Out: `build_submodels(...) -> {walk: Decoder}`: for each walk a sub-model lists, the decoder its
     rows run; `submodel_dims(node, sub, mode)` -> that decoder's dims. A sub-model is the node's
     dims with the sub-model's widths (SubModelPlan.dims); its KV geometry (layers, KV heads, head
     size) is the node's, so it reads and writes the node's KV cache (Pi0.5's action expert attends
     over the prefix the main model wrote). Its weights are random from the seed (a checkpoint has
     none for it yet).

`tiny` dims shrink every width of a node to the same small numbers (dims.py), which would make a
sub-model the node's twin; here its hidden and intermediate widths keep their ratio to the node's
(Pi0.5: an expert half as wide and a quarter as deep in its MLP stays so at tiny dims).
"""
from __future__ import annotations

from dataclasses import replace
from typing import Any, Callable

import torch

from mstar.plan.schema import NodePlan, SubModelPlan
from mstar.runtime.engine.dims import DecoderDims, DimsError, DimsMode, decoder_dims
from mstar.runtime.engine.models.decoder import Decoder
from mstar.runtime.engine.weights import init_random

# Widths at tiny dims are multiples of this (and at least this), so projections stay well formed.
TINY_WIDTH_STEP = 8


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


def build_submodels(node: NodePlan, mode: DimsMode, seed: int, position: int,
                    new: Callable[[str, Callable[[], Decoder]], Decoder],
                    place: Callable[[torch.nn.Module], Any]) -> dict[str, Decoder]:
    main = decoder_dims(node, mode)
    by_walk: dict[str, Decoder] = {}
    for index, sub in enumerate(node.submodels):
        dims = submodel_dims(node, sub, mode)
        if (dims.num_layers, dims.num_kv_heads, dims.head_dim) != (main.num_layers, main.num_kv_heads, main.head_dim):
            raise DimsError(f"node {node.name}: sub-model {sub.name} does not share the node's KV geometry")
        model = new(f"{node.name}.{sub.name}", lambda dims=dims: Decoder(dims))  # type: ignore[misc]
        # Seeded apart from the main model (the same seed and position would give equal weights).
        init_random(model, seed + 7919 * (index + 1), position)
        placed = place(model)  # the decoder itself, or on a GPU a wrapper that looks like it
        by_walk.update({walk: placed for walk in sub.walks})
    return by_walk
