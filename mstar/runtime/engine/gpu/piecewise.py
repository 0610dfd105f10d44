"""Piecewise CUDA graphs of a node's packed capture families (prefill and mixed steps).

In: the step function (`DecoderForward`), the
FlashInfer wrappers (`FlashInferSteps`; each step's attention is planned on the host and passed to
`replay`), the device token table, the token buckets of the node's packed families and their largest batch size.
Out: `PiecewiseGraphs`. For each token bucket T the step function is captured in L + 1 pieces (L:
the layers): piece 0 runs from the embedding to layer 0's cut, piece i from layer i-1's cut to
layer i's, the last piece to the logits and their argmax. A full-attention layer is cut at its
attention (the piece ends with its queries and its K/V write); a gated delta-net layer (a hybrid
decoder) at its rule (the piece ends with the layer's [q|k|v] channels and gates in `handover`;
`GdnForward.middle`, the conv over the rows' stored windows and the rule from and into their
slots, is what the step's token layout decides). `replay(T, num_tokens)` replays piece i, runs
layer i's attention eagerly over the step's real tokens from `queries` into `attended` (or its
middle from `handover` straight into `handover.out`), and goes on; the step's inputs are in
`inputs[T]` beforehand (the packing layout of `packing.py` with T tokens and `max_rows` row
entries), and the step's eager attention planned for its rows (`FlashInferSteps.plan_eager`: one
prefill call, or the plan's split route).

Why piecewise: a packed step's attention plan (how many rows, how long each) changes every step,
and FlashInfer's prefill kernels take it from host-side scheduling, so a whole-step graph would
need fixed buffers per (batch, token) bucket. The other ~20 kernels per layer do not depend on it:
captured, they cost one graph launch per layer instead of a Python dispatch each (an eager 575-token
step spent 11 ms launching 3.5 ms of kernels on the H200, docs/engine.md). A gated delta-net layer's
middle is left out for the same reason: its kernels' grids and fla's chunk indices follow the
rows' lengths, which change every step.

The graphs of every bucket share one memory pool and are replayed in the order they were captured
(piece 0, 1, ...), which is what makes tensors that one piece writes and the next reads safe in a
shared pool; no bucket's replay interleaves with another's, so a bucket's blocks freed at the end
of its capture serve the next. Buckets are captured largest first so smaller ones reuse its blocks,
and every bucket writes its logits into one buffer: the pool is about one step of the largest
bucket, whatever the number of buckets. Tokens past the
step's real ones (the padding up to T) write the dummy KV page and attend to nothing; every row
entry past the real rows reads token 0's logits, which nobody uses. `measured_bytes` is the growth
of the device memory torch reserved across the capture.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch

from mstar.runtime.engine.gpu import blas_edges
from mstar.runtime.engine.gpu.forward import DecoderForward
from mstar.runtime.engine.gpu.gdn_forward import GdnForward, LinearCut
from mstar.runtime.engine.gpu.graphs import capture_measured, upload
from mstar.runtime.engine.gpu.packing import NUM_TOKEN_FIELDS


class PiecewiseGraphs:
    def __init__(self, forward: DecoderForward, loop_tokens: torch.Tensor, token_buckets: list[int], max_rows: int,
                 dummy_slot: int, device: torch.device, keeps_hidden: bool = False):
        """keeps_hidden: every step also writes every position's final hidden state into `hidden`
        (a prompt's log-probabilities, engine/prompt_logprobs.py)."""
        self.forward, self.loop_tokens = forward, loop_tokens
        self.max_rows, self.device = max_rows, device
        # Where each piece ends: (is a full-attention layer, its index among its kind), in layer order.
        self.cuts = [(layer.is_full, forward.kind_index[i]) for i, layer in enumerate(forward.model.model.layers)]
        self.token_buckets = sorted(set(token_buckets))
        d = forward.dims
        largest = self.token_buckets[-1]
        # The queries a piece hands to eager attention, and the attention's output the next piece
        # reads: at fixed addresses, shared by every bucket (a bucket uses the first T rows).
        self.queries = torch.zeros(largest, d.num_qo_heads, d.head_dim, dtype=torch.bfloat16, device=device)
        self.attended = torch.zeros_like(self.queries)
        self.handover = Handover.of(forward.gdn, largest, device) if forward.gdn is not None else None
        # Every position's final hidden state, shared by every bucket as the queries are (32 MiB at
        # Llama-3.2-1B's 8,192-token bucket; outside the measured growth, as they are): one fused
        # norm over the step's tokens more a step, a few us beside a prefill step's milliseconds.
        self.hidden = (torch.zeros(largest, forward.model.model.norm.weight.shape[0], dtype=torch.bfloat16,
                                   device=device) if keeps_hidden else None)
        self.inputs: dict[int, torch.Tensor] = {}
        # Every bucket's last piece copies its logits and their argmax here: one [max_rows, vocab]
        # fp32 buffer for all buckets instead of one each (32 MiB a bucket for Llama-3.2-1B). Sized
        # by the first warm-up's logits: a tensor-parallel rank's are gathered to the whole vocabulary.
        self.logits: Optional[torch.Tensor] = None
        self.greedy = torch.zeros(max_rows, dtype=torch.long, device=device)
        self.pieces: dict[int, list[torch.cuda.CUDAGraph]] = {}
        self.measured_bytes = capture_measured(
            self.token_buckets, lambda bucket, pool, stream: self._capture(bucket, dummy_slot, pool, stream), device)
        upload([piece for pieces in self.pieces.values() for piece in pieces], device)

    def row_fields_offset(self, bucket: int) -> int:
        """Where `inputs[bucket]`'s row fields (last-token index, row slot; `max_rows` each) start."""
        return NUM_TOKEN_FIELDS * bucket

    def _body(self, bucket: int, attend: Callable, cut_linear: Optional[Callable]) -> None:
        t, r = bucket, self.max_rows
        ids, positions, slots, src, last_index, _ = self.inputs[bucket].split([t, t, t, t, r, r])
        linear = LinearCut(cut_linear) if cut_linear is not None else None
        self.forward.hidden_into = self.hidden[:t] if self.hidden is not None else None
        try:
            logits = self.forward(ids, positions, slots, last_index, attend, linear, fed=(src, self.loop_tokens))
        finally:
            self.forward.hidden_into = self.forward.hidden = None
        if self.logits is None:  # the first warm-up, outside every graph
            self.logits = torch.zeros(logits.shape, dtype=logits.dtype, device=self.device)
        self.logits.copy_(logits)
        self.forward.greedy(self.logits, out=self.greedy)

    def _capture(self, bucket: int, dummy_slot: int, pool, stream: torch.cuda.Stream) -> None:
        t, r = bucket, self.max_rows
        # Every token writes the dummy slot at position 0 and every row reads token 0: what the
        # warm-up runs touch (the capture itself runs nothing).
        inputs = torch.zeros(NUM_TOKEN_FIELDS * t + 2 * r, dtype=torch.int32, device=self.device)
        inputs[2 * t:3 * t] = dummy_slot
        inputs[3 * t:4 * t] = -1
        self.inputs[bucket] = inputs
        queries, attended = self.queries[:t], self.attended[:t]
        handover = self.handover

        def skip_attention(_index: int, q: torch.Tensor, _k: torch.Tensor, _v: torch.Tensor) -> torch.Tensor:
            queries.copy_(q)
            return attended

        def skip_linear(_index: int, mixed: torch.Tensor, g: torch.Tensor, beta: torch.Tensor) -> torch.Tensor:
            assert handover is not None, "a cut at a linear layer: a hybrid decoder's graphs"
            return handover.hand(mixed, g, beta)

        is_hybrid = handover is not None
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream), torch.no_grad():
            for _ in range(2):  # cuBLAS's handles and Triton's first launches happen outside the graphs
                self._body(bucket, skip_attention, skip_linear if is_hybrid else None)
            pieces: list[torch.cuda.CUDAGraph] = []
            graph = blas_edges.new_graph()
            graph.capture_begin(pool=pool)
            try:
                def cut(out: torch.Tensor) -> torch.Tensor:
                    """End the piece after the layer's handover is in place; the next piece starts here."""
                    nonlocal graph
                    graph.capture_end()
                    pieces.append(graph)
                    graph = blas_edges.new_graph()
                    graph.capture_begin(pool=pool)
                    return out

                self._body(bucket, lambda *args: cut(skip_attention(*args)),
                           (lambda *args: cut(skip_linear(*args))) if is_hybrid else None)
            finally:
                graph.capture_end()
            pieces.append(graph)
        torch.cuda.current_stream(self.device).wait_stream(stream)
        for piece in pieces:
            blas_edges.finish(piece)
        if len(pieces) != len(self.cuts) + 1:
            raise RuntimeError(f"piecewise capture of {t} tokens cut {len(pieces)} pieces for {len(self.cuts)} layers")
        self.pieces[bucket] = pieces

    def replay(self, bucket: int, num_tokens: int, attention: Callable, linear: Optional[Callable] = None
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """Run a step of `num_tokens` real tokens padded to `bucket` (its inputs staged, the eager
        wrapper planned); `attention(q, pages, out)` is the step's planned eager attention
        (`EagerAttention.run`); `linear(index, mixed, g, beta, out)` a hybrid decoder's middle of
        linear layer `index` over the step's real tokens into `out` (`GdnForward.middle` of the
        step's rows). Returns (logits [max_rows, vocab], argmax [max_rows]), buffers every bucket
        writes (valid until the next replay)."""
        queries, attended = self.queries[:num_tokens], self.attended[:num_tokens]
        pieces = self.pieces[bucket]
        for piece, (is_full, index) in zip(pieces, self.cuts):
            piece.replay()
            if is_full:
                attention(queries, self.forward.kv.pages(index), attended)
            else:
                assert linear is not None and self.handover is not None, "a hybrid decoder's step carries its rows"
                linear(index, *self.handover.given(num_tokens), self.handover.out[:num_tokens])
        pieces[-1].replay()
        assert self.logits is not None, "allocated by the first warm-up"
        return self.logits, self.greedy


@dataclass
class Handover:
    """What a hybrid decoder's pieces hand to a gated delta-net layer's eager middle and back, at
    fixed addresses shared by every bucket and layer (a step uses the first T rows): the layer's
    [q|k|v] channels and gates, and its rule's output `[T, HV, d_v]`. Rows past a step's real
    tokens keep what an earlier step left (finite values the padding tokens' rows compute on)."""

    mixed: torch.Tensor
    g: torch.Tensor
    beta: torch.Tensor
    out: torch.Tensor

    @classmethod
    def of(cls, gdn: GdnForward, tokens: int, device: torch.device) -> "Handover":
        layer = gdn.layers[0]
        heads, dtype = layer.num_value_heads, torch.bfloat16
        return cls(torch.zeros(tokens, layer.conv_dim, dtype=dtype, device=device),
                   torch.zeros(tokens, heads, dtype=torch.float32, device=device),  # the gates' g is fp32
                   torch.zeros(tokens, heads, dtype=dtype, device=device),
                   torch.zeros(tokens, heads, layer.value_dim, dtype=dtype, device=device))

    def hand(self, mixed: torch.Tensor, g: torch.Tensor, beta: torch.Tensor) -> torch.Tensor:
        """In a piece: the layer's inputs into the buffers -> the buffer its output will be in."""
        t = mixed.shape[0]
        self.mixed[:t].copy_(mixed)
        self.g[:t].copy_(g)
        self.beta[:t].copy_(beta)
        return self.out[:t]

    def given(self, num_tokens: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.mixed[:num_tokens], self.g[:num_tokens], self.beta[:num_tokens]
