"""Whole CUDA graphs of a node's packed capture families (prefill and mixed steps), attention inside.

In: the step function (`DecoderForward` of a decoder without gated delta-net layers), the node's
`FlashInferSteps` (its float workspace, heads and page size), the device token table, the most
pages one row indexes, and the graph keys: every (token bucket T, batch size B) of the node's
packed families that the plan captures whole (`CaptureFamily.is_piecewise` false; B <= T).
Out: `PackedGraphs`. `plan(key, qo, kv, kv_lens)` schedules a step's attention for the key's graph on
the host, `replay(key)` runs the step; the step's inputs are in `inputs[key]` (the packing layout of
`packing.py`: T tokens, B row entries) and its attention indices in `indices[B]` beforehand, and
`logits[:B]`, `greedy[:B]` hold its outputs afterwards (one pair of buffers for every key).

Why whole graphs: a piecewise step (`piecewise.py`) launches an eager attention call per layer
between its pieces, and on the H200 the host's launches set its pace: a 256-token chunk step whose
kernels take about 1.2 ms spanned 2.8-3.2 ms on the device (docs/runtime.md, `mstar bench kv`). Here
the whole step is one graph launch.

How attention fits in a graph: one FlashInfer prefill wrapper per key in CUDA-graph mode (fa2),
built on `indices[B]` (qo indptr, kv indptr, last page lengths, page indices at fixed addresses). Its
row count is B and its largest token count T, both frozen by the capture's plan (shared/reference/
flashinfer.md, 1.4); a step of fewer rows pads them as zero-length rows with no pages (style B),
its tokens past the real ones write the dummy page and are attended by nobody. Every step is
planned again before its replay: `plan` calls the wrapper's compiled planner directly with the
host CSR arrays, as FlashInfer's own `fast_decode_plan` does for decode wrappers (`plan()` itself
copies the index arrays again, from pageable memory, and iterates tensors in Python: 0.1-0.3 ms at
64 rows); the planner's schedule must keep the captured layout (`PlanMismatch` otherwise). The
wrappers share one int workspace and its pinned mirror (8 MiB each a wrapper otherwise: hundreds
of MiB for a hundred keys): only the key about to replay is planned, and plans are serialised by
the executor (a plan waits for the previous plan's copies). In graph mode FlashInfer always splits
the KV, so the float workspace must hold the split outputs of the largest key
(`graph_workspace_bytes`).

Memory: every key's graph is captured in one pool, largest first, so a smaller key reuses the
blocks a larger one freed; the logits of every key land in one buffer. `measured_bytes` is the
growth of the memory torch reserved across the capture (`graphs.capture_measured`).
"""
from __future__ import annotations

from typing import Optional

import numpy as np
import torch

from mstar.runtime.engine.gpu.attention import FlashInferSteps
from mstar.runtime.engine.gpu.forward import DecoderForward
from mstar.runtime.engine.gpu.graphs import capture_measured
from mstar.runtime.engine.gpu.packing import NUM_TOKEN_FIELDS, fed_ids

GraphKey = tuple[int, int]  # (token bucket T, batch size B)
INT_WORKSPACE_BYTES = 8 << 20  # FlashInfer's own size for a wrapper's int workspace
CTA_TILE_Q = 128  # the fa2 prefill tile height graph mode picks for a key with a long row (head dim < 256)
PLAN_INFO_TOTAL_ROWS = 1  # the one entry of FlashInfer's PrefillPlanInfo that may change between plans


class PlanMismatch(RuntimeError):
    """FlashInfer scheduled a step in a layout other than the one its graph was captured with."""


