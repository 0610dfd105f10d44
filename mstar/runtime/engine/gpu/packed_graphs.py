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

Where the split route's decode rows take the Triton decode kernel (`FlashInferSteps.graph_kernel`;
`prefill_attention` serves the same heads), a split key's attention runs on Triton kernels alone
(`SplitAttend`): the decode kernel writes the decode rows' outputs, the prefill kernel the prompt
rows' over the rest, from the same derived arrays; such a key has no FlashInfer wrapper and no
host plan (`needs_plan`). FlashInfer's graph-mode prefill merged its always-split KV with a kernel
of 29 us a layer on the H200 whatever the context (docs/engine.md, "The split route on Triton").
A packed key (one prefill call: a prompt-only step, or the packed route's decode rows as one-token
rows) runs on the Triton prefill kernel too (`PackedAttend`), where that kernel serves the heads and
the decode graphs take it: no wrapper, no host plan, no FlashInfer merge. Measured on the H200
against FlashInfer's graph-mode prefill, which `set_triton_packed(False)` keeps as a what-if
(docs/engine.md, "Whole packed keys on the Triton prefill kernel").

Memory: every key's graph is captured in one pool, largest first, so a smaller key reuses the
blocks a larger one freed; the logits of every key land in one buffer. `measured_bytes` is the
growth of the memory torch reserved across the capture (`graphs.capture_measured`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import numpy as np
import torch

from mstar.runtime.engine.gpu import blas_edges, prefill_attention
from mstar.runtime.engine.gpu.attention import FlashInferSteps, TritonDecode, decode_backend, plan_graph_decode
from mstar.runtime.engine.gpu.forward import Attend, DecoderForward
from mstar.runtime.engine.gpu.graphs import capture_measured
from mstar.runtime.engine.gpu.packing import NUM_TOKEN_FIELDS, padded

GraphKey = tuple[int, int, str]  # (token bucket T, batch size B, attention route: "packed" or "split")
INT_WORKSPACE_BYTES = 8 << 20  # FlashInfer's own size for a wrapper's int workspace
CTA_TILE_Q = 128  # the fa2 prefill tile height graph mode picks for a key with a long row (head dim < 256)
PLAN_INFO_TOTAL_ROWS = 1  # the one entry of FlashInfer's PrefillPlanInfo that may change between plans

_triton_packed = True


def set_triton_packed(enabled: bool) -> None:
    """Run the packed keys of graphs captured afterwards on the Triton prefill kernel where it serves
    the heads (`PackedAttend`, the default), or on FlashInfer's graph-mode prefill wrapper."""
    global _triton_packed
    _triton_packed = enabled


class PlanMismatch(RuntimeError):
    """FlashInfer scheduled a step in a layout other than the one its graph was captured with."""


def prefill_rows(key: GraphKey) -> int:
    """Rows of the key's prefill wrapper: B, and on the split route one more in front (the decode
    rows' tokens, whose output the decode wrapper's replaces)."""
    return key[1] + (key[2] == "split")


def graph_workspace_bytes(keys: list[GraphKey], num_qo_heads: int, num_kv_heads: int, head_dim: int,
                          num_sms: int) -> int:
    """Float workspace the graph-mode fa2 prefill planner needs for the largest key: it always
    splits the KV, keeping fp32 partial outputs and their log-sum-exps for `padded_tiles` tiles of
    CTA_TILE_Q rows, `max(2 x SMs / kv heads, ceil(T x group / CTA_TILE_Q) + B - 1)` tiles
    (shared/reference/flashinfer.md, "Sizing for FA2 prefill in graph mode"); a split key's decode
    wrapper needs far less."""
    group = num_qo_heads // num_kv_heads
    need = 0
    for key in keys:
        tiles = max(2 * num_sms // num_kv_heads, -(-key[0] * group // CTA_TILE_Q) + prefill_rows(key) - 1)
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


@dataclass
class SplitArrays:
    """A batch size's index arrays of the split route (device, fixed addresses): the decode
    wrapper's kv indptr and last page lengths, the prefill wrapper's qo and kv indptr and last page
    lengths, all derived on the device from the step's packed arrays and its number of decode rows
    (`PackedGraphs._derive`), which the host stages into `num_decode`."""

    num_decode: torch.Tensor  # int32 [1]
    dec_indptr: torch.Tensor  # [B + 1]
    dec_last: torch.Tensor  # [B]
    pre_qo: torch.Tensor  # [B + 2]
    pre_kv: torch.Tensor  # [B + 2]
    pre_last: torch.Tensor  # [B + 1]
    index: torch.Tensor  # int64 [B + 2]: 0, 1, ...

    @classmethod
    def zeros(cls, rows: int, device: torch.device) -> "SplitArrays":
        buffer = torch.zeros(1 + (rows + 1) + rows + 2 * (rows + 2) + rows + 1, dtype=torch.int32, device=device)
        num_decode, dec_indptr, dec_last, pre_qo, pre_kv, pre_last = buffer.split(
            [1, rows + 1, rows, rows + 2, rows + 2, rows + 1])
        return cls(num_decode, dec_indptr, dec_last, pre_qo, pre_kv, pre_last, torch.arange(rows + 2, device=device))


def split_host_arrays(qo: np.ndarray, kv: np.ndarray, last: np.ndarray, num_decode: int
                      ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """The split route's host arrays from a step's packed CSR arrays of B rows (decode rows first,
    padding rows zero-length): (decode kv indptr [B + 1], decode last page lengths [B], prefill qo
    indptr [B + 2], prefill kv indptr [B + 2], prefill last page lengths [B + 1]). The prefill
    wrapper's row 0 holds the decode rows' tokens over the last decode row's last page (an output
    nobody reads, with a KV length of at least one); its rows 1.. are the step's rows from the first
    prompt row on. `derive_split_arrays` computes the same on the device."""
    rows, d = last.shape[0], num_decode
    dec_indptr = padded(kv[:d + 1], rows + 1, int(kv[d]))
    dec_last = padded(last[:d], rows, 0)
    pre_qo = padded(np.concatenate([[0], qo[d:]]), rows + 2, int(qo[rows]))
    pre_kv = padded(np.concatenate([[kv[d] - 1], kv[d:]]), rows + 2, int(kv[rows]))
    pre_last = padded(np.concatenate([[last[d - 1]], last[d:]]), rows + 1, 0)
    return dec_indptr, dec_last, pre_qo, pre_kv, pre_last


def derive_split_arrays(qo: torch.Tensor, kv: torch.Tensor, last: torch.Tensor, arrays: SplitArrays) -> torch.Tensor:
    """The split route's wrapper arrays from a step's packed CSR arrays of B rows (qo, kv: [B + 1],
    last: [B]) and its decode-row count (`arrays.num_decode`), written into `arrays` with device
    ops only (capturable: no host reads); `split_host_arrays` computes the same on the host.
    Returns the mask of the decode rows' tokens among the first B, shaped to broadcast over heads."""
    rows = last.shape[0]
    d, j = arrays.num_decode.long(), arrays.index
    zero = torch.zeros((), dtype=torch.int32, device=qo.device)
    arrays.dec_indptr.copy_(kv[torch.minimum(j[:rows + 1], d)])
    arrays.dec_last.copy_(torch.where(j[:rows] < d, last, zero))
    source = torch.clamp(d + j - 1, min=0, max=rows)  # the packed row behind prefill row k >= 1
    first = j == 0
    arrays.pre_qo.copy_(torch.where(first, zero, qo[source]))
    arrays.pre_kv.copy_(torch.where(first, kv[d] - 1, kv[source]))
    source = source[:rows + 1]
    later = torch.where(source < rows, last[source.clamp(max=rows - 1)], zero)
    arrays.pre_last.copy_(torch.where(first[:rows + 1], last[d - 1], later))
    return (j[:rows] < d)[:, None, None]


class SplitAttend:
    """The split route's attention of a key on Triton kernels alone (where the decode rows take the
    Triton decode kernel, whose heads the prefill kernel serves too): the decode kernel writes the
    decode rows' outputs into the first `rows` rows of the step's output (its padding rows zeros),
    then the prefill kernel (`shape`: `prefill_attention.graph_shape` of the key) writes every
    prompt row's tokens (rows 1.. of the derived prefill arrays: they start where the decode rows
    end) over them. No host plan, no FlashInfer merge, no `torch.where` of two outputs."""

    def __init__(self, decode: Callable, shape: "prefill_attention.PrefillShape", rows: int, arrays: SplitArrays,
                 pages: torch.Tensor, partial: Optional[torch.Tensor]):
        self.decode, self.shape, self.rows, self.arrays, self.pages, self.partial = (decode, shape, rows, arrays,
                                                                                     pages, partial)

    def __call__(self, layer: int, q: torch.Tensor, k_pages: torch.Tensor, v_pages: torch.Tensor) -> torch.Tensor:
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        self.decode(layer, q[:self.rows], k_pages, v_pages, out=out[:self.rows])
        arrays = self.arrays
        prefill_attention.prefill_attention(self.shape, q, k_pages, v_pages, arrays.pre_qo, arrays.pre_kv,
                                            self.pages, arrays.pre_last, out, self.partial)
        return out


class PackedAttend:
    """A packed key's one prefill call on the Triton prefill kernel: every row of the step over its
    batch size's packed arrays (`PackedGraphs.indices[B]`), a decode row as a one-token row, padding
    rows zero-length. Tokens past the real ones are left unwritten, as the split route leaves them
    (their K/V went to the dummy slot and no row samples them)."""

    def __init__(self, shape: "prefill_attention.PrefillShape", qo_indptr: torch.Tensor, kv_indptr: torch.Tensor,
                 pages: torch.Tensor, last_page_len: torch.Tensor, partial: Optional[torch.Tensor]):
        self.shape, self.partial = shape, partial
        self.qo_indptr, self.kv_indptr, self.pages, self.last_page_len = qo_indptr, kv_indptr, pages, last_page_len

    def __call__(self, layer: int, q: torch.Tensor, k_pages: torch.Tensor, v_pages: torch.Tensor) -> torch.Tensor:
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        prefill_attention.prefill_attention(self.shape, q, k_pages, v_pages, self.qo_indptr, self.kv_indptr,
                                            self.pages, self.last_page_len, out, self.partial)
        return out


def first_plan_counts(tokens: int, rows: int, max_row_tokens: int) -> np.ndarray:
    """Query tokens per row of a key's first plan: the bucket's tokens with one row as long as a
    row may be (the rest one token each), and where a row is capped (`max_row_tokens`: the node's
    max_seq_len, below the bucket) the surplus in the next rows, as a step of several long
    prompts fills the bucket. A row's pages stay within the wrapper's page table."""
    counts = np.ones(rows, dtype=np.int64)
    surplus = tokens - rows
    for row in range(rows):
        extra = min(surplus, max_row_tokens - 1)
        counts[row] += extra
        surplus -= extra
    return counts


class PackedGraphs:
    def __init__(self, forward: DecoderForward, attention: FlashInferSteps, loop_tokens: torch.Tensor,
                 keys: list[GraphKey], max_row_pages: int, dummy_slot: int, device: torch.device):
        import flashinfer

        if forward.gdn is not None:
            raise ValueError("whole packed graphs hold full-attention layers only (a hybrid decoder runs eagerly)")
        self.forward, self.attention, self.loop_tokens, self.device = forward, attention, loop_tokens, device
        self.keys = sorted(set(keys), reverse=True)
        self.max_rows = max(key[1] for key in self.keys)
        self.max_row_pages = max_row_pages
        if attention.workspace.numel() < graph_workspace_bytes(self.keys, *attention.heads, _num_sms(device)):
            raise ValueError("the float workspace is smaller than the graphs' split outputs: build FlashInferSteps "
                             "with workspace_bytes from graph_workspace_bytes")
        self.int_workspace = torch.zeros(INT_WORKSPACE_BYTES, dtype=torch.uint8, device=device)
        self.pinned_int_workspace = torch.zeros(INT_WORKSPACE_BYTES, dtype=torch.uint8, pin_memory=True)
        batch_sizes = {key[1] for key in self.keys}
        # Per batch size: qo indptr, kv indptr, last page lengths, page indices (`index_layout`).
        self.indices = {rows: torch.zeros(self.index_layout(rows)[-1], dtype=torch.int32, device=device)
                        for rows in batch_sizes}
        self.split = {rows: SplitArrays.zeros(rows, device) for rows in {k[1] for k in self.keys if k[2] == "split"}}
        self.decode_wrappers: dict = {}  # the split route's FlashInfer decode wrappers, where it takes one
        self.decode_attend = {rows: self._decode_attend(rows) for rows in self.split}
        self._decode_planned: set[int] = set()
        self.inputs: dict[GraphKey, torch.Tensor] = {}
        self.triton_attend = self._triton_attends(device)
        self.wrappers = {}
        for key in self.keys:
            if key in self.triton_attend:
                continue
            rows = key[1]
            if key[2] == "split":
                arrays = self.split[rows]
                buffers = (arrays.pre_qo, arrays.pre_kv, arrays.pre_last)
            else:
                qo, kv, last, _, _ = self.index_layout(rows)
                buffer = self.indices[rows]
                buffers = (buffer[qo:qo + rows + 1], buffer[kv:kv + rows + 1], buffer[last:last + rows])
            wrapper = flashinfer.BatchPrefillWithPagedKVCacheWrapper(
                attention.workspace, "NHD", use_cuda_graph=True, qo_indptr_buf=buffers[0],
                paged_kv_indptr_buf=buffers[1], paged_kv_indices_buf=self._pages(rows),
                paged_kv_last_page_len_buf=buffers[2], backend="fa2")
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

    def _triton_attends(self, device: torch.device) -> dict[GraphKey, Callable]:
        """The keys whose attention runs on Triton kernels alone: split keys whose decode rows take
        the Triton decode kernel (`SplitAttend`; its heads are the prefill kernel's) and, unless
        `set_triton_packed(False)`, packed keys where the decode graphs take it too (`PackedAttend`). Their
        prefill splits share one scratch (graphs replay one at a time)."""
        heads, page_size, sm_count = self.attention.heads, self.attention.page_size, _num_sms(device)
        shapes = {}
        for key in self.keys:
            if key[2] == "split" and isinstance(self.decode_attend[key[1]], TritonDecode):
                shapes[key] = prefill_attention.graph_shape(*heads, page_size, prefill_rows(key), key[0], 1, sm_count)
            elif key[2] == "packed" and _triton_packed and self.attention.graph_kernel(key[1]) == "triton":
                shapes[key] = prefill_attention.graph_shape(*heads, page_size, key[1], key[0], 0, sm_count)
        numel = max([prefill_attention.partial_numel(shape) for shape in shapes.values()], default=0)
        partial = torch.empty(numel, dtype=torch.float32, device=device) if numel else None
        return {key: self._triton_attend(key, shape, partial) for key, shape in shapes.items()}

    def _triton_attend(self, key: GraphKey, shape: "prefill_attention.PrefillShape",
                       partial: Optional[torch.Tensor]) -> Callable:
        rows = key[1]
        if key[2] == "split":
            return SplitAttend(self.decode_attend[rows], shape, rows, self.split[rows], self._pages(rows), partial)
        qo, kv, last, _, _ = self.index_layout(rows)
        buffer = self.indices[rows]
        return PackedAttend(shape, buffer[qo:qo + rows + 1], buffer[kv:kv + rows + 1], self._pages(rows),
                            buffer[last:last + rows], partial)

    def needs_plan(self, key: GraphKey) -> bool:
        """Whether a step of `key` is planned on the host before its replay (`plan`): not where its
        attention runs on Triton kernels alone."""
        return key not in self.triton_attend

    def index_layout(self, rows: int) -> tuple[int, int, int, int, int]:
        """Offsets in `indices[rows]` of the qo indptr, kv indptr, last page lengths, page indices,
        and its end; each starts on 16 bytes."""
        def align(n: int) -> int:
            return -(-n // 4) * 4

        kv = align(rows + 1)
        last = align(kv + rows + 1)
        pages = align(last + rows)
        return 0, kv, last, pages, pages + rows * self.max_row_pages

    def _pages(self, rows: int) -> torch.Tensor:
        _, _, _, pages, end = self.index_layout(rows)
        return self.indices[rows][pages:end]

    def _decode_attend(self, rows: int) -> Attend:
        """The split route's decode attention of `rows` rows, the decode graphs' kernel choice
        (`FlashInferSteps.graph_kernel`): the Triton decode kernel over the derived arrays (no
        plan), or a FlashInfer decode wrapper on them with its own int workspace, shared by the keys
        of `rows` (planned before each replay, `_plan_decode`)."""
        import flashinfer

        arrays = self.split[rows]
        kernel = self.attention.graph_kernel(rows)
        if kernel == "triton":
            return TritonDecode(self.attention.heads, self.attention.page_size, rows, arrays.dec_indptr,
                                self._pages(rows), arrays.dec_last)
        is_tensor = kernel == "tensor"
        wrapper = self.decode_wrappers[rows] = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
            self.attention.workspace, "NHD", use_cuda_graph=True, use_tensor_cores=is_tensor,
            paged_kv_indptr_buffer=arrays.dec_indptr, paged_kv_indices_buffer=self._pages(rows),
            paged_kv_last_page_len_buffer=arrays.dec_last, **decode_backend(is_tensor))
        return lambda _layer, q, k_pages, v_pages: wrapper.run(q, (k_pages, v_pages))

    def _first_plan(self, key: GraphKey, dummy_page: int) -> None:
        """The key's first plan, through FlashInfer's `plan()`: its largest shape (`first_plan_counts`,
        every page the dummy), which freezes the wrapper's row count and token count and loads its
        kernels."""
        tokens, rows = key[0], prefill_rows(key)
        hq, hkv, d = self.attention.heads
        page_size = self.attention.page_size
        counts = first_plan_counts(tokens, rows, self.max_row_pages * page_size)
        pages = -(-counts // page_size)
        as_int32 = lambda a: torch.from_numpy(np.ascontiguousarray(a, dtype=np.int32))  # noqa: E731
        qo = np.concatenate([[0], np.cumsum(counts)])
        kv = np.concatenate([[0], np.cumsum(pages)])
        last = counts - (pages - 1) * page_size
        self.wrappers[key].plan(as_int32(qo), as_int32(kv), as_int32(np.full(int(kv[-1]), dummy_page)), as_int32(last),
                                hq, hkv, d, page_size, causal=True, sm_scale=self.attention.sm_scale,
                                q_data_type=torch.bfloat16, kv_data_type=torch.bfloat16)
        self._plan_info[key] = list(self.wrappers[key]._plan_info)

    def plan(self, key: GraphKey, qo_indptr: np.ndarray, kv_indptr: np.ndarray, last_page_len: np.ndarray,
             num_decode: int = 0) -> None:
        """Schedule a step's attention for the key's graph (module docstring) from the host CSR
        arrays of its B rows (padding rows zero-length; on the split route the decode rows first,
        `num_decode` of them). The device's arrays must be in `indices[B]` (and on the split
        route `split[B].num_decode`) by the time the graph replays. Raises PlanMismatch when the
        schedule's layout is not the captured one."""
        if not self.needs_plan(key):
            return
        page_size = self.attention.page_size
        if key[2] == "split":
            dec_indptr, dec_last, qo_indptr, kv_indptr, last_page_len = split_host_arrays(
                qo_indptr, kv_indptr, last_page_len, num_decode)
            self._plan_decode(key[1], dec_indptr, dec_last)
        self._plan_prefill(key, qo_indptr, kv_indptr, kv_lengths(kv_indptr, last_page_len, page_size))

    def _plan_prefill(self, key: GraphKey, qo_indptr: np.ndarray, kv_indptr: np.ndarray, kv_lens: np.ndarray) -> None:
        """The prefill wrapper's compiled planner, called directly (module docstring)."""
        wrapper = self.wrappers[key]
        hq, hkv, d = self.attention.heads
        info = wrapper._cached_module.plan(
            self.attention.workspace, self.int_workspace, self.pinned_int_workspace, torch.from_numpy(qo_indptr),
            torch.from_numpy(kv_indptr), torch.from_numpy(kv_lens), key[0], prefill_rows(key), hq, hkv,
            self.attention.page_size, True, d, d, True, -1, -1, False, 0)
        captured = self._plan_info[key]
        if any(a != b for i, (a, b) in enumerate(zip(info, captured)) if i != PLAN_INFO_TOTAL_ROWS):
            raise PlanMismatch(f"FlashInfer scheduled a step of {int(qo_indptr[-1])} tokens in {prefill_rows(key)} "
                               f"rows as {list(info)}, its graph ({key[0]} tokens) was captured with {captured}")

    def _plan_decode(self, rows: int, dec_indptr: np.ndarray, dec_last: np.ndarray) -> None:
        """The split route's decode wrapper (after its first plan the graph derives its arrays);
        nothing for the Triton kernel, which reads the derived arrays itself."""
        if rows not in self.decode_wrappers:
            return
        steps = self.attention
        plan_graph_decode(self.decode_wrappers[rows], rows not in self._decode_planned, torch.from_numpy(dec_indptr),
                          self._pages(rows), torch.from_numpy(dec_last), steps.heads, steps.page_size, steps.sm_scale)
        self._decode_planned.add(rows)

    def _derive(self, rows: int) -> torch.Tensor:
        """On the device, inside the graph: the split route's wrapper arrays of `rows` rows from the
        packed ones (`derive_split_arrays`); returns the mask of the decode rows' tokens among the
        first B."""
        qo_at, kv_at, last_at, _, _ = self.index_layout(rows)
        packed = self.indices[rows]
        return derive_split_arrays(packed[qo_at:qo_at + rows + 1], packed[kv_at:kv_at + rows + 1],
                                   packed[last_at:last_at + rows], self.split[rows])

    def _attend(self, key: GraphKey) -> Callable:
        if key in self.triton_attend:
            if key[2] == "split":
                self._derive(key[1])
            return self.triton_attend[key]
        prefill = self.wrappers[key]
        if key[2] != "split":
            return lambda _layer, q, k_pages, v_pages: prefill.run(q, (k_pages, v_pages))
        rows = key[1]
        decode = self.decode_attend[rows]
        is_decode = self._derive(rows)

        def split(layer: int, q: torch.Tensor, k_pages: torch.Tensor, v_pages: torch.Tensor) -> torch.Tensor:
            out = prefill.run(q, (k_pages, v_pages))
            decoded = decode(layer, q[:rows], k_pages, v_pages)
            out[:rows] = torch.where(is_decode, decoded, out[:rows])
            return out

        return split

    def _body(self, key: GraphKey) -> None:
        tokens, rows = key[0], key[1]
        ids, positions, slots, src, last_index, _ = self.inputs[key].split([tokens] * NUM_TOKEN_FIELDS + [rows] * 2)
        logits = self.forward(ids, positions, slots, last_index, self._attend(key), fed=(src, self.loop_tokens))
        if self.logits is None:  # the first warm-up, outside every graph (a TP rank's logits: the whole vocabulary)
            self.logits = torch.zeros(self.max_rows, logits.shape[1], dtype=logits.dtype, device=self.device)
        self.logits[:rows].copy_(logits)
        self.forward.greedy(self.logits[:rows], out=self.greedy[:rows])

    def _capture(self, key: GraphKey, dummy_slot: int, pool, stream: torch.cuda.Stream) -> None:
        tokens, rows = key[0], key[1]
        dummy_page = dummy_slot // self.attention.page_size
        # Every token writes the dummy slot at position 0 and every row reads token 0.
        inputs = torch.zeros(NUM_TOKEN_FIELDS * tokens + 2 * rows, dtype=torch.int32, device=self.device)
        inputs[2 * tokens:3 * tokens] = dummy_slot
        inputs[3 * tokens:4 * tokens] = -1
        self.inputs[key] = inputs
        if self.needs_plan(key):
            self._first_plan(key, dummy_page)
        if key[2] == "split":
            # The warm-up's step: B one-token rows on the dummy page, the first a decode row.
            ones = np.arange(rows + 1, dtype=np.int32)
            last = np.ones(rows, dtype=np.int32)
            qo_at, kv_at, last_at, pages_at, end = self.index_layout(rows)
            packed = self.indices[rows]
            packed[qo_at:qo_at + rows + 1].copy_(torch.from_numpy(ones))
            packed[kv_at:kv_at + rows + 1].copy_(torch.from_numpy(ones))
            packed[last_at:last_at + rows] = 1
            packed[pages_at:end] = dummy_page
            self.split[rows].num_decode.fill_(1)
            self.plan(key, ones, ones, last, 1)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        graph = blas_edges.new_graph()
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
        blas_edges.finish(graph)
        # Uploaded now, while the shared int workspace still holds this key's plan (graphs.upload).
        graph.replay()
        self.graphs[key] = graph

    def key(self, num_rows: int, num_tokens: int, batch: int, bucket: int, route: str) -> Optional[GraphKey]:
        """The captured key a step of `num_rows` rows and `num_tokens` tokens replays when the plan
        gives it batch size `batch`, token bucket `bucket` and attention route `route`, or None."""
        key = (bucket, batch, route)
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
