"""Parameter bytes per tensor-parallel rank against one process, counted on the meta device.

`python3 -m mstar.runtime.engine.tp.memory --plan generated/orpheus_tp2.plan [--dims spec|tiny]
[--tp N] [--bytes-per-param 2]` prints, per kv node of the plan, the whole model's parameter bytes
and each rank's (the rank's `ShardedDecoder` built on the meta device: nothing is allocated), plus
the KV cache bytes per token of one rank. `--tp` defaults to the node's TP group size in the plan
(2 when it has none). Nothing is run; the figures are exact counts of the modules' parameters. A
missing or bad plan, or dims that do not split over the ranks, is an error message and exit 1; a
`--tp` outside 1..1024 or a `--bytes-per-param` outside 1..8 is a usage error (exit 2).
"""
from __future__ import annotations

import argparse
import sys
from typing import Optional, Sequence

import torch

from mstar.arg_types import int_range, path_arg
from mstar.plan.io import PlanError, load_plan
from mstar.plan.schema import Plan
from mstar.plan.dims import DIMS_MODES, DecoderDims, DimsError, DimsMode, decoder_dims
from mstar.runtime.engine.models.decoder import Decoder
from mstar.runtime.engine.tp.build import plan_tp_groups
from mstar.runtime.engine.tp.comm import TpComm
from mstar.runtime.engine.tp.layout import ShardLayout
from mstar.runtime.engine.tp.sharded import ShardedDecoder


def _num_params(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def params_per_rank(dims: DecoderDims, size: int) -> tuple[int, list[int]]:
    """(parameters of the whole model, parameters each rank holds)."""
    with torch.device("meta"):
        whole = _num_params(Decoder(dims))
        ranks = [_num_params(ShardedDecoder(ShardLayout(dims, rank, size), TpComm(rank, size)))
                 for rank in range(size)]
    return whole, ranks


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python3 -m mstar.runtime.engine.tp.memory", description=__doc__)
    parser.add_argument("--plan", required=True, type=path_arg)
    parser.add_argument("--dims", choices=DIMS_MODES, default="spec")
    # --tp 0 was taken as no --tp (the plan's group size) and a negative --bytes-per-param printed
    # negative MiB. Each rank needs whole query heads: the checked-in models have at most 64
    parser.add_argument("--tp", type=int_range(1, 1024), default=None,
                        help="ranks to split over, 1..1024 (default: the node's TP group size in the plan, else 2)")
    parser.add_argument("--bytes-per-param", type=int_range(1, 8), default=2,
                        help="1..8: 2 for bf16 (the GPU), 4 for fp32 (the CPU)")
    args = parser.parse_args(argv)
    try:
        _report(load_plan(args.plan), args.dims, args.tp, args.bytes_per_param)
    except (PlanError, DimsError) as error:  # a missing or bad plan, dims that do not split
        print(f"error: {error}", file=sys.stderr)
        return 1
    return 0


def _report(plan: Plan, mode: DimsMode, tp: Optional[int], bytes_per_param: int) -> None:
    sizes = {group.node: group.tp_size for group in plan_tp_groups(plan)}
    for node in plan.nodes:
        if node.engine != "kv":
            continue
        dims = decoder_dims(node, mode)
        size = tp or sizes.get(node.name, 2)
        local = ShardLayout(dims, 0, size, node.name).local_dims  # refuses dims that do not split, by node
        whole, ranks = params_per_rank(dims, size)
        kv_per_token = 2 * local.num_full_layers * local.num_kv_heads * local.head_dim * bytes_per_param
        shown = ", ".join(f"{n * bytes_per_param / 2**20:.1f}" for n in ranks)
        print(f"{node.name} ({mode} dims, TP{size}): whole {whole * bytes_per_param / 2**20:.1f} MiB; "
              f"per rank {shown} MiB ({max(ranks) / whole:.3f} of the whole); KV per token per rank "
              f"{kv_per_token} bytes")


if __name__ == "__main__":
    raise SystemExit(main())
