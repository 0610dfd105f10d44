"""Building a kv node's GPU fast-path runner, or None when the node needs the general one.

In: the plan, the node, its dims, the call table, the placement (a CUDA device), the checkpoint
directory (or None for seeded random weights), the seed, `--kv-pages`, the node's code frames.
Under tensor parallelism (`comm` of more than one rank) the weights are the rank's shard
(`engine/tp/`) and the KV pages and attention hold the rank's heads.
Out: a `GpuDecoderRunner` with bf16 weights built on the device, its KV pages (and a hybrid
decoder's recurrent state slots, sized as on the general path) there, and the
decode family's CUDA graphs captured; None when the dims, the node's calls or the machine
(no FlashInfer, a head dim it does not compile) rule the fast path out.
"""
from __future__ import annotations

from types import ModuleType
from typing import Optional

import torch

from mstar.plan.schema import NodePlan, Plan
from mstar.runtime.engine.attention.flashinfer_paged import unavailable_reason
from mstar.plan.dims import DecoderDims
from mstar.runtime.engine.gpu.device_model import build_decoder, unsupported_reason
from mstar.runtime.engine.gpu.runner import (
    GpuDecoderRunner, decode_family, fast_path_reason, node_glue, packed_families,
)
from mstar.runtime.engine.kv.pool_size import pool_size
from mstar.runtime.engine.kv.slots import node_slot_pool
from mstar.runtime.engine.models.decoder import Decoder
from mstar.runtime.engine.models.kinds import CallInfo, prompt_logprob_calls
from mstar.runtime.engine.placement import Placement
from mstar.runtime.engine.tp.build import build_sharded_decoder
from mstar.runtime.engine.tp.comm import SINGLE_RANK, TpComm
from mstar.runtime.engine.tp.layout import ShardLayout


# A node that gives prompt log-probabilities captures piecewise graphs that keep every position's
# final hidden state, so its scoring steps replay them rather than run eagerly
# (`PackedFamilies.keeps_hidden`, docs/engine.md "A prompt's own log-probabilities"). On since its
# first GPU run (2026-12-07, an H100: its tests passed, and a lone scored 1,024-token prompt took
# 13.1 ms on the pieces against 17.2 eagerly, 7.1 plain); False captures the plain piecewise graphs.
KEEP_HIDDEN_ON_PIECES = True


def fast_runner(plan: Plan, node: NodePlan, dims: DecoderDims, calls: dict[tuple[str, str], CallInfo],
                placement: Placement, weights_dir: Optional[str], seed: int, num_pages: Optional[int],
                code_frames: dict, position: int = 0, comm: TpComm = SINGLE_RANK,
                glue: Optional[ModuleType] = None, can_run_ahead: Optional[bool] = None
                ) -> Optional[GpuDecoderRunner]:
    """position: the node's index in the plan (seeds its random weights). comm: this process's
    rank of the node's TP group (`engine/tp/`): the model is then the rank's shard and the runner
    keeps the rank's kv heads. glue: the plan's generated glue module; the runner then packs its
    steps with the node's keys' glue (a hybrid decoder keeps the numpy packing). can_run_ahead:
    `GpuDecoderRunner`'s (False: `--no-run-ahead`, and a hybrid's states keep one copy a slot)."""
    reason = (unsupported_reason(dims) or fast_path_reason(node, calls)
              or unavailable_reason(placement.device, dims.head_dim))
    if reason is not None or code_frames:
        return None
    size = pool_size(plan, node.name, num_pages)
    pool, page_size, max_seq_len, pages = size.entry, size.page_size, size.max_seq_len, size.num_pages
    model: Decoder
    if comm.size > 1:
        model = build_sharded_decoder(dims, comm, node=node.name, weights_dir=weights_dir, seed=seed,
                                      position=position, device=placement.device, dtype=torch.bfloat16)
        dims = ShardLayout(dims, comm.rank, comm.size, node.name).local_dims
    else:
        model = build_decoder(dims, placement.device, torch.bfloat16, position=position, seed=seed,
                              weights_dir=weights_dir)
    slots = None
    if dims.has_linear_layers:
        slots = node_slot_pool(node.name, node.recurrent.num_slots if node.recurrent else None,
                               plan.deployment.max_concurrent_requests)
    return GpuDecoderRunner(node, dims, model, page_size, pages, max_seq_len, seed, placement,
                            decode_family(plan, node.name), is_flashinfer=True, position=position,
                            prefix_cache=pool is not None and pool.prefix_cache == "pages", slots=slots,
                            can_run_ahead=can_run_ahead,
                            packed=packed_families(plan, node.name, keeps_hidden=keeps_hidden(plan, node, calls)),
                            glue=node_glue(glue.GLUE_BY_WORKER, node.name) if glue is not None else None,
                            host_pages=pool.host_pages if pool else 0)


def keeps_hidden(plan: Plan, node: NodePlan, calls: dict[tuple[str, str], CallInfo]) -> bool:
    """Whether the node's piecewise graphs keep every position's final hidden state
    (`PackedFamilies.keeps_hidden`): its steps may score a prompt (`prompt_logprob_calls`), and
    KEEP_HIDDEN_ON_PIECES is on."""
    return KEEP_HIDDEN_ON_PIECES and any(name == node.name for name, _ in prompt_logprob_calls(plan, calls))
