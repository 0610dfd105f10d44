"""Attention for the device step: FlashInfer's eager packed-prefill wrapper, and per captured decode
batch size either `decode_attention.py`'s Triton kernel (the default wherever it serves the heads:
`graph_decode_kernel`; it reads the index arrays on the device and needs no plan) or a graph-mode
FlashInfer decode wrapper, each bucket's index buffers at fixed addresses.

In: the node's heads, head dim, page size, the most pages one row can index
(`packing.max_row_pages`: a bucket of B rows indexes at most B times that), the decode family's
batch sizes. Out: `plan_eager(packed, num_decode) -> attend` for any step (the `packed` route: decode rows as
one-token segments beside prompt chunks, causal, bottom-right aligned, one prefill call; the
`split` route: the step's leading decode rows on an eager decode wrapper, the prompt rows on the
prefill wrapper), and `plan_decode(batch, packed)` which plans
the bucket's wrapper on the host before its graph replays (its `attend` is what the graph captured).

Each decode bucket owns one int32 device buffer, `staged[batch]`: the step's packed fields
(`packing.py`, the graph's inputs) followed by FlashInfer's index arrays (kv indptr, last page
lengths, page indices), which are the wrapper's static buffers. `decode_host(batch, packed)` lays a
step out the same way on the host, so one host-to-device copy feeds both the graph and the
attention kernel; `plan_decode` then runs the wrapper's compiled planner (the host scheduling
only: no buffer copies, no per-row Python loop: `replan_graph_decode`), which cost 0.4 ms a step at
64 rows as `plan()`.

Rules kept (shared/reference/flashinfer.md section 0): every plan() gets q/kv dtype bf16; decode
uses tensor cores (the prefill kernels) for grouped-query attention with backend fa2, except the
decode graphs of at most `CUDA_CORE_MAX_BATCH` rows, which take the CUDA-core decode kernel where
it is compiled for the node's group size (`CUDA_CORE_GROUP_SIZES`; Qwen3-Omni's thinker, 28 q heads
over 4 KV heads, is not: its plan() failed with "Unsupported group_size: 7"); plan() always runs
outside the graph. Measured on the H200 (Llama-3.2-1B heads: 32 q, 8 KV, head dim 64;
16 calls over 1024-token rows in one graph, per call): 1 row 9.8 us on tensor cores against 7.5 us
on CUDA cores, 2 rows 10.0 / 8.1, 4 rows 10.9 / 9.6, 8 rows 11.7 / 13.1, 16 rows 16.0 / 20.1, 64
rows 48.7 / 66.9 us (the same outputs within 3.5e-3).

Two prefill kernels: a prefill call whose rows all hold at least `FA3_MIN_ROW_TOKENS` query tokens
(a prefill-only step, or the split route's prompt rows) runs FlashInfer's fa3 backend, any other
(a packed step with one-token decode rows) fa2. Measured on the H200 (Llama-3.2-1B shape, 16 layers,
`.gpuwork`-style profile of one step's attention kernels): one 472-token chunk after 7680 cached
tokens 2.07 ms on fa2 against 1.80 ms on fa3; but 40 decode rows beside that chunk in one packed call
3.46 ms on fa2 against 5.11 ms on fa3, since fa3 gives every row a 128-query tile (192 at head dim
64) and does not pack the grouped heads of a one-token row into it.
"""
from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Optional, Union

import numpy as np
import torch

from mstar.runtime.engine.gpu import decode_attention
from mstar.runtime.engine.gpu.forward import Attend
from mstar.runtime.engine.gpu.packing import NUM_ROW_FIELDS, NUM_TOKEN_FIELDS, PackedStep

if TYPE_CHECKING:
    from mstar.runtime.engine.gpu.glue_packing import GlueStep

NUM_FIELDS = NUM_TOKEN_FIELDS + NUM_ROW_FIELDS
# What a plan reads: the CSR arrays on the host and the page indices (host or device) of either packer.
Indices = Union[PackedStep, "GlueStep"]

