"""The simulated engine's step time: a roofline per step for kv nodes, a flat model for stateless ones.

In: the plan, once (each kv node's dims, the piecewise capture families). Per step: a `Step` (its
rows' tokens and contexts, capture, padding, attention route). Out: modelled seconds
(`StepCost.seconds(step)`), in O(rows) with no allocation beyond a few floats.

kv nodes (docs/runtime.md "## Simulated engine" gives the figures it was calibrated to):

    time   = launch + linear + sum over rows of attention(row)
    linear = max(mem, compute) + RIDGE_LOSS * min(mem, compute)
             mem     = weight bytes (every matrix of the layers and the lm_head, bf16, read once a step)
                       / WEIGHT_READ_BANDWIDTH
             compute = 2 * (layer parameters * tokens run + lm_head parameters * rows run) / MATMUL_RATE
    attention(row) = max(kv bytes / KV rate, attention flops / ATTENTION_RATE), the KV rate
             DECODE_KV_BANDWIDTH in a decode graph's replay (one token a row, a padded batch, no
             token bucket) of heads the Triton decode kernel serves (`decode_heads.serves_heads`),
             READ_BANDWIDTH otherwise (FlashInfer's kernels)
             kv bytes = (context + tokens) * per-token KV bytes (read the context, write the new tokens)
             flops    = 4 * heads * head_dim * full layers * keys attended, where a causal row's t new
                        tokens after c cached attend t * c + t * (t + 1) / 2 keys (the causal halving),
                        a bidirectional walk's t * (c + t)

The linear layers' weights are read once a step whatever its rows, so decode rows beside a prompt
chunk add little there; a decode row's attention is bound by its KV bytes, a chunk's by its flops.
A matrix product near the ridge point reaches neither bound (RIDGE_LOSS: a 216-token chunk step's
matrix products measured 0.36 ms above the decode step's at the same bytes). Linear and attention
run as separate kernels, one after the other, so their times add.

Tokens and rows run include the capture's padding: a packed capture runs its token bucket, a
batched one its padded batch (padding rows cost like real ones in the matrix products; their
attention segments are empty).

launch: CAPTURED_LAUNCH_S when the step replays a capture (padded_batch > 0), else EAGER_LAUNCH_S;
SPLIT_EXTRA_S more for a split-attention mixed step (eager or piecewise: one more eager call a
layer); layers * PIECE_LAUNCH_S more for a replay of a piecewise family (its attention runs eagerly
between the captured pieces); for a replay of a packed family captured whole, layers *
TRITON_GRAPH_MERGE_S where the node's heads are served by the Triton kernels (both routes' keys
attend on them, the prompt tokens at TRITON_PREFILL_RATE), else layers * GRAPH_MERGE_S (FlashInfer's
graph-mode prefill, which merges its split KV) instead.

Dims come from the plan (`layers`, `hidden`, `qo_heads`, `kv_heads`, `head_dim`, `vocab`,
`intermediate`, `layer_pattern`). A missing `intermediate` is 4 x hidden, the torch engine's own
default (plan/dims.py). A node missing any other of these is costed as the reference node (the
Orpheus-size LLM, 28 layers of hidden 3072) scaled by the node weight layers * hidden / (28 * 3072)
(28 and 3072 where missing), the previous model's weight. Not modelled: sub-models (a depth model's
inner steps), the linear-attention layers' recurrent state (their parameters count like a full
layer's, their state reads not at all) and their host time in eager and piecewise steps (their conv
and chunked rule run eagerly: a Qwen3.5 packed step on its piecewise graphs measured 2-4 times its
kernels on the H200, most of the rest those layers' launches, docs/engine.md), tensor parallelism
(each rank is costed with all weights),
media tokens.

Stateless nodes keep the flat model: launch + STATELESS_WEIGHT * (rows * PER_ROW_S +
tokens * PER_TOKEN_S + context * PER_CONTEXT_S).
"""
from __future__ import annotations

from dataclasses import dataclass
from operator import attrgetter
from typing import Optional

from mstar.plan.dims import attention_flops_per_key, attention_layer_params
from mstar.plan.node_args import MLP_WIDTH_PER_HIDDEN, layer_is_full
from mstar.plan.schema import NodePlan, Plan
from mstar.runtime.engine.gpu.decode_heads import serves_heads
from mstar.runtime.step import Step

