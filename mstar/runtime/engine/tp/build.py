"""Build one tensor-parallel rank's decoder, and the TP process groups of a plan.

In: the node's full `DecoderDims`, this rank's `TpComm`, where the weights come from.
Out: a `ShardedDecoder` on the device, holding the rank's part of every weight (`layout.py`).

`tp_comms(plan, rank)` creates the torch.distributed process group of every TP group of the plan
(each process calls it, after `init_process_group`, with the same plan, so every process creates
every group in the same order, as `new_group` requires) and returns this rank's `TpComm` per node it
runs tensor-parallel. The engine builds the rest (`TorchEngine(plan, tp_comms=...)`: docs/engine.md,
"Tensor parallelism").
"""
from __future__ import annotations

from datetime import timedelta

from typing import Optional

import torch

from mstar.plan.schema import Plan, TPGroup
from mstar.plan.dims import DecoderDims
from mstar.runtime.engine.tp.comm import TpComm
from mstar.runtime.engine.tp.layout import ShardLayout, TpError
from mstar.runtime.engine.tp.load import fill_random_shard, load_checkpoint_shard
from mstar.runtime.engine.tp.sharded import ShardedDecoder

_CPU = torch.device("cpu")  # the default device (a module constant, not a call per signature)


def build_sharded_decoder(dims: DecoderDims, comm: TpComm, *, node: str = "decoder",
                          weights_dir: Optional[str] = None, seed: int = 0, position: int = 0,
                          device: torch.device = _CPU, dtype: torch.dtype = torch.float32) -> ShardedDecoder:
    """This rank's decoder: random weights from (seed, position), the shard of the model one
    process builds with them, or the rank's slices of the checkpoint in `weights_dir` (whose
    config.json gave `dims`). `position`: the node's index in the plan. `TpError` when the dims
    cannot be split over the group (layout.py)."""
    layout = ShardLayout(dims, comm.rank, comm.size, node)
    if weights_dir is None:
        model = ShardedDecoder(layout, comm)
        fill_random_shard(model, layout, seed, position)
        return model.to(device=device, dtype=dtype)
    with torch.device("meta"):
        model = ShardedDecoder(layout, comm).to(dtype)
    model = model.to_empty(device=device)
    not_loaded = load_checkpoint_shard(model, layout, weights_dir, dims.is_tied_embeddings)
    fill_random_shard(model, layout, seed, position, not_loaded)
    return model


def plan_tp_groups(plan: Plan) -> list[TPGroup]:
    """Every TP group of more than one rank in the plan, once each, in a fixed order."""
    groups = {(g.node, tuple(g.ranks)): g for worker in plan.workers for g in worker.tp_groups}
    found = []
    for (node, ranks), group in sorted(groups.items()):
        if group.sp_size > 1:
            raise TpError(f"node {node}: sequence parallelism (sp_size={group.sp_size}) is not supported")
        if group.tp_size != len(ranks):
            raise TpError(f"node {node}: tp_size={group.tp_size} but the group lists ranks {list(ranks)}")
        if len(ranks) > 1:
            found.append(group)
    return found


def tp_comms(plan: Plan, rank: int, backend: Optional[str] = None,
             timeout_s: Optional[float] = None) -> dict[str, TpComm]:
    """Node -> this rank's `TpComm`, for the nodes it runs in a TP group of more than one rank. Every
    process of the run must call this (collectively) after `torch.distributed.init_process_group`.
    timeout_s: how long a gloo collective may wait for the group's other ranks (the rank timeout):
    rank 0 runs its own shard's forward, so a frozen peer held it in a collective for ever, past the
    timeout the controller keeps on messages (NCCL's collectives keep the process group's)."""
    import torch.distributed as dist

    timeout = timedelta(seconds=timeout_s) if timeout_s is not None and backend != "nccl" else None
    comms = {}
    for group in plan_tp_groups(plan):
        process_group = dist.new_group(sorted(group.ranks), backend=backend, timeout=timeout)
        if rank in group.ranks:
            comms[group.node] = TpComm.of(process_group)
    return comms