CUDA_CORE_MAX_BATCH = 4  # decode graphs of at most this many rows: the CUDA-core kernel (module docstring)
# Query heads per KV head FlashInfer's CUDA-core decode kernel is compiled for (its
# DISPATCH_GQA_GROUP_SIZE); any other ratio takes the tensor-core (prefill) kernels.
CUDA_CORE_GROUP_SIZES = (1, 2, 3, 4, 8)
WORKSPACE_BYTES = 256 << 20  # split-KV partial outputs (the prefill planner's need grows with tokens)
FA3_MIN_ROW_TOKENS = 64  # a prefill call whose every row holds this many query tokens runs on fa3


class FlashInferSteps:
    def __init__(self, device: torch.device, num_qo_heads: int, num_kv_heads: int, head_dim: int,
                 page_size: int, max_row_pages: int, decode_batch_sizes: list[int],
                 decode_kernel: str = "auto", workspace_bytes: int = WORKSPACE_BYTES):
        """decode_kernel: the decode graphs' attention (one of DECODE_KERNELS, `graph_decode_kernel`):
        auto takes the Triton kernel where it serves the heads, else FlashInfer's rule (flashinfer:
        tensor cores for grouped-query ratios >= 4, the CUDA-core kernel for graphs of at most
        CUDA_CORE_MAX_BATCH rows); tensor or cuda force that FlashInfer kernel everywhere.
        workspace_bytes: the float workspace every wrapper of the node shares (more than
        WORKSPACE_BYTES where whole packed graphs need it: `packed_graphs.workspace_bytes_for`)."""
        import flashinfer

        if decode_kernel not in DECODE_KERNELS:
            raise ValueError(f"decode kernel {decode_kernel!r}: one of {', '.join(DECODE_KERNELS)}")
        is_tensor_core = _forced_tensor_cores(decode_kernel)
        self.decode_kernel = decode_kernel
        self.heads = (num_qo_heads, num_kv_heads, head_dim)
        self.page_size = page_size
        self.sm_scale = head_dim ** -0.5
        self.workspace = torch.zeros(workspace_bytes, dtype=torch.uint8, device=device)
        self.eager = flashinfer.BatchPrefillWithPagedKVCacheWrapper(self.workspace, "NHD", backend="fa2")
        # Prompt-only calls (module docstring); the two share the float workspace and run one after the other.
        self.prompts = flashinfer.BatchPrefillWithPagedKVCacheWrapper(self.workspace, "NHD", backend="fa3")
        refusal = cuda_core_refusal(num_qo_heads, num_kv_heads)
        if is_tensor_core is False and refusal:
            raise ValueError(refusal)
        self.is_tensor_core = num_qo_heads // num_kv_heads >= 4 if is_tensor_core is None else is_tensor_core
        self._forced = is_tensor_core
        # The `split` route's decode rows in an eager or piecewise step (planned per step, no graph).
        self.eager_decode = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
            self.workspace, "NHD", use_tensor_cores=self.is_tensor_core, **decode_backend(self.is_tensor_core))
        self.max_row_pages = max_row_pages
        self.staged: dict[int, torch.Tensor] = {}
        self.decode = {}
        self.triton: dict[int, TritonDecode] = {}  # graphs whose attention is decode_attention.py's kernel
        for batch in decode_batch_sizes:
            indptr, last, indices, end = self.layout(batch)
            staged = self.staged[batch] = torch.zeros(end, dtype=torch.int32, device=device)
            if self.graph_kernel(batch) == "triton":
                self.triton[batch] = TritonDecode(self.heads, page_size, batch, staged[indptr:indptr + batch + 1],
                                                  staged[indices:end], staged[last:last + batch])
                continue
            is_tensor = self.is_tensor_decode(batch)
            self.decode[batch] = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
                self.workspace, "NHD", use_cuda_graph=True, use_tensor_cores=is_tensor,
                paged_kv_indptr_buffer=staged[indptr:indptr + batch + 1],
                paged_kv_indices_buffer=staged[indices:end], paged_kv_last_page_len_buffer=staged[last:last + batch],
                **decode_backend(is_tensor))
        self._is_planned: set[int] = set()

    def is_tensor_decode(self, batch: int) -> bool:
        """Whether a graph-mode FlashInfer decode wrapper of `batch` rows takes tensor cores: as the
        caller forced, else the rule of the module docstring (CUDA cores up to CUDA_CORE_MAX_BATCH
        rows where the kernel exists for the group size)."""
        return decode_takes_tensor_cores(self.heads[0], self.heads[1], batch, self._forced)

    def graph_kernel(self, batch: int) -> str:
        """The attention kernel of the decode graph of `batch` rows: triton, tensor or cuda."""
        return graph_decode_kernel(*self.heads, batch, self.decode_kernel)

    def warm_up(self, pages: tuple[torch.Tensor, torch.Tensor], dummy_page: int) -> None:
        """Plan and run each eager wrapper once on the dummy page, so their kernel modules load (or
        compile, on a machine without FlashInfer's cache) at start-up rather than inside the first
        step that needs one: a module loaded mid-run stalled every row of that step by about 30 ms."""
        hq, hkv, d = self.heads
        device = pages[0].device
        dtypes = dict(q_data_type=torch.bfloat16, kv_data_type=torch.bfloat16)
        num_pages = -(-FA3_MIN_ROW_TOKENS // self.page_size)
        as_int32 = lambda values: torch.tensor(values, dtype=torch.int32)  # noqa: E731
        last = as_int32([FA3_MIN_ROW_TOKENS - (num_pages - 1) * self.page_size])
        indices = as_int32([dummy_page] * num_pages)  # one page read several times: a valid table
        for wrapper in (self.eager, self.prompts):
            wrapper.plan(as_int32([0, FA3_MIN_ROW_TOKENS]), as_int32([0, num_pages]), indices, last, hq, hkv, d,
                         self.page_size, causal=True, sm_scale=self.sm_scale, **dtypes)
            wrapper.run(torch.zeros(FA3_MIN_ROW_TOKENS, hq, d, dtype=torch.bfloat16, device=device), pages)
        self.eager_decode.plan(as_int32([0, 1]), as_int32([dummy_page]), as_int32([1]), hq, hkv, d, self.page_size,
                               sm_scale=self.sm_scale, **dtypes)
        self.eager_decode.run(torch.zeros(1, hq, d, dtype=torch.bfloat16, device=device), pages)

    def layout(self, batch: int) -> tuple[int, int, int, int]:
        """Offsets in `staged[batch]` of the kv indptr, the last page lengths, the page indices, and
        its end; each starts on 16 bytes. The page indices hold `batch` rows of `max_row_pages`."""
        def align(n: int) -> int:
            return -(-n // 4) * 4

        indptr = align(NUM_FIELDS * batch)
        last = align(indptr + batch + 1)
        indices = align(last + batch)
        return indptr, last, indices, indices + batch * self.max_row_pages

    def decode_host(self, batch: int, packed: PackedStep) -> np.ndarray:
        """The step's host array in `staged[batch]`'s layout, up to its last page index."""
        indptr, last, indices, _ = self.layout(batch)
        num_indices = packed.kv_indices.shape[0]
        host = np.zeros(indices + num_indices, dtype=np.int32)
        host[:packed.host.shape[0]] = packed.host
        host[indptr:indptr + batch + 1] = packed.kv_indptr.numpy()
        host[last:last + batch] = packed.last_page_len.numpy()
        host[indices:] = packed.kv_indices.numpy()
        return host

    def plan_eager(self, packed: Indices, num_decode: int = 0) -> "EagerAttention":
        """Plan an eager step. num_decode: the plan's `split` route with the step's first
        `num_decode` rows (one token each) on the decode kernel and the rest on the prefill kernel;
        0: every row on the prefill kernel (the `packed` route, or a step of one kind of row)."""
        hq, hkv, d = self.heads
        dtypes = dict(q_data_type=torch.bfloat16, kv_data_type=torch.bfloat16)
        qo, kv, indices, last = packed.qo_indptr, packed.kv_indptr, packed.kv_indices, packed.last_page_len
        if num_decode:
            first_page = int(kv[num_decode])
            self.eager_decode.plan(kv[:num_decode + 1], indices[:first_page], last[:num_decode], hq, hkv, d,
                                   self.page_size, sm_scale=self.sm_scale, **dtypes)
            qo, kv = qo[num_decode:] - qo[num_decode], kv[num_decode:] - first_page
            indices, last = indices[first_page:], last[num_decode:]
        prefill = self.prompts if int((qo[1:] - qo[:-1]).min()) >= FA3_MIN_ROW_TOKENS else self.eager
        prefill.plan(qo, kv, indices, last, hq, hkv, d, self.page_size, causal=True, sm_scale=self.sm_scale,
                     **dtypes)
        return EagerAttention(self, num_decode, prefill)

    def plans_decode(self, batch: int) -> bool:
        """Whether the decode graph of `batch` rows is planned on the host before its replay
        (FlashInfer's wrapper; the Triton kernel is not)."""
        return batch not in self.triton

    def plan_decode(self, batch: int, packed: Indices) -> None:
        """Plan the bucket's wrapper for this step; after the first (full) plan, the index arrays
        must reach `staged[batch]` by the step's own copy (`decode_host`). A graph on the Triton
        kernel needs no plan (`plans_decode`): the kernel reads those arrays on the device."""
        if not self.plans_decode(batch):
            return
        plan_graph_decode(self.decode[batch], batch not in self._is_planned, packed.kv_indptr, packed.kv_indices,
                          packed.last_page_len, self.heads, self.page_size, self.sm_scale,
                          packed.seq_lens)
        self._is_planned.add(batch)

    def decode_attend(self, batch: int) -> Attend:
        if batch in self.triton:
            return self.triton[batch]
        wrapper = self.decode[batch]
        return lambda _layer, q, k_pages, v_pages: wrapper.run(q, (k_pages, v_pages))


def plan_graph_decode(wrapper, is_first: bool, kv_indptr: torch.Tensor, kv_indices: torch.Tensor,
                      last_page_len: torch.Tensor, heads: tuple[int, int, int], page_size: int,
                      sm_scale: float, seq_lens: Optional[torch.Tensor] = None) -> None:
    """Plan a graph-mode decode wrapper from the host's kv indptr and last page lengths: `plan()`
    the first time (it freezes the row count and copies the index arrays into the wrapper's
    buffers), `replan_graph_decode` after (the host scheduling only; the index arrays reach the
    buffers another way). seq_lens: the rows' KV lengths where the caller has them (int32, host)."""
    hq, hkv, d = heads
    if is_first:
        wrapper.plan(kv_indptr, kv_indices, last_page_len, hq, hkv, d, page_size, sm_scale=sm_scale,
                     q_data_type=torch.bfloat16, kv_data_type=torch.bfloat16)
    else:
        replan_graph_decode(wrapper, kv_indptr, kv_indices, last_page_len, heads, page_size, seq_lens)


# The FlashInfer release whose decode planner `replan_graph_decode` calls directly (pyproject's gpu extra).
LEAN_PLAN_VERSION = "0.6.1"


def replan_graph_decode(wrapper, kv_indptr: torch.Tensor, kv_indices: torch.Tensor, last_page_len: torch.Tensor,
                        heads: tuple[int, int, int], page_size: int, seq_lens: Optional[torch.Tensor] = None) -> None:
    """A planned graph-mode decode wrapper's next plan: its compiled planner called with the
    arguments FlashInfer 0.6.1's `fast_decode_plan` passes it, and no more. That function builds two
    empty device tensors, enters a device context and derives the KV lengths with four torch ops on
    every call: a 16-row step's plan took 112 us on an H200's host that way, 22 us this way (a cached
    request's first step, which waits for it before its replay); one row 45 against 19 us. The
    dtypes, scale and window stay as the first `plan()` set them. Another FlashInfer release takes
    `fast_decode_plan` itself."""
    hq, hkv, d = heads
    if not _is_lean_plan_version() or (wrapper.use_tensor_cores and wrapper._backend != "fa2"):
        from flashinfer.decode import fast_decode_plan

        fast_decode_plan(wrapper, kv_indptr, kv_indices, last_page_len, hq, hkv, d, page_size,
                         q_data_type=torch.bfloat16, kv_data_type=torch.bfloat16, sm_scale=wrapper._sm_scale)
        return
    batch = last_page_len.shape[0]
    buffers = (wrapper._float_workspace_buffer, wrapper._int_workspace_buffer, wrapper._pin_memory_int_workspace_buffer)
    if wrapper.use_tensor_cores:
        if seq_lens is None:
            from flashinfer.page import get_seq_lens

            seq_lens = get_seq_lens(kv_indptr, last_page_len, page_size)
        # qo indptr (one query a row), kv indptr, KV lengths, rows, rows, heads, page size, graph mode,
        # head dims, not causal, no window, no fixed split (-1), split KV allowed, no co-located CTAs.
        wrapper._plan_info = wrapper._cached_module.plan(
            *buffers, _row_offsets(batch), kv_indptr, seq_lens, batch, batch, hq, hkv, page_size, True, d, d,
            False, -1, -1, False, 0)
    else:
        bf16 = _empty_bf16(wrapper.device)
        # kv indptr, rows, heads, page size, graph mode, no window, no soft cap, head dims, q and KV dtypes.
        wrapper._plan_info = wrapper._cached_module.plan(
            *buffers, kv_indptr, batch, hq, hkv, page_size, True, -1, 0.0, d, d, bf16, bf16)


@functools.lru_cache(maxsize=None)
def _is_lean_plan_version() -> bool:
    import flashinfer

    return flashinfer.__version__ == LEAN_PLAN_VERSION


@functools.lru_cache(maxsize=None)
def _row_offsets(batch: int) -> torch.Tensor:
    """0..batch on the host: the qo indptr of `batch` one-token rows."""
    return torch.arange(batch + 1, dtype=torch.int32)


@functools.lru_cache(maxsize=None)
def _empty_bf16(device: torch.device) -> torch.Tensor:
    """An empty bf16 tensor on the device: how the CUDA-core planner is told the q and KV dtypes."""
    return torch.empty(0, dtype=torch.bfloat16, device=device)


DECODE_KERNELS = ("auto", "flashinfer", "tensor", "cuda")


def graph_decode_kernel(num_qo_heads: int, num_kv_heads: int, head_dim: int, batch: int,
                        choice: str = "auto") -> str:
    """The attention kernel of a decode graph of `batch` rows, for the caller's `choice` (one of
    DECODE_KERNELS): "triton" (`decode_attention.py`, where it serves the heads),
    or FlashInfer's "tensor" or "cuda" kernel (`decode_takes_tensor_cores`)."""
    if choice == "auto" and decode_attention.supports(num_qo_heads, num_kv_heads, head_dim):
        return "triton"
    forced = _forced_tensor_cores(choice)
    return "tensor" if decode_takes_tensor_cores(num_qo_heads, num_kv_heads, batch, forced) else "cuda"


def _forced_tensor_cores(choice: str) -> Optional[bool]:
    """FlashInfer's decode kernel a DECODE_KERNELS choice forces: tensor cores, CUDA cores, or none."""
    return {"tensor": True, "cuda": False}.get(choice)


class TritonDecode:
    """A graph's decode attention on `decode_attention.py`'s kernel: its shape (splits for this
    many rows on this device), the graph's index arrays (device views at fixed addresses: a decode
    graph's `staged` buffer, or the split route's derived arrays in a whole packed graph) and the
    split scratch and counters, allocated once so the graph's replays reuse them."""

    def __init__(self, heads: tuple[int, int, int], page_size: int, batch: int, kv_indptr: torch.Tensor,
                 kv_indices: torch.Tensor, last_page_len: torch.Tensor, sm_count: Optional[int] = None):
        device = kv_indptr.device
        sm_count = sm_count or torch.cuda.get_device_properties(device).multi_processor_count
        self.shape = decode_attention.graph_shape(*heads, page_size, batch, sm_count)
        self.kv_indptr, self.kv_indices, self.last_page_len = kv_indptr, kv_indices, last_page_len
        self.partial = torch.empty(decode_attention.partial_numel(self.shape, batch), dtype=torch.float32,
                                   device=device)
        # the splits' arrival counters, which the kernel leaves at zero for the next layer and replay
        self.counts = torch.zeros(batch * self.shape.num_kv_heads, dtype=torch.int32, device=device)

    def __call__(self, _layer: int, q: torch.Tensor, k_pages: torch.Tensor, v_pages: torch.Tensor,
                 out: Optional[torch.Tensor] = None) -> torch.Tensor:
        return decode_attention.decode_attention(self.shape, q, k_pages, v_pages, self.kv_indptr, self.kv_indices,
                                                 self.last_page_len, self.partial, out, self.counts)


def decode_takes_tensor_cores(num_qo_heads: int, num_kv_heads: int, batch: int, forced: Optional[bool] = None) -> bool:
    """The decode kernel of a graph of `batch` rows (module docstring): `forced` when given, else
    tensor cores for grouped-query ratios >= 4 except at most CUDA_CORE_MAX_BATCH rows, and always
    where the CUDA-core kernel lacks the group size."""
    if forced is not None:
        return forced
    if cuda_core_refusal(num_qo_heads, num_kv_heads):
        return True
    return num_qo_heads // num_kv_heads >= 4 and batch > CUDA_CORE_MAX_BATCH


def cuda_core_refusal(num_qo_heads: int, num_kv_heads: int) -> Optional[str]:
    """Why the CUDA-core decode kernel cannot serve these heads, None when it can."""
    group = num_qo_heads // num_kv_heads
    if group in CUDA_CORE_GROUP_SIZES:
        return None
    return (f"FlashInfer's CUDA-core decode kernel has no variant for {num_qo_heads} query heads over "
            f"{num_kv_heads} KV heads (group size {group}; compiled: {', '.join(map(str, CUDA_CORE_GROUP_SIZES))})")


def decode_backend(is_tensor_core: bool) -> dict[str, str]:
    """The decode wrapper's backend argument: fa2 for tensor cores (its `auto` is slow on the
    H200, shared/reference/flashinfer.md), none for the CUDA-core kernel."""
    return {"backend": "fa2"} if is_tensor_core else {}


class EagerAttention:
    """A planned eager step's attention (`FlashInferSteps.plan_eager`): `run(q, pages, out)` writes
    every token's output (the split route: the first `num_decode` tokens, one a row, by the decode
    kernel and the rest by the prefill kernel; the two share the workspace but run one after the
    other); as an `Attend` it returns a new output. `prefill`: the wrapper planned for the prefill
    call (fa2 or fa3, `FlashInferSteps.plan_eager`)."""

    def __init__(self, steps: FlashInferSteps, num_decode: int, prefill):
        self.steps, self.num_decode, self.prefill = steps, num_decode, prefill

    def run(self, q: torch.Tensor, pages: tuple[torch.Tensor, torch.Tensor], out: torch.Tensor) -> torch.Tensor:
        d = self.num_decode  # a split step always has prompt rows after its decode rows
        if d:
            self.steps.eager_decode.run(q[:d], pages, out=out[:d])
        self.prefill.run(q[d:], pages, out=out[d:])
        return out

    def __call__(self, _layer: int, q: torch.Tensor, k_pages: torch.Tensor, v_pages: torch.Tensor) -> torch.Tensor:
        return self.run(q, (k_pages, v_pages), torch.empty_like(q))