# Measured on one H200 (docs/engine.md): copy bandwidth 4.1-4.3 TB/s, bf16 matmul 754-792 TFLOP/s.
COPY_BANDWIDTH = 4.15e12  # bytes/s
# Decode replays of Llama-3.2-1B's shape with the Triton decode attention (docs/engine.md, "Decode
# attention in Triton"): 1 row at context 1024 in 1.086 ms, 8 rows in 1.19, 64 rows in 1.757 (2.47
# GB of weights, + 2.15 GB of KV at 64 rows). The weights read at about 0.67 of the copy bandwidth
# (the 1-row replay less its launch), a decode step's KV at 0.82 (the kernel's 631 us for 2.15 GB).
WEIGHT_READ_BANDWIDTH = 0.67 * COPY_BANDWIDTH
DECODE_KV_BANDWIDTH = 0.82 * COPY_BANDWIDTH
# Prompt and mixed steps attend on FlashInfer's kernels: their KV reads keep the blended rate the
# FlashInfer decode replays measured before (1.22 ms at 1 row, 2.04 at 64: 0.63 of the copy rate).
READ_BANDWIDTH = 0.63 * COPY_BANDWIDTH
MATMUL_RATE = 780e12  # flop/s
# A prompt chunk's attention beside 40 decode rows (FlashInfer's packed call, docs/engine.md): a
# 216-token chunk at context 4096 and 7936 added 1.11 and 2.21 ms to the decode rows' attention
# kernels (about 105 TFLOP/s; the whole call's flops over its whole time is the 80 TFLOP/s quoted
# there), a 472-token chunk about 1.9 and 3.1 ms (130-160 TFLOP/s); the 216-token chunk alone (fa3)
# ran at about 124 TFLOP/s. One rate between them: 0.16 of the matmul rate, 125 TFLOP/s.
ATTENTION_RATE = 0.16 * MATMUL_RATE
# The prompt rows of a whole graph (either route) attend on the Triton prefill kernel where it
# serves the heads (docs/engine.md, "The split route on Triton"): a 216-token chunk after 4,096 and
# 7,936 positions took 42.6 and 71.4 us a layer on the H200 in the chunk step's graph (175 and 199
# TFLOP/s): 0.25 of the matmul rate.
TRITON_PREFILL_RATE = 0.25 * MATMUL_RATE
RIDGE_LOSS = 0.4
BYTES_PER_VALUE = 2  # bf16 weights and KV

# A replay's launch, norms, RoPE and the gaps between its kernels (0.2 ms until RoPE became one
# program a token: the decode graphs' replays then measured 0.996 / 1.096 / 1.629 ms at 1 / 8 / 64 rows).
CAPTURED_LAUNCH_S = 0.0001
# An eager step's host dispatch: on the H200 an eager 512-token step took 1.7-2.1 ms more than
# its piecewise replay (docs/engine.md, "Piecewise graphs").
EAGER_LAUNCH_S = 0.0025
SPLIT_EXTRA_S = 0.0002
# Per layer of a piecewise replay: its eager attention call and the next piece's launch (a chunk
# step's wall time less its kernels exceeded the decode graph's by about 0.45 ms over 16 layers).
PIECE_LAUNCH_S = 0.00003
# Per layer of a whole packed graph's replay on FlashInfer's graph-mode prefill (heads the Triton
# kernels do not serve): it always splits the KV and merges the partial outputs (calibrated when a
# split step's 32 merges took 0.52 ms on the H200: 16 us each).
GRAPH_MERGE_S = 0.000016
# Per layer of a whole graph whose attention runs on the Triton decode and prefill kernels (both
# routes, where they serve the heads): the prefill merge took 43 us a 16-layer step on the H200
# (docs/engine.md, "The split route on Triton").
TRITON_GRAPH_MERGE_S = 0.0000027

# The flat model of stateless nodes (and of a step on a node the plan does not list).
PER_ROW_S = 0.00005
PER_TOKEN_S = 0.00002
PER_CONTEXT_S = 0.00000002
STATELESS_WEIGHT = 0.2

# The reference node of the fallback: Orpheus's LLM (specs/orpheus.mw).
REFERENCE_DIMS = {"layers": 28, "hidden": 3072, "intermediate": 8192, "qo_heads": 24, "kv_heads": 8,
                  "head_dim": 128, "vocab": 156940}
