"""A compile-time estimate of the GPU memory a CUDA-graph capture family holds.

In:  a node declaration (its dims: `hidden`, `intermediate`, `vocab`), one of its captures, the
     node's TP size.
Out: bytes (`estimate_family_bytes`) and the number of captured graphs (`num_graphs`).

The estimate models what the GPU engine's capture holds (engine/gpu/graphs.py: every key of a
family captured once, largest first, in one pool, from one capture stream), checked against the
allocator growth measured at capture (`mstar bench engine`: the Llama-3.2-1B decode family,
7 graphs, measured 108 MiB on an H200, estimated 114 MiB). Per family:

    graphs      one per key: batched -> each batch size b (b x tokens_per_row tokens);
                packed -> each (batch size b, token bucket t) pair (t tokens, b rows)
    per graph   what each graph keeps as its outputs after capture: its bf16 logits (the
                sampler computes in fp32 from them) and its greedy ids (rows x (vocab x 2 + 8)
                bytes, nodes with a vocab only) and its output hidden states (tokens x hidden x 2
                bytes); a packed family keeps one such buffer for all its keys (below)
    shared      pool blocks the largest key uses while it runs, which smaller graphs reuse: the
                activations of one layer (max_tokens x (ACTIVATION_FACTOR x hidden
                + MLP_FACTOR x intermediate) x 2 bytes); in a packed family (whole or piecewise)
                also the largest key's own logits before their copy into the family's one
                buffer (max_rows x vocab x 2 bytes)
    recurrent   a node with a `state recurrent(...)` (gated delta-net layers): the largest key's
                rows' scratch in one layer (engine/gpu/gdn_forward.py), shared like the
                activations: the rule's output and its normed copy in fp32
                (2 x max_rows x value_heads x value_dim x 4 bytes) and the conv output
                (max_rows x conv_dim x 2 bytes). The states themselves are not copied: the decode
                kernels read and write each row's slot in place (gdn_kernels.py; gathering them
                had doubled the Qwen3.5 estimate: 331 MiB against 170 MiB measured)
    workspace   CAPTURE_WORKSPACE_BYTES per family: the capture stream's cuBLAS workspace
    TP          the per-graph and shared terms are divided by tp_size; the workspace is not
    labels      a family whose graphs touch several self-attention KV sequences (`labels`, such as
                BAGEL's guided decode over main and cfg_img) runs each row once per sequence: its
                keys count rows and tokens that many times (capture_keys.py; cross_kv pools are
                attended over, not run, and do not count)

A `piecewise` family captures each key as pieces split at every attention layer (layers + 1
pieces), all in the family's one pool; attention runs eagerly between them (engine/gpu/piecewise.py).
No key's replay interleaves with another's, so every key's values live in the shared pool term of
the largest key, and two terms change:

    per graph   none per key: every key's last piece copies its outputs into one buffer of the
                largest key (its bf16 logits and greedy ids, max_rows x (vocab x 2 + 8) bytes, and
                its output hidden states, max_tokens x hidden x 2 bytes), once
    boundary    the queries and the attention output at fixed addresses that the eager attention
                reads and writes between pieces, sized by the largest key's tokens and shared by
                every key: 2 x max_tokens x qo_heads x head_dim x 2 bytes (head_dim default
                hidden / qo_heads; a node without `qo_heads`, such as an encoder, counts them as
                hidden-wide)
The shared pool term and the workspace are as for whole-step graphs. The engine captures all
piecewise families of a node as one set over the union of their buckets, in one pool: the node's
families together hold about the largest one's estimate, so summing them (the worker's capture
total, MW408) over-counts. Measured on the H200 (llama,
its two packed families in one pool, 9 buckets of 32-8192 tokens, each bucket still keeping its
own logits then): 1192 MiB against 1364 MiB estimated by the earlier per-bucket formula.

A packed family captured whole (engine/gpu/packed_graphs.py: a graph per key, attention inside)
is held the same way: its keys are captured largest first in one pool and never replay at once, and
every key copies its logits into one buffer of the largest batch; so its per-graph term is that one
output buffer (max_rows x (vocab x 2 + 8) bytes and max_tokens x hidden x 2 bytes), without the
piecewise boundary. Its shared term is modelled on what a step of the largest key keeps alive at
its peak and on how the pool's segments hold it:

    peak        the larger of a layer's two phases, per token (bf16): the MLP's residual, the
                previous delta and the normed input beside gate/up and their product
                (3 x hidden + 3 x intermediate), or attention's three hidden-wide values beside
                q/k/v, the rotated queries and the attention output, and o_proj's output
                (4 x hidden + qkv width + 2 x q width); measured as the allocator's peak while
                the largest key captures: orpheus 529 MiB of activations (8192 tokens x
                (3 x 3072 + 3 x 8192) x 2 bytes = 528), bagel 959 (960), qwen3_omni's talker 31 (30)
    slack       the pool's segments hold POOL_SLACK times that peak: a step's tensors are sized
                by the key and freed in a different order than allocated, so the caching
                allocator cannot fit later keys' and layers' blocks into the first ones exactly
                (measured 1.51-1.64x: llama, orpheus, bagel, qwen3_omni's thinker; the talker's
                small blocks 2.2x, rounded up to whole segments)

Measured on the H200 (the one pool of each node's whole families, against this estimate):
llama 796 MiB, orpheus 922, bagel 1642, qwen3_omni's thinker 2650 and talker 98 (docs/engine.md).
The earlier model (the batched families' shared term, no slack) estimated bagel's at 536 MiB and the
thinker's at 817: their specs leave `intermediate` out, which the estimate then read as no MLP,
while the runtime builds 4 x hidden (node_args.MLP_WIDTH_PER_HIDDEN, now used by both).

The bucket count matters as much as the largest bucket: the reference once failed to boot when a
wider capture set grew one node's buckets from 29 to 68; the per-graph terms here make such a
change show up in the estimate and the capture memory check (MW408).
"""
from __future__ import annotations

