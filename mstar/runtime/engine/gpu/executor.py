"""Runs one step of a plain decoder on its device: stage, plan, replay or run, sample, copy back.

In: the step's `RowSpec`s and, when any row samples, per-row sampling arrays. Out: `launch` returns
a `Pending` step at once (the device may still be running it); `collect(pending)` waits for it and
returns the sampled token ids as a numpy array.

Per step the host does: pack the rows (`packing.pack`, numpy), FlashInfer's plan, one copy of the
packed int32 array into pinned memory and one non-blocking host-to-device copy (for a graph step
the array also carries the attention's index arrays: `FlashInferSteps.decode_host`), then either the
replay of the decode graph of the step's bucket (a decode-only step with at most the family's
largest batch, padded by the plan's `batch_pad` table), the piecewise graphs of a packed family
(`piecewise.py`: a prefill or mixed step the plan gives one of the family's token buckets, padded
to it, attention eager between the pieces), or an eager run.
Sampling, and writing each row's token into the device token table (the on-device loop-back the
next decode step reads), run on the device; the one device-to-host copy is the sampled ids,
non-blocking into pinned memory. Without FlashInfer (a CPU, for tests) attention is `torch_attend`.

Steps may overlap: the host may launch step N+1 (even pack and plan it) before step N is
collected, so the run loop's host work hides behind the device's. What makes that safe:
- the pinned staging buffers are a ring of `NUM_STAGING`, each reused only after the copy that
  read it last has passed (its event);
- FlashInfer's plan writes a pinned buffer of its own and copies it to the device asynchronously:
  a step's plan waits for the previous step's copies to pass (`_inputs_copied`, in the steady
  state already past: the previous step is running);
- each launched step copies its sampled ids into a pinned buffer of its own, returned at collect;
- device buffers (graph inputs, the token table, logits) are read and written in stream order.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional

import numpy as np
import torch

from mstar.runtime.engine.gpu.forward import Attend, DecoderForward, PagedKv, torch_attend
from mstar.runtime.engine.gpu.packing import PackedStep, RowSpec, fed_ids, pack
from mstar.runtime.engine.gpu.sampler import sample

NUM_STAGING = 4  # pinned input buffers in the ring: a step and the ones launched ahead of it

if TYPE_CHECKING:  # imported where used: FlashInfer is an optional dependency
    from mstar.runtime.engine.gpu.attention import FlashInferSteps
    from mstar.runtime.engine.gpu.graphs import DecodeGraphs
    from mstar.runtime.engine.gpu.piecewise import PiecewiseGraphs


@dataclass
class SamplingRows:
    temperature: np.ndarray  # float32 [R], 0 = greedy
    top_p: np.ndarray  # float32 [R]
    seeds: np.ndarray  # int64 [R]
    counters: np.ndarray  # int64 [R]

    def take(self, order: list[int]) -> "SamplingRows":
        return SamplingRows(self.temperature[order], self.top_p[order], self.seeds[order], self.counters[order])


@dataclass(frozen=True)
class PackedFamilies:
    """The node's packed capture families (`CaptureFamily.kind == "packed"`), captured piecewise."""

    names: frozenset[str]
    token_buckets: list[int]  # the union of the families' buckets
    max_rows: int  # the largest batch size among them: the graphs' row entries


@dataclass
class Pending:
    num_rows: int
    event: Optional[torch.cuda.Event]
    tokens: torch.Tensor  # host view of the sampled ids (valid once the event has passed)
    is_graph: bool
    buffer: torch.Tensor  # the pinned buffer `tokens` views, reused once collected
    order: Optional[list[int]] = None  # the launch order of the caller's rows (the split route), None: theirs


