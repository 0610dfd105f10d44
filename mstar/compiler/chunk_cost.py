"""Part of lowering: how much of the step token budget a prompt chunk's token takes at depth.

In:  the lowered workers and nodes, the `Deployment` (`budget_counts_context`).
Out: the workers with `KeyPlan.chunk_context_scale` set on every key that cuts prompts under a
     budget: the scale N at which a chunk token fed after c tokens of its row's KV counts
     1 + c / N budget tokens (runtime/scheduler/token_budget.py).

Why: a chunk's matrix products cost the same at any depth, but its attention grows with the
context it reads. Measured on the H200 (llama plan, budget 256, 40 decode rows beside an
8192-token prompt): a chunk step near context 0 spans about 3.1 ms, one near context 7936 about
4.1 ms, 1.09 ms of it the chunk's attention, so the decode rows' inter-token p99 is set by the last
chunks. Counting a deep token as more than one keeps every chunk step near the first one's work.

N = (matrix-product FLOPs per token) / (attention FLOPs per token per cached token) x
ATTENTION_RATE_FRACTION, from the node's dims as the runtime builds them (plan/dims.py):
per layer the q/k/v/o products (full attention) or the gated delta-net projections (linear
layers) plus the three MLP products; 4 x qo_heads x head_dim FLOPs per cached token in each full
attention layer (QK^T and PV). Linear layers read a fixed-size state, so a node without full
attention layers gets no scale (its chunks cost the same at any depth).
"""
from __future__ import annotations

from typing import Optional

from mstar.compiler.deployment import Deployment
from mstar.plan.dims import DimsError, attention_flops_per_key, attention_layer_params, decoder_dims
from mstar.plan.schema import NodePlan, WorkerPlan

# Attention's achieved FLOP rate over the matrix products' in a chunk step (H200, FlashInfer's FA2
# prefill kernel beside cuBLAS, docs/runtime.md "Chunked prefill"): 1.09 ms of attention for 216
# chunk tokens at context about 8000 against 1.11 ms of products for the step's 256 tokens.
ATTENTION_RATE_FRACTION = 0.47


def context_scale(node: NodePlan) -> Optional[int]:
    """The node's N (module docstring), or None when no cost grows with the context."""
    try:
        dims = decoder_dims(node, "spec")
    except DimsError:
        return None  # the argument checks report bad dims
    if not dims.num_full_layers:
        return None
    hidden, qo_width = dims.hidden, dims.num_qo_heads * dims.head_dim
    full = attention_layer_params(hidden, qo_width, dims.num_kv_heads * dims.head_dim, dims.intermediate)
    key_width = dims.num_linear_heads * dims.linear_key_dim
    value_width = dims.num_linear_value_heads * dims.linear_value_dim
    linear = hidden * (2 * key_width + 2 * value_width) + value_width * hidden + 3 * hidden * dims.intermediate
    flops_per_token = 2 * (dims.num_full_layers * full + dims.num_linear_layers * linear)
    flops_per_key = attention_flops_per_key(qo_width, dims.num_full_layers)
    return max(1, round(flops_per_token / flops_per_key * ATTENTION_RATE_FRACTION))


def with_chunk_costs(workers: list[WorkerPlan], nodes: list[NodePlan], deployment: Deployment) -> list[WorkerPlan]:
    """The workers with chunk_context_scale on each key that cuts prompts under a token budget."""
    if not deployment.budget_counts_context:
        return workers
    scales = {node.name: context_scale(node) for node in nodes if node.engine == "kv"}
    out = []
    for worker in workers:
        keys = [key.model_copy(update={"chunk_context_scale": scales.get(key.node)})
                if key.token_budget is not None and key.chunk_sizes else key for key in worker.keys]
        out.append(worker.model_copy(update={"keys": keys}))
    return out