from mstar.lang import ast
from mstar.plan.node_args import MLP_WIDTH_PER_HIDDEN

MIB = 1024 * 1024
ACTIVATION_BYTES = 2  # bf16 activations
LOGIT_BYTES = 2  # bf16 logits (engine/gpu/forward.py); the sampler upcasts
TOKEN_ID_BYTES = 8  # a graph's greedy ids (int64)
# Hidden-sized tensors alive at once inside one layer's step (residual, normed input, q/k/v,
# attention output, its projection), shared across layers through the graph pool.
ACTIVATION_FACTOR = 6
# Intermediate-sized tensors alive at once in the MLP: gate and up (one matrix), their product.
MLP_FACTOR = 3
CAPTURE_WORKSPACE_BYTES = 32 * MIB
STATE_BYTES = 4  # the gated delta-net layer's fp32 temporaries
# Stateless nodes without a `hidden` dim (codecs, encoders) are sized as a 1024-wide model.
DEFAULT_HIDDEN = 1024
POOL_SLACK = 1.6  # a whole packed pool's segments over its largest key's peak activations (docstring)


def graph_keys(capture: ast.CaptureDecl) -> list[tuple[int, int]]:
    """(rows, tokens) of every graph the family captures, in declaration order."""
    if capture.family == "batched":
        return [(b, b * capture.tokens_per_row) for b in capture.batch]
    # A packed capture without token buckets captures one key per batch size, one token a row.
    tokens = capture.tokens or [0]
    return [(b, t if t else b) for b in capture.batch for t in tokens]


def num_graphs(capture: ast.CaptureDecl) -> int:
    """Number of captured keys (buckets)."""
    return len(capture.batch) * (max(1, len(capture.tokens)) if capture.family == "packed" else 1)


def _dim(node: ast.NodeDecl, name: str, default: int) -> int:
    for arg in node.args:
        if arg.name == name and isinstance(arg.value, int) and arg.value > 0:
            return arg.value
    return default


