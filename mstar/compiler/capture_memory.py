"""A compile-time estimate of the GPU memory a CUDA-graph capture family holds.

In:  a node declaration (its dims: `hidden`, `vocab`), one of its captures, the node's TP size.
Out: bytes (`estimate_family_bytes`) and the number of captured graphs (`num_graphs`).

The estimate is deliberately simple and documented, not measured. Per family:

    graphs      one per key: batched -> each batch size b (b x tokens_per_row tokens);
                packed -> each (batch size b, token bucket t) pair (t tokens, b rows)
    shared      static input/activation buffers sized by the largest key, shared by every graph
                of the family (the reference captures the largest first; smaller ones slice it):
                max_tokens x hidden x 2 bytes x ACTIVATION_FACTOR + max_rows x vocab x 4 bytes
    per graph   what each graph keeps for itself: its output hidden states
                (tokens x hidden x 2 bytes), its fp32 logits for sampling (rows x vocab x 4 bytes,
                nodes with a vocab only), and GRAPH_OVERHEAD_BYTES of fixed cost (graph object,
                kernel parameters, attention-plan workspace slices)
    TP          the shared buffers and per-graph tensors are divided by tp_size; the fixed
                per-graph cost is not
    slots       kv nodes capture every key twice (double buffering, as the reference does with
                MSTAR_NUM_SLOTS = 2) so the next step can be staged while one replays

The bucket count matters as much as the largest bucket: the reference once failed to boot when a
wider capture set grew one node's buckets from 29 to 68; the per-graph terms here make such a
change show up in the estimate and the capture memory check (MW408).
"""
from __future__ import annotations

from mstar.lang import ast

MIB = 1024 * 1024
ACTIVATION_BYTES = 2  # bf16 activations
LOGIT_BYTES = 4  # fp32 logits for the sampler
# Hidden-sized tensors alive at once inside one layer's step (residual, normed input, attention
# output, q/k/v and the MLP's input and output), shared across layers through the graph pool.
ACTIVATION_FACTOR = 6
GRAPH_OVERHEAD_BYTES = 4 * MIB
KV_CAPTURE_SLOTS = 2
# Stateless nodes without a `hidden` dim (codecs, encoders) are sized as a 1024-wide model.
DEFAULT_HIDDEN = 1024


def graph_keys(capture: ast.CaptureDecl) -> list[tuple[int, int]]:
    """(rows, tokens) of every graph the family captures, in declaration order."""
    if capture.family == "batched":
        return [(b, b * capture.tokens_per_row) for b in capture.batch]
    # A packed capture without token buckets captures one key per batch size, one token a row.
    tokens = capture.tokens or [0]
    return [(b, t if t else b) for b in capture.batch for t in tokens]


def num_graphs(capture: ast.CaptureDecl) -> int:
    """Number of captured keys (buckets); kv nodes hold each twice (see KV_CAPTURE_SLOTS)."""
    return len(capture.batch) * (max(1, len(capture.tokens)) if capture.family == "packed" else 1)


def _dim(node: ast.NodeDecl, name: str, default: int) -> int:
    for arg in node.args:
        if arg.name == name and isinstance(arg.value, int) and arg.value > 0:
            return arg.value
    return default


def estimate_family_bytes(node: ast.NodeDecl, capture: ast.CaptureDecl, tp_size: int) -> int:
    """Estimated bytes one capture family of `node` holds on each of its tp_size ranks."""
    keys = graph_keys(capture)
    if not keys:
        return 0
    hidden = _dim(node, "hidden", DEFAULT_HIDDEN)
    vocab = _dim(node, "vocab", 0)
    max_rows = max(rows for rows, _ in keys)
    max_tokens = max(tokens for _, tokens in keys)
    shared = max_tokens * hidden * ACTIVATION_BYTES * ACTIVATION_FACTOR + max_rows * vocab * LOGIT_BYTES
    per_graph = sum(tokens * hidden * ACTIVATION_BYTES + rows * vocab * LOGIT_BYTES
                    for rows, tokens in keys)
    slots = KV_CAPTURE_SLOTS if node.engine == "kv" else 1
    sharded = (shared + per_graph) // max(1, tp_size)
    return slots * (sharded + len(keys) * GRAPH_OVERHEAD_BYTES)


def format_mib(num_bytes: int) -> str:
    return f"{num_bytes / MIB:.1f} MiB"
