"""CPU stand-ins for the executor's CUDA graphs and FlashInfer wrappers (gpu/graphs.py,
gpu/piecewise.py, gpu/attention.py), for tests of what a step writes into the buffers they read.

`install(executor)` gives a CPU `StepExecutor` (built with a decode `batch_pad` and packed
families) a decode-graph stand-in whose `replay(batch)` runs the step eagerly from exactly the
buffers the captured graph and FlashInfer's graph-mode decode wrapper read (the graph's input
fields, the wrapper's static indptr, last page lengths and page indices), after checking that the
host arrays `plan_decode` got equal those device buffers; a piecewise stand-in that runs a
bucket's step from its input buffer with the step's planned attention; and torch attention over a
step's CSR arrays for the eager plan. Graph capture itself, FlashInfer's kernels and its
planner are not stood in for: tests/gpu runs those.
"""
from __future__ import annotations

import torch

from mstar.runtime.engine.gpu.attention import NUM_FIELDS, FlashInferSteps
from mstar.runtime.engine.gpu.forward import torch_attend
from mstar.runtime.engine.gpu.packing import NUM_TOKEN_FIELDS, fed_ids, pack


class CpuAttention:
    layout = FlashInferSteps.layout
    decode_host = FlashInferSteps.decode_host

    def __init__(self, batch_sizes: list[int], max_row_pages: int, page_size: int, scale: float,
                 is_planned: bool = True):
        """is_planned: the decode graphs stand in for FlashInfer's wrappers (planned before each
        replay), or for the Triton decode kernel's (never planned: only the staged arrays)."""
        self.page_size, self.scale, self.max_row_pages = page_size, scale, max_row_pages
        self.staged = {b: torch.zeros(self.layout(b)[3], dtype=torch.int32) for b in batch_sizes}
        self.planned: dict[int, tuple[list[int], list[int]]] = {}
        self.is_planned = is_planned

    def plans_decode(self, batch: int) -> bool:
        return self.is_planned

    def plan_decode(self, batch: int, step) -> None:
        assert self.is_planned, "a decode graph on the Triton kernel is never planned"
        self.planned[batch] = (step.kv_indptr.tolist(), step.last_page_len.tolist())  # what plan() reads

    def plan_eager(self, step, num_decode: int = 0) -> "PlannedEager":
        return PlannedEager(torch_attend(step.qo_indptr.tolist(), step.kv_indptr.tolist(), step.kv_indices,
                                         step.last_page_len.tolist(), self.page_size, self.scale))


def decode_reference(q: torch.Tensor, k_pages: torch.Tensor, v_pages: torch.Tensor, kv_indptr: torch.Tensor,
                     kv_indices: torch.Tensor, last_page_len: torch.Tensor) -> torch.Tensor:
    """One query token a row over its pages, in fp32 (`torch_attend` with one-token rows, on q's
    device): the oracle of the Triton decode kernel's tests; a row of no pages gives zeros."""
    attend = torch_attend(list(range(q.shape[0] + 1)), kv_indptr.tolist(), kv_indices, last_page_len.tolist(),
                          k_pages.shape[1], q.shape[2] ** -0.5)
    return attend(0, q.float(), k_pages.float(), v_pages.float())


class PlannedEager:
    """As `EagerAttention`: `run(q, pages, out)` for the piecewise graphs, and an `Attend`."""

    def __init__(self, attend):
        self.attend = attend

    def run(self, q: torch.Tensor, pages: tuple[torch.Tensor, torch.Tensor], out: torch.Tensor) -> torch.Tensor:
        return out.copy_(self.attend(0, q, *pages))

    def __call__(self, layer: int, q: torch.Tensor, k_pages: torch.Tensor, v_pages: torch.Tensor) -> torch.Tensor:
        return self.attend(layer, q, k_pages, v_pages)


class CpuDecodeGraphs:
    def __init__(self, executor, attention: CpuAttention, batch_sizes: list[int]):
        self.executor, self.attention = executor, attention
        self.graphs = {b: None for b in batch_sizes}
        self.inputs, self.logits, self.greedy = {}, {}, {}
        dummy_page = executor.kv.dummy_page
        for b in batch_sizes:  # what capture leaves in the inputs: padding rows everywhere
            self.inputs[b] = attention.staged[b][:NUM_FIELDS * b]
            self.inputs[b].copy_(torch.from_numpy(pack([], attention.page_size, dummy_page, b, b).host))

    def replay(self, batch: int) -> None:
        ids, positions, slots, src, last_index, _ = self.inputs[batch].view(NUM_FIELDS, batch)
        indptr, last, indices, end = self.attention.layout(batch)
        staged = self.attention.staged[batch]
        kv_indptr, last_page_len = staged[indptr:indptr + batch + 1].tolist(), staged[last:last + batch].tolist()
        if self.attention.is_planned:
            assert self.attention.planned[batch] == (kv_indptr, last_page_len), "plan() read other offsets"
        attend = torch_attend(list(range(batch + 1)), kv_indptr, staged[indices:end], last_page_len,
                              self.attention.page_size, self.attention.scale)
        executor = self.executor
        logits = executor.forward(fed_ids(ids, src, executor.loop_tokens), positions, slots, last_index, attend)
        self.logits[batch], self.greedy[batch] = logits, logits.argmax(-1)


class CpuPiecewise:
    def __init__(self, executor, token_buckets: list[int], max_rows: int):
        self.executor, self.max_rows = executor, max_rows
        self.pieces = {t: None for t in token_buckets}
        self.inputs = {}
        for t in token_buckets:  # as capture leaves them: padding tokens on the dummy slot, no token source
            inputs = torch.zeros(NUM_TOKEN_FIELDS * t + 2 * max_rows, dtype=torch.int32)
            inputs[2 * t:3 * t] = executor.kv.dummy_slot
            inputs[3 * t:4 * t] = -1
            self.inputs[t] = inputs

    def row_fields_offset(self, bucket: int) -> int:
        return NUM_TOKEN_FIELDS * bucket

    def replay(self, bucket: int, num_tokens: int, attention, linear=None):
        assert linear is None, "the stand-in runs a plain decoder's steps"
        t, r = bucket, self.max_rows
        ids, positions, slots, src, last_index, _ = self.inputs[bucket].split([t] * 4 + [r] * 2)

        def attend(_layer, q, k_pages, v_pages):
            out = torch.zeros_like(q)  # padding tokens attend to nothing
            attention(q[:num_tokens], (k_pages, v_pages), out[:num_tokens])
            return out

        executor = self.executor
        logits = executor.forward(fed_ids(ids, src, executor.loop_tokens), positions, slots, last_index, attend)
        return logits, logits.argmax(-1)


def install(executor, is_planned: bool = True) -> None:
    """Stand-ins for the executor's decode graphs (its `batch_pad` sizes), piecewise graphs (its
    packed families' buckets) and FlashInfer, then the glue's views of their buffers. is_planned:
    False stands the decode graphs in for the Triton decode kernel's (no plan; `CpuAttention`)."""
    sizes = sorted({b for b in executor.batch_pad if b})
    attention = CpuAttention(sizes, executor.max_row_pages, executor.kv.page_size,
                             executor.forward.dims.head_dim ** -0.5, is_planned)
    executor.attention = attention
    executor.graphs = CpuDecodeGraphs(executor, attention, sizes)
    executor.piecewise = CpuPiecewise(executor, executor.packed.token_buckets, executor.packed.max_rows)
    executor._glue_views()