class StepExecutor:
    def __init__(self, forward: DecoderForward, kv: PagedKv, device: torch.device, max_rows: int,
                 decode_batch_pad: Optional[list[int]] = None, is_flashinfer: bool = False,
                 is_tensor_core: Optional[bool] = None, packed: Optional[PackedFamilies] = None):
        """decode_batch_pad: the decode family's lookup (`CaptureFamily.batch_pad`), None for no graphs.
        packed: the node's packed capture families, captured piecewise (`piecewise.py`)."""
        self.forward, self.kv, self.device = forward, kv, device
        self.is_cuda = device.type == "cuda"
        self.loop_tokens = torch.zeros(max_rows, dtype=torch.long, device=device)
        self.batch_pad = decode_batch_pad or [0]
        self.attention: Optional[FlashInferSteps] = None
        self.graphs: Optional[DecodeGraphs] = None
        self.packed = packed if packed is not None and packed.token_buckets else None
        self.piecewise: Optional[PiecewiseGraphs] = None
        self.capture_bytes: dict[str, int] = {}  # measured growth per graph kind ("decode", "packed")
        if is_flashinfer:
            from mstar.runtime.engine.gpu.attention import FlashInferSteps

            sizes = sorted({b for b in self.batch_pad if b})
            dims = forward.dims
            self.attention = FlashInferSteps(device, dims.num_qo_heads, dims.num_kv_heads, dims.head_dim,
                                             kv.page_size, kv.num_pages, sizes, is_tensor_core)
            self.attention.warm_up(kv.pages(0), kv.dummy_page)
        self.max_rows = max_rows
        self._staging = [torch.empty(0, dtype=torch.int32) for _ in range(NUM_STAGING)]
        self._staged_event: list[Optional[torch.cuda.Event]] = [None] * NUM_STAGING
        self._next_staging = 0
        self._device_in = torch.empty(0, dtype=torch.int32, device=device)
        self._free_out: list[torch.Tensor] = []  # pinned sampled-id buffers of collected steps
        self._inputs_copied: Optional[torch.cuda.Event] = None  # the last step's plan and input copies
        self.num_graph_steps = self.num_eager_steps = self.num_piecewise_steps = 0

    def _host(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor.pin_memory() if self.is_cuda else tensor

    def capture(self) -> int:
        """Capture the decode family's graphs and the packed families' piecewise graphs (a GPU with
        FlashInfer); returns the bytes measured for both (`capture_bytes` has each)."""
        from mstar.runtime.engine.gpu.graphs import DecodeGraphs
        from mstar.runtime.engine.gpu.piecewise import PiecewiseGraphs

        sizes = sorted({b for b in self.batch_pad if b})
        if self.attention is None:
            raise RuntimeError("graphs are captured over FlashInfer attention (is_flashinfer=True)")
        self.capture_bytes.clear()
        if sizes:
            self.graphs = DecodeGraphs(self.forward, self.attention, self.loop_tokens, sizes, self.kv.dummy_slot,
                                       self.device)
            self.capture_bytes["decode"] = self.graphs.measured_bytes
        if self.packed is not None and self.forward.gdn is None:
            self.piecewise = PiecewiseGraphs(self.forward, self.loop_tokens, self.packed.token_buckets,
                                             self.packed.max_rows, self.kv.dummy_slot, self.device)
            self.capture_bytes["packed"] = self.piecewise.measured_bytes
        return sum(self.capture_bytes.values())

    def bucket(self, rows: list[RowSpec]) -> int:
        """The captured batch a decode-only step pads to, or 0 (eager)."""
        if self.graphs is None or not rows or len(rows) >= len(self.batch_pad):
            return 0
        if any(row.num_tokens != 1 for row in rows):
            return 0
        return self.batch_pad[len(rows)]

    def _stage(self, host: np.ndarray, dest: Optional[torch.Tensor] = None) -> torch.Tensor:
        """One host-to-device copy of an int32 array (through a pinned buffer of the ring on a GPU)."""
        size = host.shape[0]
        index = self._next_staging
        self._next_staging = (index + 1) % NUM_STAGING
        event = self._staged_event[index]
        if event is not None:
            event.synchronize()  # the copy that read this buffer last has passed
        if self._staging[index].shape[0] < size:
            self._staging[index] = self._host(torch.empty(2 * size, dtype=torch.int32))
        if dest is None:
            if self._device_in.shape[0] < size:
                self._device_in = torch.empty(2 * size, dtype=torch.int32, device=self.device)
            dest = self._device_in[:size]
        staging = self._staging[index][:size]
        staging.numpy()[:] = host
        dest.copy_(staging, non_blocking=True)
        if self.is_cuda:
            self._staged_event[index] = self._record()
        return dest

    def _record(self) -> torch.cuda.Event:
        event = torch.cuda.Event()
        event.record()
        return event

    def _wait_previous_inputs(self) -> None:
        """Before a plan: FlashInfer reuses its pinned plan buffer, which the previous step's
        asynchronous copy may still be reading."""
        if self._inputs_copied is not None:
            self._inputs_copied.synchronize()
            self._inputs_copied = None

    def _run_eager(self, packed: PackedStep, num_decode: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        # A hybrid decoder's prompt rows: their layout for the linear layers rides in the same copy.
        layout = self.forward.linear_layout(packed)
        size = packed.host.shape[0]
        data = self._stage(packed.host if layout is None else np.concatenate([packed.host, layout.host]))
        ids, positions, slots, src, last_index, row_slot = data[:size].split(packed.field_sizes())
        linear = self.forward.decode_step(row_slot) if layout is None else layout.on_device(data[size:], row_slot)
        if self.attention is not None:
            self._wait_previous_inputs()
            attend: Attend = self.attention.plan_eager(packed, num_decode)
            self._inputs_copied = self._record()
        else:
            attend = torch_attend(packed.qo_indptr.tolist(), packed.kv_indptr.tolist(), packed.kv_indices,
                                  packed.last_page_len.tolist(), self.kv.page_size, self.forward.dims.head_dim ** -0.5)
        ids = fed_ids(ids, src, self.loop_tokens)
        logits = self.forward(ids, positions, slots, last_index, attend, linear)
        return logits, logits.argmax(-1), row_slot

    def _run_graph(self, batch: int, packed: PackedStep) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        graphs, attention = self.graphs, self.attention
        assert graphs is not None and attention is not None, "bucket() picks a graph only once captured"
        self._wait_previous_inputs()
        attention.plan_decode(batch, packed)
        host = attention.decode_host(batch, packed)  # the graph's inputs and the attention's indices
        self._stage(host, attention.staged[batch][:host.shape[0]])
        self._inputs_copied = self._record()
        graphs.replay(batch)
        return graphs.logits[batch], graphs.greedy[batch], graphs.inputs[batch][5 * batch:6 * batch]

    def token_bucket(self, rows: list[RowSpec], family: Optional[str], bucket: int) -> int:
        """The piecewise graphs' bucket a step of the plan's packed `family` and token `bucket`
        replays, or 0 (eager): the step must fit the bucket and the graphs' row entries."""
        if (self.piecewise is None or self.packed is None or family not in self.packed.names
                or bucket not in self.piecewise.pieces or len(rows) > self.piecewise.max_rows):
            return 0
        return bucket if sum(row.num_tokens for row in rows) <= bucket else 0

    def _run_piecewise(self, bucket: int, packed: PackedStep, num_decode: int = 0
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        graphs, attention = self.piecewise, self.attention
        assert graphs is not None and attention is not None, "token_bucket() picks a bucket only once captured"
        # The graphs' row fields hold max_rows entries: the real rows', then zeros (token 0, slot 0).
        offset, rows, num_rows = graphs.row_fields_offset(bucket), graphs.max_rows, packed.num_rows
        host = np.zeros(offset + 2 * rows, dtype=np.int32)
        host[:offset] = packed.host[:offset]
        host[offset:offset + num_rows] = packed.host[offset:offset + num_rows]
        host[offset + rows:offset + rows + num_rows] = packed.host[offset + num_rows:offset + 2 * num_rows]
        self._stage(host, graphs.inputs[bucket])
        self._wait_previous_inputs()
        planned = attention.plan_eager(packed, num_decode)
        self._inputs_copied = self._record()
        logits, greedy = graphs.replay(bucket, int(packed.qo_indptr[-1]), planned.run)
        return logits, greedy, graphs.inputs[bucket][offset + rows:offset + 2 * rows]

    def _split(self, rows: list[RowSpec], route: str) -> tuple[Optional[list[int]], int]:
        """The plan's `split` route on a step with decode and prompt rows (FlashInfer): the launch
        order (decode rows first, each kind in its own order) and the number of decode rows; else
        (None, 0)."""
        if route != "split" or self.attention is None:
            return None, 0
        is_decode = [row.is_decode and row.num_tokens == 1 for row in rows]
        num_decode = sum(is_decode)
        if not 0 < num_decode < len(rows):
            return None, 0
        return sorted(range(len(rows)), key=lambda index: not is_decode[index]), num_decode

    def launch(self, rows: list[RowSpec], sampling: Optional[SamplingRows] = None,
               family: Optional[str] = None, token_bucket: int = 0, route: str = "packed") -> Pending:
        """family, token_bucket: the step's capture family and token bucket from the plan (a packed
        family's step replays its piecewise graphs); a decode-only step picks its decode graph.
        route: the step's attention route from the plan (`split`: its decode rows on the decode
        kernel, launched first; `collect` returns the tokens in the caller's row order)."""
        order, num_decode = self._split(rows, route)
        if order is not None:
            rows = [rows[index] for index in order]
            sampling = sampling.take(order) if sampling is not None else None
        batch = self.bucket(rows)
        padded_tokens = 0 if batch else self.token_bucket(rows, family, token_bucket)
        packed = pack(rows, self.kv.page_size, self.kv.dummy_page, padded_rows=batch,
                      padded_tokens=batch or padded_tokens)
        with torch.no_grad():
            if batch:
                logits, greedy, row_slot = self._run_graph(batch, packed)
                self.num_graph_steps += 1
            elif padded_tokens:
                logits, greedy, row_slot = self._run_piecewise(padded_tokens, packed, num_decode)
                self.num_piecewise_steps += 1
            else:
                logits, greedy, row_slot = self._run_eager(packed, num_decode)
                self.num_eager_steps += 1
            num_rows = len(rows)
            tokens = greedy[:num_rows]
            if sampling is not None:
                tokens = sample(logits[:num_rows], *self._sampling_tensors(sampling))
            self.loop_tokens[row_slot[:num_rows].long()] = tokens
            buffer = (self._free_out.pop() if self._free_out
                      else self._host(torch.empty(self.max_rows, dtype=torch.long)))
            out = buffer[:num_rows]
            out.copy_(tokens, non_blocking=True)
        event = self._record() if self.is_cuda else None
        return Pending(num_rows, event, out, bool(batch), buffer, order)

    def _sampling_tensors(self, sampling: SamplingRows) -> list[torch.Tensor]:
        arrays = (sampling.temperature, sampling.top_p, sampling.seeds, sampling.counters)
        return [torch.from_numpy(np.ascontiguousarray(a)).to(self.device, non_blocking=True) for a in arrays]

    def collect(self, pending: Pending) -> np.ndarray:
        """The step's sampled ids (waits for the step); call once per launched step."""
        if pending.event is not None:
            pending.event.synchronize()
        tokens = pending.tokens.numpy().copy()
        self._free_out.append(pending.buffer)
        if pending.order is not None:  # back to the caller's row order
            ordered = np.empty_like(tokens)
            ordered[pending.order] = tokens
            return ordered
        return tokens
