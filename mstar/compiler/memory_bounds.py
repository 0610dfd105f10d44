"""What a node's dims imply in memory, and the bounds the runtime can allocate.

In:  a node's arguments (name -> value, already of the right kinds: check_args.py), a KV pool
     size, a loop nest.
Out: `weight_bytes(engine, args, state_args)`, a lower bound of the node's bf16 weights and
     per-request recurrent state; `recurrent_slot_bytes(state_args)`, one request's recurrent
     state; `kv_pool_bytes(args, page_size, num_pages)`, the KV pool's bytes (a host pool's too);
     the limits below, and `format_bytes`.

The estimates count the big matrices only (embeddings, attention and MLP projections, the KV
pages), so they are lower bounds: a node over a limit by this count is surely over it. They use
Python integers, so dims of any size give a number instead of an overflow, and nothing here
builds anything per layer (`layers=1000000000` once made a billion-entry tuple and 7.8 GB).
"""
from __future__ import annotations

from typing import Mapping

# The bounds a plan's loader holds a plan to as well (plan/int_bounds.py defines them, this
# package imports them: the plan package imports no compiler module).
from mstar.plan.int_bounds import (
    MAX_CAPTURE_KEYS as MAX_CAPTURE_KEYS,
    MAX_COMBINED_WALKS as MAX_COMBINED_WALKS,
    MAX_CONCURRENT_REQUESTS as MAX_CONCURRENT_REQUESTS,
    MAX_DIM as MAX_DIM,
    MAX_LAYERS as MAX_LAYERS,
    MAX_LOOP_ITERATIONS as MAX_LOOP_ITERATIONS,
    MAX_NUM_PAGES as MAX_NUM_PAGES,
    MAX_PAGE_SIZE as MAX_PAGE_SIZE,
    MAX_STEP_ROWS as MAX_STEP_ROWS,
    MAX_STEP_TOKENS as MAX_STEP_TOKENS,
)

KIB = 1024
MIB = KIB * KIB
GIB = KIB * MIB
TIB = KIB * GIB

BF16_BYTES = 2
FP32_BYTES = 4  # recurrent state
# One node's weights, or one KV pool, may use at most this: twice the GPU memory of the largest
# single host the runtime runs on (8 x H200, 8 x 141 GB), leaving room for CPU offload.
MAX_NODE_BYTES = 2 * TIB
# Ranks of a deployment: the runtime starts one process per rank up to the highest (a TCPStore
# rendezvous of that many); 128 hosts of 8 GPUs.
MAX_RANKS = 1024
# capture_memory_budget_mb: the plan holds the budget in bytes (int64); a worker's budget beyond
# what one node may use at all (MAX_NODE_BYTES) is no budget.
MAX_CAPTURE_BUDGET_MB = MAX_NODE_BYTES // MIB


def _get(args: Mapping, name: str, default: int) -> int:
    value = args.get(name)
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else default


def weight_bytes(engine: str, args: Mapping, state_args: Mapping | None = None) -> int:
    """A lower bound of the bytes a node's weights (bf16) and one request's recurrent state take."""
    layers = _get(args, "layers", 1)
    hidden = _get(args, "hidden", 1)
    if engine == "kv":
        head_dim = _get(args, "head_dim", 1)
        qo_heads = _get(args, "qo_heads", 1)
        kv_heads = _get(args, "kv_heads", 1)
        intermediate = _get(args, "intermediate", hidden)
        vocab = _get(args, "vocab", 1)
        per_layer = (hidden * head_dim * (2 * qo_heads + 2 * kv_heads)  # q, k, v and o projections
                     + 3 * hidden * intermediate)  # gate, up and down of the MLP
        params = layers * per_layer + 2 * vocab * hidden  # embedding and output head
    else:
        params = (layers * 12 * hidden * hidden  # attention and a 4x MLP per layer
                  + _get(args, "codebook", 1) * _get(args, "quantizers", 1) * hidden
                  + _get(args, "feature_dim", 1) * hidden)
    return params * BF16_BYTES + (recurrent_slot_bytes(state_args) if state_args else 0)


def recurrent_slot_bytes(state_args: Mapping) -> int:
    """Bytes of one request's recurrent state (one slot): layers x heads x key_dim x value_dim, fp32."""
    return (_get(state_args, "layers", 1) * _get(state_args, "heads", 1)
            * _get(state_args, "key_dim", 1) * _get(state_args, "value_dim", 1) * FP32_BYTES)


def kv_pool_bytes(args: Mapping, page_size: int, num_pages: int) -> int:
    """Bytes of a kv node's paged pool: keys and values (bf16) of every layer for every slot."""
    per_token = 2 * _get(args, "layers", 1) * _get(args, "kv_heads", 1) * _get(args, "head_dim", 1) * BF16_BYTES
    return num_pages * page_size * per_token


def format_bytes(num_bytes: int) -> str:
    """`3.2 GiB`, `97,300 TiB`, `9.73e+10 TiB`: readable at any size."""
    for unit, size in (("TiB", TIB), ("GiB", GIB), ("MiB", MIB), ("KiB", KIB)):
        if num_bytes >= size:
            amount = num_bytes / size if num_bytes < 10**300 else float("inf")
            if amount < 1000:
                return f"{amount:.3g} {unit}"
            return f"{amount:,.0f} {unit}" if amount < 1e9 else f"{amount:.2e} {unit}"
    return f"{num_bytes} bytes"