_tokens_of = attrgetter("num_tokens")
_context_of = attrgetter("context_len")
REQUIRED_DIMS = ("layers", "hidden", "qo_heads", "kv_heads", "head_dim", "vocab")


@dataclass(frozen=True)
class NodeCost:
    """One kv node's constants for the roofline."""

    layer_params: float  # parameters of the layers' matrices (each token runs them all)
    lm_head_params: float  # the output projection's (once per row: its last token's logits)
    kv_bytes_per_token: float  # K and V of one token over the full-attention layers
    flops_per_key: float  # attention flops of one query token against one key, over those layers
    num_layers: int
    is_fallback: bool = False  # dims missing from the plan: the reference node scaled by the weight
    # A captured decode step's KV rate: the Triton decode kernel's where it serves the heads, else FlashInfer's.
    decode_kv_bandwidth: float = READ_BANDWIDTH
    # Whether the Triton decode and prefill kernels serve the heads (a whole graph's attention runs on them).
    is_triton_served: bool = False

    @property
    def weight_bytes(self) -> float:
        return (self.layer_params + self.lm_head_params) * BYTES_PER_VALUE


def _positive_int(value) -> Optional[int]:
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def _from_dims(dims: dict[str, int], num_full_layers: int) -> NodeCost:
    layers, hidden = dims["layers"], dims["hidden"]
    qo_width, kv_width = dims["qo_heads"] * dims["head_dim"], dims["kv_heads"] * dims["head_dim"]
    per_layer = attention_layer_params(hidden, qo_width, kv_width, dims["intermediate"])
    is_served = serves_heads(dims["qo_heads"], dims["kv_heads"], dims["head_dim"])  # by the Triton kernels
    return NodeCost(
        layer_params=float(layers * per_layer),
        lm_head_params=float(dims["vocab"] * hidden),
        kv_bytes_per_token=float(2 * kv_width * num_full_layers * BYTES_PER_VALUE),
        flops_per_key=float(attention_flops_per_key(qo_width, num_full_layers)),
        num_layers=layers,
        decode_kv_bandwidth=DECODE_KV_BANDWIDTH if is_served else READ_BANDWIDTH,
        is_triton_served=is_served,
    )


def node_cost(node: NodePlan) -> NodeCost:
    """The node's roofline constants from its dims, or the reference node's scaled by its weight."""
    stated = {name: _positive_int(node.dims.get(name)) for name in REQUIRED_DIMS}
    dims = {name: value for name, value in stated.items() if value is not None}
    if len(dims) == len(REQUIRED_DIMS):
        dims["intermediate"] = _positive_int(node.dims.get("intermediate")) or MLP_WIDTH_PER_HIDDEN * dims["hidden"]
        flags = layer_is_full(node.dims.get("layer_pattern"), dims["layers"], node.recurrent is not None)
        return _from_dims(dims, sum(flags) if flags is not None else dims["layers"])
    layers = dims.get("layers", REFERENCE_DIMS["layers"])
    hidden = dims.get("hidden", REFERENCE_DIMS["hidden"])
    weight = layers * hidden / (REFERENCE_DIMS["layers"] * REFERENCE_DIMS["hidden"])
    ref = _from_dims(REFERENCE_DIMS, REFERENCE_DIMS["layers"])
    return NodeCost(ref.layer_params * weight, ref.lm_head_params * weight, ref.kv_bytes_per_token * weight,
                    ref.flops_per_key * weight, layers, is_fallback=True, decode_kv_bandwidth=ref.decode_kv_bandwidth)