def _recurrent_row_bytes(node: ast.NodeDecl) -> int:
    """Scratch a row of a step holds in one gated delta-net layer (the module docstring's
    `recurrent` term), 0 for a node without a recurrent state."""
    if not node.states:
        return 0
    args = ast.values_by_name(node.states[0].args)
    heads, key_dim, value_dim = (args.get(name) for name in ("heads", "key_dim", "value_dim"))
    if not all(isinstance(n, int) and n > 0 for n in (heads, key_dim, value_dim)):
        return 0  # the argument checks report it
    assert isinstance(heads, int) and isinstance(key_dim, int) and isinstance(value_dim, int)
    value_heads = _dim(node, "linear_value_heads", heads)
    conv_dim = 2 * heads * key_dim + value_heads * value_dim
    return 2 * value_heads * value_dim * STATE_BYTES + conv_dim * ACTIVATION_BYTES


def estimate_family_bytes(node: ast.NodeDecl, capture: ast.CaptureDecl, tp_size: int, num_sequences: int = 1) -> int:
    """Estimated bytes one capture family of `node` holds on each of its tp_size ranks, when each
    row runs `num_sequences` KV sequences (its labels: the module docstring's `labels`)."""
    keys = [(rows * num_sequences, tokens * num_sequences) for rows, tokens in graph_keys(capture)]
    if not keys:
        return 0
    hidden = _dim(node, "hidden", DEFAULT_HIDDEN)
    intermediate = _dim(node, "intermediate", MLP_WIDTH_PER_HIDDEN * hidden if node.engine == "kv" else 0)
    vocab = _dim(node, "vocab", 0)
    max_rows = max(rows for rows, _ in keys)
    max_tokens = max(tokens for _, tokens in keys)
    is_whole_packed = capture.family == "packed" and not capture.is_piecewise
    activations = (_whole_step_peak(node, hidden, intermediate) * POOL_SLACK if is_whole_packed
                   else ACTIVATION_FACTOR * hidden + MLP_FACTOR * intermediate)
    # A batched graph's logits are its output (per graph, below); a packed key's are copied out.
    copied_logits = max_rows * vocab * LOGIT_BYTES if capture.family == "packed" else 0
    shared = (int(max_tokens * activations) * ACTIVATION_BYTES + copied_logits
              + max_rows * _recurrent_row_bytes(node))
    logit_row = vocab * LOGIT_BYTES + TOKEN_ID_BYTES if vocab else 0
    if capture.is_piecewise:
        per_graph = (max_tokens * (hidden + 2 * _boundary_width(node, hidden)) * ACTIVATION_BYTES
                     + max_rows * logit_row)
    elif is_whole_packed:  # one output buffer for every key
        per_graph = max_tokens * hidden * ACTIVATION_BYTES + max_rows * logit_row
    else:
        per_graph = sum(tokens * hidden * ACTIVATION_BYTES + rows * logit_row for rows, tokens in keys)
    return (shared + per_graph) // max(1, tp_size) + CAPTURE_WORKSPACE_BYTES


def _whole_step_peak(node: ast.NodeDecl, hidden: int, intermediate: int) -> int:
    """Values per token alive at a whole packed step's peak (the module docstring's `peak`)."""
    q_width = _boundary_width(node, hidden)
    kv_width = _dim(node, "kv_heads", 0) * _dim(node, "head_dim", 0) or q_width
    attention = 4 * hidden + (q_width + 2 * kv_width) + 2 * q_width
    return max(3 * hidden + 3 * intermediate, attention)


def _boundary_width(node: ast.NodeDecl, hidden: int) -> int:
    """Width of one of the two values a token hands between the pieces of a piecewise graph (the
    module docstring's `boundary` term): its queries, and its attention output."""
    qo_heads = _dim(node, "qo_heads", 0)
    if not qo_heads:
        return hidden
    return qo_heads * _dim(node, "head_dim", max(1, hidden // qo_heads))


def format_mib(num_bytes: int) -> str:
    return f"{num_bytes / MIB:.1f} MiB"
