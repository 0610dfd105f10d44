"""CUDA graphs of a batched decode family: one graph per batch size, captured at start-up in one pool.

In: the step function (`DecoderForward`), the FlashInfer decode wrappers (`FlashInferSteps`), the
device token table (loop-back tokens), the family's batch sizes, the dummy cache slot.
Out: `DecodeGraphs`, whose `replay(batch)` runs a step whose inputs were copied into
`inputs[batch]` (the packing layout of `packing.py` at T = R = batch, the head of the bucket's
`FlashInferSteps.staged` buffer) and whose decode wrapper was planned; `logits[batch]` and
`greedy[batch]` then hold the step's outputs. `measured_bytes` is the growth of the device memory
torch reserved across the family's capture once the allocator's unused cached blocks are returned
(the graphs' pool, with each graph's logits, and the capture stream's cuBLAS workspace), the
figure the plan's compile-time estimate is checked against.

Sizes are captured largest first so smaller graphs reuse the pool's blocks. A hybrid decoder's
graphs also hold its gated delta-net layers: the rows' recurrent states gathered by the staged
row-slot field, the recurrent kernel, the states scattered back (`gdn_forward.py`); padding rows
carry slot 0, the sink.
"""
from __future__ import annotations

from typing import Any, Callable, Iterable, TypeVar

import torch

from mstar.runtime.engine.gpu import blas_edges
from mstar.runtime.engine.gpu.attention import NUM_FIELDS, FlashInferSteps
from mstar.runtime.engine.gpu.forward import DecoderForward
from mstar.runtime.engine.gpu.packing import pack


Key = TypeVar("Key", int, tuple[int, int, str])  # a decode batch or token bucket; a whole packed graph's key


def capture_measured(keys: Iterable[Key], capture: Callable[[Key, Any, torch.cuda.Stream], None],
                     device: torch.device) -> int:
    """`capture(key, pool, stream)` for every key, largest first (smaller keys reuse its blocks),
    in one pool from one side stream (cuBLAS keeps a workspace per stream, so a stream per key
    would hold one workspace each); returns the growth of the memory torch reserved across it,
    the allocator's unused cached blocks returned before (capture empties the cache first) and
    after (the warm-up runs' blocks, cached outside the pool, are not the graphs').
    Shared by the decode graphs, the piecewise graphs (`piecewise.py`) and the whole packed graphs
    (`packed_graphs.py`)."""
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    before = torch.cuda.memory_reserved(device)
    pool = torch.cuda.graph_pool_handle()
    stream = torch.cuda.Stream(device)
    for key in sorted(keys, reverse=True):
        capture(key, pool, stream)
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    return torch.cuda.memory_reserved(device) - before


def upload(graphs: Iterable[torch.cuda.CUDAGraph], device: torch.device) -> None:
    """Replay each captured graph once, on the inputs its capture left in place (the dummy step:
    padding rows on the dummy slot and the sink). A graph's first launch uploads it to the device:
    on the H200, 380-400 us of host time for a 240-kernel graph against 10-20 us once replayed (no
    profiler), paid mid-run whenever the batch first fell to a smaller bucket."""
    for graph in graphs:
        graph.replay()
    torch.cuda.synchronize(device)


class DecodeGraphs:
    def __init__(self, forward: DecoderForward, attention: FlashInferSteps, loop_tokens: torch.Tensor,
                 batch_sizes: list[int], dummy_slot: int, device: torch.device):
        self.forward, self.attention, self.loop_tokens = forward, attention, loop_tokens
        self.inputs: dict[int, torch.Tensor] = {}
        self.logits: dict[int, torch.Tensor] = {}
        self.greedy: dict[int, torch.Tensor] = {}
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.measured_bytes = capture_measured(
            batch_sizes, lambda batch, pool, stream: self._capture(batch, dummy_slot, pool, stream, device), device)
        upload(self.graphs.values(), device)

    def body(self, batch: int) -> tuple[torch.Tensor, torch.Tensor]:
        fields = self.inputs[batch].view(NUM_FIELDS, batch)
        ids, positions, slots, src, last_index, row_slot = (fields[i] for i in range(NUM_FIELDS))
        logits = self.forward(ids, positions, slots, last_index, self.attention.decode_attend(batch),
                              self.forward.decode_step(row_slot), fed=(src, self.loop_tokens))
        return logits, self.forward.greedy(logits)

    def _capture(self, batch: int, dummy_slot: int, pool: torch.cuda._POOL_HANDLE, stream: torch.cuda.Stream,
                 device: torch.device) -> None:
        dummy_page = dummy_slot // self.attention.page_size
        packed = pack([], self.attention.page_size, dummy_page, padded_rows=batch, padded_tokens=batch)
        self.inputs[batch] = self.attention.staged[batch][:NUM_FIELDS * batch]
        self.inputs[batch].copy_(torch.from_numpy(packed.host))
        self.attention.plan_decode(batch, packed)
        stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(stream), torch.no_grad():
            for _ in range(2):  # warm up: FlashInfer's first run and cuBLAS's handles outside the graph
                self.body(batch)
        torch.cuda.current_stream(device).wait_stream(stream)
        graph = blas_edges.new_graph()
        with torch.cuda.graph(graph, pool=pool, stream=stream), torch.no_grad():
            self.logits[batch], self.greedy[batch] = self.body(batch)
        blas_edges.finish(graph)
        self.graphs[batch] = graph

    def replay(self, batch: int) -> None:
        self.graphs[batch].replay()