class StepCost:
    """Seconds per step by the model in the module docstring."""

    def __init__(self, plan: Plan):
        self.nodes: dict[str, NodeCost] = {n.name: node_cost(n) for n in plan.nodes if n.engine == "kv"}
        self.bidirectional: dict[str, frozenset[str]] = {n.name: frozenset(n.bidirectional_walks) for n in plan.nodes}
        # (worker, key, family) -> layers whose attention a replay of that piecewise family runs
        # eagerly, or (whole_layers) whose graph-mode attention merges split outputs.
        self.piecewise_layers: dict[tuple[int, str, str], int] = {}
        self.whole_layers: dict[tuple[int, str, str], int] = {}
        dims = {node.name: node.dims for node in plan.nodes}
        for worker in plan.workers:
            for key in worker.keys:
                layers = _positive_int(dims[key.node].get("layers", 1)) or 1
                for family in key.captures:
                    if family.is_piecewise:
                        self.piecewise_layers[(worker.rank, key.name, family.name)] = layers
                    elif family.kind == "packed":
                        self.whole_layers[(worker.rank, key.name, family.name)] = layers

    def _whole_layers(self, step: Step, family: Optional[tuple[int, str, str]] = None) -> int:
        """The layers of the whole packed graph the step replays; 0 when it replays none. family:
        the step's (worker, key, capture) where the caller built it already."""
        if step.padded_batch > 0 and step.token_bucket:
            return self.whole_layers.get(family or (step.worker, step.key, step.capture or ""), 0)
        return 0

    def launch(self, step: Step) -> float:
        is_captured = step.padded_batch > 0
        launch = CAPTURED_LAUNCH_S if is_captured else EAGER_LAUNCH_S
        family = (step.worker, step.key, step.capture or "")
        whole_layers = self._whole_layers(step, family)
        if whole_layers:  # the route's attention calls are in the graph: their merges, no extra launch
            cost = self.nodes.get(step.node)
            is_triton = cost is not None and cost.is_triton_served
            launch += whole_layers * (TRITON_GRAPH_MERGE_S if is_triton else GRAPH_MERGE_S)
        elif step.attention == "split":
            launch += SPLIT_EXTRA_S
        if is_captured and self.piecewise_layers:
            launch += self.piecewise_layers.get(family, 0) * PIECE_LAUNCH_S
        return launch

    def seconds(self, step: Step) -> float:
        cost = self.nodes.get(step.node)
        if cost is None:
            return self._flat(step)
        rows = step.rows
        num_rows = len(rows)
        bandwidth, attention_rate = READ_BANDWIDTH, ATTENTION_RATE
        if cost.is_triton_served and self._whole_layers(step):  # the prompt rows on the Triton prefill kernel
            attention_rate = TRITON_PREFILL_RATE
        kv_bytes, flops_per_key = cost.kv_bytes_per_token, cost.flops_per_key
        num_tokens = sum(map(_tokens_of, rows))
        if num_rows and max(map(_tokens_of, rows)) == 1:
            # One token a row (a decode step): each row reads and attends context + 1 keys, so the
            # rows' roofline is one bound over their summed keys (no loop in Python).
            num_keys = sum(map(_context_of, rows)) + num_rows
            # A decode graph's replay (no token bucket) attends on the decode kernel of its heads.
            kv_rate = cost.decode_kv_bandwidth if step.padded_batch > 0 and not step.token_bucket else bandwidth
            read_s = num_keys * kv_bytes / kv_rate
            compute_s = num_keys * flops_per_key / attention_rate
            attention = read_s if read_s > compute_s else compute_s
        else:
            attention = 0.0
            bidirectional = self.bidirectional.get(step.node)
            for row in rows:
                tokens, context = row.num_tokens, row.context_len
                if bidirectional and row.walk in bidirectional:
                    keys = tokens * (context + tokens)
                else:
                    keys = tokens * context + tokens * (tokens + 1) // 2
                read_s = (context + tokens) * kv_bytes / bandwidth
                compute_s = keys * flops_per_key / attention_rate
                attention += read_s if read_s > compute_s else compute_s
        num_rows_run, num_tokens_run = num_rows, num_tokens
        if step.padded_batch > num_rows:
            num_rows_run = step.padded_batch
            if not step.token_bucket and num_rows:  # a batched family: each padding row feeds as many tokens
                num_tokens_run += (step.padded_batch - num_rows) * (num_tokens // num_rows)
        if step.token_bucket > num_tokens_run:
            num_tokens_run = step.token_bucket
        mem = cost.weight_bytes / WEIGHT_READ_BANDWIDTH
        compute = 2 * (cost.layer_params * num_tokens_run + cost.lm_head_params * num_rows_run) / MATMUL_RATE
        linear = mem + RIDGE_LOSS * compute if mem > compute else compute + RIDGE_LOSS * mem
        return self.launch(step) + linear + attention

    def _flat(self, step: Step) -> float:
        num_rows = step.padded_batch if step.padded_batch > 0 else len(step.rows)
        num_tokens = sum(map(_tokens_of, step.rows))
        num_context = sum(map(_context_of, step.rows))
        return self.launch(step) + num_rows * PER_ROW_S + STATELESS_WEIGHT * (
            num_tokens * PER_TOKEN_S + num_context * PER_CONTEXT_S)