def graph_workspace_bytes(keys: list[GraphKey], num_qo_heads: int, num_kv_heads: int, head_dim: int,
                          num_sms: int) -> int:
    """Float workspace the graph-mode fa2 prefill planner needs for the largest key: it always
    splits the KV, keeping fp32 partial outputs and their log-sum-exps for `padded_tiles` tiles of
    CTA_TILE_Q rows, `max(2 x SMs / kv heads, ceil(T x group / CTA_TILE_Q) + B - 1)` tiles
    (shared/reference/flashinfer.md, "Sizing for FA2 prefill in graph mode")."""
    group = num_qo_heads // num_kv_heads
    need = 0
    for tokens, rows in keys:
        tiles = max(2 * num_sms // num_kv_heads, -(-tokens * group // CTA_TILE_Q) + rows - 1)
        need = max(need, 4 * num_qo_heads * CTA_TILE_Q * tiles * (head_dim + 1))
    return need


def workspace_bytes_for(keys: list[GraphKey], num_qo_heads: int, num_kv_heads: int, head_dim: int,
                        device: torch.device, floor: int) -> int:
    """The node's float workspace: `floor`, or the graphs' need and an eighth more."""
    need = graph_workspace_bytes(keys, num_qo_heads, num_kv_heads, head_dim, _num_sms(device)) if keys else 0
    return max(floor, need + (need >> 3))


def _num_sms(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def kv_lengths(kv_indptr: np.ndarray, last_page_len: np.ndarray, page_size: int) -> np.ndarray:
    """Each row's KV length from its page count and last page length; a row of no pages has none."""
    pages = np.diff(kv_indptr)
    return np.where(pages > 0, (pages - 1) * page_size + last_page_len, 0).astype(np.int32)


class PackedGraphs:
    def __init__(self, forward: DecoderForward, attention: FlashInferSteps, loop_tokens: torch.Tensor,
                 keys: list[GraphKey], max_row_pages: int, dummy_slot: int, device: torch.device):
        import flashinfer

        if forward.gdn is not None:
            raise ValueError("whole packed graphs hold full-attention layers only (a hybrid decoder runs eagerly)")
        self.forward, self.attention, self.loop_tokens, self.device = forward, attention, loop_tokens, device
        self.keys = sorted(set(keys), reverse=True)
        self.max_rows = max(rows for _, rows in self.keys)
        self.max_row_pages = max_row_pages
        if attention.workspace.numel() < graph_workspace_bytes(self.keys, *attention.heads, _num_sms(device)):
            raise ValueError("the float workspace is smaller than the graphs' split outputs: build FlashInferSteps "
                             "with workspace_bytes from graph_workspace_bytes")
        self.int_workspace = torch.zeros(INT_WORKSPACE_BYTES, dtype=torch.uint8, device=device)
        self.pinned_int_workspace = torch.zeros(INT_WORKSPACE_BYTES, dtype=torch.uint8, pin_memory=True)
        # Per batch size: qo indptr, kv indptr, last page lengths, page indices (`index_layout`).
        self.indices = {rows: torch.zeros(self.index_layout(rows)[-1], dtype=torch.int32, device=device)
                        for rows in {rows for _, rows in self.keys}}
        self.inputs: dict[GraphKey, torch.Tensor] = {}
        self.wrappers = {}
        for key in self.keys:
            tokens, rows = key
            qo, kv, last, pages, end = self.index_layout(rows)
            buffer = self.indices[rows]
            wrapper = flashinfer.BatchPrefillWithPagedKVCacheWrapper(
                attention.workspace, "NHD", use_cuda_graph=True, qo_indptr_buf=buffer[qo:qo + rows + 1],
                paged_kv_indptr_buf=buffer[kv:kv + rows + 1], paged_kv_indices_buf=buffer[pages:end],
                paged_kv_last_page_len_buf=buffer[last:last + rows], backend="fa2")
            # The shared int workspace (module docstring); FlashInfer 0.6.1's attributes, which its
            # own fast_decode_plan reads the same way.
            wrapper._int_workspace_buffer = self.int_workspace
            wrapper._pin_memory_int_workspace_buffer = self.pinned_int_workspace
            self.wrappers[key] = wrapper
        self._plan_info: dict[GraphKey, list[int]] = {}
        self.logits: Optional[torch.Tensor] = None
        self.greedy = torch.zeros(self.max_rows, dtype=torch.long, device=device)
        self.graphs: dict[GraphKey, torch.cuda.CUDAGraph] = {}
        self.measured_bytes = capture_measured(
            self.keys, lambda key, pool, stream: self._capture(key, dummy_slot, pool, stream), device)

    def index_layout(self, rows: int) -> tuple[int, int, int, int, int]:
        """Offsets in `indices[rows]` of the qo indptr, kv indptr, last page lengths, page indices,
        and its end; each starts on 16 bytes."""
        def align(n: int) -> int:
            return -(-n // 4) * 4

        kv = align(rows + 1)
        last = align(kv + rows + 1)
        pages = align(last + rows)
        return 0, kv, last, pages, pages + rows * self.max_row_pages

    def _capture_plan(self, key: GraphKey, dummy_page: int) -> None:
        """The key's first plan, through FlashInfer's `plan()`: its largest shape (one row of the
        bucket's tokens past the other rows' one each, every page the dummy), which freezes the
        wrapper's row count and token count and loads its kernels."""
        tokens, rows = key
        hq, hkv, d = self.attention.heads
        page_size = self.attention.page_size
        counts = np.ones(rows, dtype=np.int64)
        counts[0] = tokens - (rows - 1)
        pages = -(-counts // page_size)
        as_int32 = lambda a: torch.from_numpy(np.ascontiguousarray(a, dtype=np.int32))  # noqa: E731
        qo = np.concatenate([[0], np.cumsum(counts)])
        kv = np.concatenate([[0], np.cumsum(pages)])
        last = counts - (pages - 1) * page_size
        self.wrappers[key].plan(as_int32(qo), as_int32(kv), as_int32(np.full(int(kv[-1]), dummy_page)), as_int32(last),
                                hq, hkv, d, page_size, causal=True, sm_scale=self.attention.sm_scale,
                                q_data_type=torch.bfloat16, kv_data_type=torch.bfloat16)
        self._plan_info[key] = list(self.wrappers[key]._plan_info)

    def plan(self, key: GraphKey, qo_indptr: np.ndarray, kv_indptr: np.ndarray, kv_lens: np.ndarray) -> None:
        """Schedule a step's attention for the key's graph (module docstring): the host CSR arrays
        of B rows (padding rows zero-length); the device index arrays must be in `indices[B]` by
        the time the graph replays. Raises PlanMismatch when the schedule's layout is not the
        captured one."""
        tokens, rows = key
        wrapper = self.wrappers[key]
        hq, hkv, d = self.attention.heads
        info = wrapper._cached_module.plan(
            self.attention.workspace, self.int_workspace, self.pinned_int_workspace, torch.from_numpy(qo_indptr),
            torch.from_numpy(kv_indptr), torch.from_numpy(kv_lens), tokens, rows, hq, hkv, self.attention.page_size,
            True, d, d, True, -1, -1, False, 0)
        captured = self._plan_info[key]
        if any(a != b for i, (a, b) in enumerate(zip(info, captured)) if i != PLAN_INFO_TOTAL_ROWS):
            raise PlanMismatch(f"FlashInfer scheduled a step of {int(qo_indptr[-1])} tokens in {rows} rows as "
                               f"{list(info)}, its graph ({tokens} tokens) was captured with {captured}")

    def _body(self, key: GraphKey) -> None:
        tokens, rows = key
        ids, positions, slots, src, last_index, _ = self.inputs[key].split([tokens] * NUM_TOKEN_FIELDS + [rows] * 2)
        wrapper = self.wrappers[key]
        logits = self.forward(fed_ids(ids, src, self.loop_tokens), positions, slots, last_index,
                              lambda _layer, q, k_pages, v_pages: wrapper.run(q, (k_pages, v_pages)))
        if self.logits is None:  # the first warm-up, outside every graph (a TP rank's logits: the whole vocabulary)
            self.logits = torch.zeros(self.max_rows, logits.shape[1], dtype=torch.float32, device=self.device)
        self.logits[:rows].copy_(logits)
        self.forward.greedy(self.logits[:rows], out=self.greedy[:rows])

    def _capture(self, key: GraphKey, dummy_slot: int, pool, stream: torch.cuda.Stream) -> None:
        tokens, rows = key
        # Every token writes the dummy slot at position 0 and every row reads token 0.
        inputs = torch.zeros(NUM_TOKEN_FIELDS * tokens + 2 * rows, dtype=torch.int32, device=self.device)
        inputs[2 * tokens:3 * tokens] = dummy_slot
        inputs[3 * tokens:4 * tokens] = -1
        self.inputs[key] = inputs
        self._capture_plan(key, dummy_slot // self.attention.page_size)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.stream(stream), torch.no_grad():
            # One warm-up outside the graph: FlashInfer's first run of the wrapper, cuBLAS's handles
            # and algorithms for the shape, Triton's first launches.
            self._body(key)
            graph.capture_begin(pool=pool)  # not torch.cuda.graph(): it collects garbage at every capture
            try:
                self._body(key)
            finally:
                graph.capture_end()
        torch.cuda.current_stream(self.device).wait_stream(stream)
        # Uploaded now, while the shared int workspace still holds this key's plan (graphs.upload).
        graph.replay()
        self.graphs[key] = graph

    def key(self, num_rows: int, num_tokens: int, batch: int, bucket: int) -> Optional[GraphKey]:
        """The captured key a step of `num_rows` rows and `num_tokens` tokens replays when the plan
        gives it batch size `batch` and token bucket `bucket`, or None."""
        key = (bucket, batch)
        if key not in self.graphs or num_rows > batch or num_tokens > bucket:
            return None
        return key

    def replay(self, key: GraphKey) -> tuple[torch.Tensor, torch.Tensor]:
        """Run the step staged for `key` and planned (`plan`); returns (logits [B, vocab], argmax
        [B]), views of buffers every key writes (valid until the next replay)."""
        self.graphs[key].replay()
        assert self.logits is not None, "allocated by the first warm-up"
        rows = key[1]
        return self.logits[:rows], self.greedy[:rows]
