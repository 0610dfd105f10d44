"""Runs one step of a plain decoder on its device: stage, plan, replay or run, sample, copy back.

In: the step's `RowSpec`s and, when any row samples, per-row sampling arrays. Out: `launch` returns
a `Pending` step at once (the device may still be running it); `collect(pending)` waits for it and
returns the sampled token ids as a numpy array.

Per step the host does: pack the rows (`packing.pack`, numpy), FlashInfer's plan, one copy of the
packed int32 array into pinned memory and one non-blocking host-to-device copy (for a graph step
the array also carries the attention's index arrays: `FlashInferSteps.decode_host`), then either the
replay of the decode graph of the step's bucket (a decode-only step with at most the family's
largest batch, padded by the plan's `batch_pad` table) or an eager run (prefill and mixed steps).
Sampling, and writing each row's token into the device token table (the on-device loop-back the
next decode step reads), run on the device; the one device-to-host copy is the sampled ids,
non-blocking into pinned memory. Without FlashInfer (a CPU, for tests) attention is `torch_attend`.

The pinned staging buffer is reused by the next step, so a step must be collected before the next
launch (the engine's steps are; an overlapping caller needs a second buffer).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional

import numpy as np
import torch

from mstar.runtime.engine.gpu.forward import DecoderForward, PagedKv, torch_attend
from mstar.runtime.engine.gpu.packing import PackedStep, RowSpec, pack
from mstar.runtime.engine.gpu.sampler import sample

if TYPE_CHECKING:  # imported where used: FlashInfer is an optional dependency
    from mstar.runtime.engine.gpu.attention import FlashInferSteps
    from mstar.runtime.engine.gpu.graphs import DecodeGraphs


@dataclass
class SamplingRows:
    temperature: np.ndarray  # float32 [R], 0 = greedy
    top_p: np.ndarray  # float32 [R]
    seeds: np.ndarray  # int64 [R]
    counters: np.ndarray  # int64 [R]


@dataclass
class Pending:
    num_rows: int
    event: Optional[torch.cuda.Event]
    tokens: torch.Tensor  # host view of the sampled ids (valid once the event has passed)
    is_graph: bool


class StepExecutor:
    def __init__(self, forward: DecoderForward, kv: PagedKv, device: torch.device, max_rows: int,
                 decode_batch_pad: Optional[list[int]] = None, is_flashinfer: bool = False,
                 is_tensor_core: Optional[bool] = None):
        """decode_batch_pad: the decode family's lookup (`CaptureFamily.batch_pad`), None for no graphs."""
        self.forward, self.kv, self.device = forward, kv, device
        self.is_cuda = device.type == "cuda"
        self.loop_tokens = torch.zeros(max_rows, dtype=torch.long, device=device)
        self.batch_pad = decode_batch_pad or [0]
        self.attention: Optional[FlashInferSteps] = None
        self.graphs: Optional[DecodeGraphs] = None
        if is_flashinfer:
            from mstar.runtime.engine.gpu.attention import FlashInferSteps

            sizes = sorted({b for b in self.batch_pad if b})
            dims = forward.dims
            self.attention = FlashInferSteps(device, dims.num_qo_heads, dims.num_kv_heads, dims.head_dim,
                                             kv.page_size, kv.num_pages, sizes, is_tensor_core)
        self._staging = torch.empty(0, dtype=torch.int32)
        self._device_in = torch.empty(0, dtype=torch.int32, device=device)
        self._tokens_out = self._host(torch.empty(max_rows, dtype=torch.long))
        self.num_graph_steps = self.num_eager_steps = 0

    def _host(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor.pin_memory() if self.is_cuda else tensor

    def capture(self) -> int:
        """Capture the decode family's graphs (a GPU with FlashInfer); returns the measured bytes."""
        from mstar.runtime.engine.gpu.graphs import DecodeGraphs

        sizes = sorted({b for b in self.batch_pad if b})
        if self.attention is None:
            raise RuntimeError("decode graphs are captured over FlashInfer attention (is_flashinfer=True)")
        graphs = DecodeGraphs(self.forward, self.attention, self.loop_tokens, sizes, self.kv.dummy_slot, self.device)
        self.graphs = graphs
        return graphs.measured_bytes

    def bucket(self, rows: list[RowSpec]) -> int:
        """The captured batch a decode-only step pads to, or 0 (eager)."""
        if self.graphs is None or not rows or len(rows) >= len(self.batch_pad):
            return 0
        if any(row.num_tokens != 1 for row in rows):
            return 0
        return self.batch_pad[len(rows)]

    def _stage(self, host: np.ndarray, dest: Optional[torch.Tensor] = None) -> torch.Tensor:
        """One host-to-device copy of an int32 array (through pinned memory on a GPU)."""
        size = host.shape[0]
        if self._staging.shape[0] < size:
            self._staging = self._host(torch.empty(2 * size, dtype=torch.int32))
            self._device_in = torch.empty(2 * size, dtype=torch.int32, device=self.device)
        self._staging[:size].numpy()[:] = host
        if dest is None:
            dest = self._device_in[:size]
        dest.copy_(self._staging[:size], non_blocking=True)
        return dest

    def _run_eager(self, packed: PackedStep) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        data = self._stage(packed.host)
        ids, positions, slots, src, last_index, row_slot = data.split(packed.field_sizes())
        if self.attention is not None:
            attend = self.attention.plan_eager(packed)
        else:
            attend = torch_attend(packed.qo_indptr.tolist(), packed.kv_indptr.tolist(), packed.kv_indices,
                                  packed.last_page_len.tolist(), self.kv.page_size, self.forward.dims.head_dim ** -0.5)
        ids = torch.where(src >= 0, self.loop_tokens[src.clamp(min=0).long()], ids.long())
        logits = self.forward(ids, positions, slots, last_index, attend)
        return logits, logits.argmax(-1), row_slot

    def _run_graph(self, batch: int, packed: PackedStep) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        graphs, attention = self.graphs, self.attention
        assert graphs is not None and attention is not None, "bucket() picks a graph only once captured"
        attention.plan_decode(batch, packed)
        host = attention.decode_host(batch, packed)  # the graph's inputs and the attention's indices
        self._stage(host, attention.staged[batch][:host.shape[0]])
        graphs.replay(batch)
        return graphs.logits[batch], graphs.greedy[batch], graphs.inputs[batch][5 * batch:6 * batch]

    def launch(self, rows: list[RowSpec], sampling: Optional[SamplingRows] = None) -> Pending:
        batch = self.bucket(rows)
        packed = pack(rows, self.kv.page_size, self.kv.dummy_page, padded_rows=batch, padded_tokens=batch)
        with torch.no_grad():
            if batch:
                logits, greedy, row_slot = self._run_graph(batch, packed)
                self.num_graph_steps += 1
            else:
                logits, greedy, row_slot = self._run_eager(packed)
                self.num_eager_steps += 1
            num_rows = len(rows)
            tokens = greedy[:num_rows]
            if sampling is not None:
                tokens = sample(logits[:num_rows], *self._sampling_tensors(sampling))
            self.loop_tokens[row_slot[:num_rows].long()] = tokens
            out = self._tokens_out[:num_rows]
            out.copy_(tokens, non_blocking=True)
        event = None
        if self.is_cuda:
            event = torch.cuda.Event()
            event.record()
        return Pending(num_rows, event, out, bool(batch))

    def _sampling_tensors(self, sampling: SamplingRows) -> list[torch.Tensor]:
        arrays = (sampling.temperature, sampling.top_p, sampling.seeds, sampling.counters)
        return [torch.from_numpy(np.ascontiguousarray(a)).to(self.device, non_blocking=True) for a in arrays]

    def collect(self, pending: Pending) -> np.ndarray:
        if pending.event is not None:
            pending.event.synchronize()
        return pending.tokens.numpy().copy()
