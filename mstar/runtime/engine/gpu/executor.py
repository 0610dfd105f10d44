"""Runs one step of a plain decoder on its device: stage, plan, replay or run, sample, copy back.

In: the step's `RowSpec`s and, when any row samples, per-row sampling arrays. Out: `launch` returns
a `Pending` step at once (the device may still be running it); `collect(pending)` waits for it and
returns the sampled token ids as a numpy array.

Per step the host does: pack the rows, FlashInfer's plan, one copy of an int32 array into pinned
memory and one non-blocking host-to-device copy, then either the
replay of the decode graph of the step's bucket (a decode-only step with at most the family's
largest batch, padded by the plan's `batch_pad` table), the whole graph of a packed family the plan
captures whole (`packed_graphs.py`: a prefill or mixed step the plan gives one of the family's token
buckets, its rows padded to the family's batch size, the graph of the step's attention route), the
piecewise graphs of a packed family marked piecewise (`piecewise.py`: padded to the token bucket,
attention eager between the pieces), or an eager run.
A step whose prompt rows are short replays the decode graph when the plan's decode family says
`unroll_prompts=N` (`CaptureFamily.unroll_prompts`) and the step holds only decode rows and prompt
rows of at most N tokens, N x rows fitting the largest batch: each prompt row of n tokens after c
cached runs as n one-token rows, row i fed token i at position c + i and attending to the c + i + 1
positions before and at it. Every row's K/V is written before any row of the layer attends (the
step's RoPE + K/V write comes first), so row i sees rows 0..i-1 of the same step as the prompt row
would have: the same arithmetic as one causal prefill call, in one graph instead of the piecewise
graphs' pieces and eager attention calls. The caller's rows come first (a prompt row's place taken
by its last token's row, which samples), the others after them: only the caller's rows are
sampled, scattered and copied back.
Sampling, and writing each row's token into the device token table (the on-device loop-back the
next decode step reads), run on the device; the one device-to-host copy is the sampled ids,
non-blocking into pinned memory. Without FlashInfer (a CPU, for tests) attention is `torch_attend`.

Two packers, fixed per executor:
- the plan's generated glue (`glue_packing.py`, `glue_pages_per_seq` given; each `launch` names
  its key's `KeyGlue`): the copy carries only the row list, the pages granted since each row was
  last packed and the new token ids; `pack_step` writes ids (loop-back rows read from the device
  token table), positions, write slots, page indices and last-token indices straight into the
  graph's inputs and the decode wrapper's index buffers (a decode graph), a piecewise bucket's
  inputs, or eager buffers; `scatter_after_sampling` writes the sampled tokens into the device
  token table. FlashInfer's plan() reads qo/kv indptr and last page lengths, computed on the host
  (small: one entry a row), and the page indices on the device;
- `packing.pack` (numpy; the bench's comparison, and hybrid decoders, whose linear layers read
  the numpy layout): the copy carries every packed array (for a graph step also the attention's
  index arrays, `FlashInferSteps.decode_host`), and the loop-back token is picked on the device
  by `packing.fed_ids`.

Steps may overlap: the host may launch step N+1 (even pack and plan it) before step N is
collected, so the run loop's host work hides behind the device's. What makes that safe:
- the pinned staging buffers are a ring of `NUM_STAGING`, each reused only after the copy that
  read it last has passed (its event);
- FlashInfer's plan writes a pinned buffer of its own and copies it to the device asynchronously:
  a step's plan waits for the previous plan's copies to pass (`_inputs_copied`, in the steady
  state already past: the previous step is running); a decode graph on the Triton kernel plans
  nothing, so it neither waits nor records;
- each launched step copies its sampled ids into a pinned buffer of its own, returned at collect;
- device buffers (graph inputs, the token table, logits) are read and written in stream order.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Optional, Sequence

import numpy as np
import torch

from mstar.runtime.engine.glue_reference import INDEX_DTYPE, KeyGlue, PackBuffers, RowInputs, TokenBuffers
from mstar.runtime.engine.gpu.forward import Attend, DecoderForward, PagedKv, torch_attend
from mstar.runtime.engine.gpu.gdn_forward import LinearStep
from mstar.runtime.engine.gpu.glue_packing import GluePacker, GlueStep, eager_buffers
from mstar.runtime.engine.gpu.packing import (NUM_TOKEN_FIELDS, PackedStep, RowSpec, max_row_pages, pack,
                                              padded)
from mstar.runtime.engine.gpu.penalties import PenaltyRows, PenaltyTable, new_places, penalise
from mstar.runtime.engine.gpu.sampler import sample
from mstar.runtime.engine.gpu.step_events import StepEvents
from mstar.runtime.engine.sampling import MIN_TEMPERATURE, as_token_logprobs, bias_rule, logprob_tensors
from mstar.runtime.step import TokenLogprobs

NUM_STAGING = 4  # pinned input buffers in the ring: a step and the ones launched ahead of it

if TYPE_CHECKING:  # imported where used: FlashInfer is an optional dependency
    from mstar.runtime.engine.gpu.attention import FlashInferSteps, Indices
    from mstar.runtime.engine.gpu.graphs import DecodeGraphs
    from mstar.runtime.engine.gpu.packed_graphs import PackedGraphs
    from mstar.runtime.engine.gpu.piecewise import PiecewiseGraphs


@dataclass
class SamplingRows:
    temperature: np.ndarray  # float32 [R], 0 = greedy
    top_p: np.ndarray  # float32 [R]
    seeds: np.ndarray  # int64 [R]
    counters: np.ndarray  # int64 [R]
    top_k: np.ndarray  # int64 [R], 0 = no limit
    penalties: Optional[PenaltyRows] = None  # the rows with a penalty (gpu/penalties.py), None: none
    # int64 [R]: the alternatives each row asks log-probabilities of beside its token (-1: none);
    # None: no row asks (RowResult.logprobs)
    logprobs: Optional[np.ndarray] = None
    # the rows' logit biases as int64 rows, int64 tokens and float32 biases (`sampling.bias_pairs`);
    # None: no row has one
    bias: Optional[tuple[np.ndarray, np.ndarray, np.ndarray]] = None

    @property
    def is_greedy(self) -> bool:
        """No row draws (each takes its argmax, after its penalties and logit additions): read on
        the host, so a step of such rows skips the sampler's sort of the vocabulary."""
        return not bool((self.temperature >= MIN_TEMPERATURE).any())

    @property
    def is_whole(self) -> bool:
        """No row limits the tokens it draws from (top_p 1, no top_k): `sampler.sample` needs no sort."""
        return not bool((self.top_p < 1.0).any() or (self.top_k > 0).any())

    def take(self, order: list[int]) -> "SamplingRows":
        bias = None if self.bias is None else (new_places(order)[self.bias[0]], self.bias[1], self.bias[2])
        return SamplingRows(self.temperature[order], self.top_p[order], self.seeds[order], self.counters[order],
                            self.top_k[order], None if self.penalties is None else self.penalties.take(order),
                            None if self.logprobs is None else self.logprobs[order], bias)


@dataclass(frozen=True)
class WholePacked:
    """A packed capture family the plan captures whole (`CaptureFamily.is_piecewise` false): a
    graph per (token bucket, batch size), attention inside (`packed_graphs.py`)."""

    name: str
    batch_pad: tuple[int, ...]  # rows -> the batch size a step pads to (0: none)
    batch_sizes: tuple[int, ...]
    token_buckets: tuple[int, ...]
    routes: frozenset[str] = frozenset({"packed"})  # the attention routes the plan gives its steps

    def keys(self) -> list[tuple[int, int, str]]:
        """(token bucket, batch size, route) of each graph: a row holds one token at least, and a
        step on the split route holds a decode row and a prompt row at least."""
        return [(tokens, rows, route) for tokens in self.token_buckets for rows in self.batch_sizes
                for route in sorted(self.routes) if rows <= tokens and (rows > 1 or route == "packed")]


@dataclass(frozen=True)
class PackedFamilies:
    """The node's packed capture families (`CaptureFamily.kind == "packed"`): those captured
    piecewise (`names`, their buckets and rows), and those captured whole."""

    names: frozenset[str]
    token_buckets: list[int]  # the union of the piecewise families' buckets
    max_rows: int  # the largest batch size among them: the graphs' row entries
    whole: tuple[WholePacked, ...] = ()
    # the piecewise graphs also keep every position's final hidden state (`PiecewiseGraphs.hidden`):
    # the node gives prompts' log-probabilities and the switch is on (gpu/setup.py `keeps_hidden`)
    keeps_hidden: bool = False


# the rows of a step that asked for log-probabilities (launch order), their counts, and
# `sampling.logprob_tensors`' tensors for them, host copies (pinned) that the step's event covers
DeviceLogprobs = tuple[list[int], list[int], torch.Tensor, torch.Tensor, torch.Tensor]


@dataclass
class Pending:
    num_rows: int
    event: Optional[torch.cuda.Event]
    tokens: torch.Tensor  # host view of the sampled ids (valid once the event has passed)
    is_graph: bool
    buffer: torch.Tensor  # the pinned buffer `tokens` views, reused once collected
    order: Optional[list[int]] = None  # the launch order of the caller's rows (the split route), None: theirs
    logprobs: Optional[DeviceLogprobs] = None  # read by `collect_logprobs`; None: no row asked
    # `launch(scoring=...)`: the step's final hidden states, every position, and each scored row's
    # token span in them (by the caller's row index), which `GpuDecoderRunner._scored` reads
    hidden: Optional[torch.Tensor] = None
    spans: Optional[dict[int, tuple[int, int]]] = None


class StepExecutor:
    def __init__(self, forward: DecoderForward, kv: PagedKv, device: torch.device, max_rows: int,
                 decode_batch_pad: Optional[list[int]] = None, is_flashinfer: bool = False,
                 decode_kernel: str = "auto", packed: Optional[PackedFamilies] = None,
                 glue_pages_per_seq: Optional[int] = None, unroll_prompts: int = 0):
        """decode_batch_pad: the decode family's lookup (`CaptureFamily.batch_pad`), None for no graphs.
        unroll_prompts: the decode family's `CaptureFamily.unroll_prompts` (module docstring); a
        hybrid decoder never unrolls (its recurrent state moves one token after another).
        packed: the node's packed capture families, captured piecewise (`piecewise.py`) or whole
        (`packed_graphs.py`); a hybrid decoder runs the whole families' steps eagerly (its prompt
        rows' gated delta-net kernels plan on the host) and the piecewise ones with each linear
        layer's layout-bound middle between the pieces, as attention.
        glue_pages_per_seq: pack with the plan's generated glue (module docstring), whose device
        page table holds this many pages a row slot; None: `packing.pack`."""
        self.forward, self.kv, self.device = forward, kv, device
        self.is_cuda = device.type == "cuda"
        # The device token table: int32, as the generated glue reads and writes it.
        self.loop_tokens = torch.zeros(max_rows, dtype=INDEX_DTYPE, device=device)
        # the penalised requests' sample counts and seen masks, kept between steps (gpu/penalties.py)
        self.penalty_table = PenaltyTable(device)
        self.packer: Optional[GluePacker] = None
        if glue_pages_per_seq is not None:
            if forward.gdn is not None:
                raise ValueError("a hybrid decoder's linear layers read the numpy packing's layout: no glue packer")
            self.packer = GluePacker(kv.page_size, max_rows, glue_pages_per_seq, kv.dummy_slot, device)
            # No stream buffer (capacity 0): the host routes a fast-path node's streamed tokens.
            no_stream = torch.zeros(max_rows, 0, dtype=INDEX_DTYPE, device=device)
            self.token_buffers = TokenBuffers(self.loop_tokens, no_stream,
                                              torch.zeros(max_rows, dtype=INDEX_DTYPE, device=device))
        self._graph_out: dict[int, PackBuffers] = {}  # decode batch -> the glue's views of its inputs
        self._piecewise_out: dict[int, PackBuffers] = {}  # token bucket -> the same
        self.batch_pad = decode_batch_pad or [0]
        self.unroll_prompts = unroll_prompts if forward.gdn is None else 0
        self.attention: Optional[FlashInferSteps] = None
        self.graphs: Optional[DecodeGraphs] = None
        self.packed = packed if packed is not None and packed.token_buckets else None
        self.piecewise: Optional[PiecewiseGraphs] = None
        whole = packed.whole if packed is not None and forward.gdn is None else ()
        self.whole = {family.name: family for family in whole}
        self.packed_graphs: Optional[PackedGraphs] = None
        self._whole_out: dict[tuple[int, int, str], PackBuffers] = {}  # graph key -> the glue's views of its buffers
        self.capture_bytes: dict[str, int] = {}  # measured growth per graph kind ("decode", "packed")
        # The forward rotates positions below its table's length, so no row's sequence is longer.
        self.max_row_pages = max_row_pages(forward.cos.shape[0], kv.page_size, kv.num_pages)
        if is_flashinfer:
            self.attention = self._flashinfer_steps(decode_kernel)
        self.max_rows = max_rows
        self._staging = [torch.empty(0, dtype=torch.int32) for _ in range(NUM_STAGING)]
        self._staging_view = [buffer.numpy() for buffer in self._staging]  # each buffer's numpy view
        self._staged_event: list[Optional[torch.cuda.Event]] = [None] * NUM_STAGING
        self._next_staging = 0
        self._device_in = torch.empty(0, dtype=torch.int32, device=device)
        self._free_out: list[torch.Tensor] = []  # pinned sampled-id buffers of collected steps
        self._inputs_copied: Optional[torch.cuda.Event] = None  # the last step's plan and input copies
        self.num_graph_steps = self.num_eager_steps = self.num_piecewise_steps = 0
        self.num_unrolled_steps = 0  # graph steps whose prompt rows ran one row per query token
        self.num_whole_packed_steps = 0  # prefill and mixed steps on a whole graph (packed_graphs.py)
        self.step_events: Optional[StepEvents] = None  # `mstar run --gpu-idle` (step_events.py)
        # a step scoring a prompt runs on the piecewise graphs that keep its hidden states
        # (`_scoring_bucket`); False: eagerly (a what-if, timed by `tools/gpu/checks.sh prompts`)
        self.scores_on_pieces = True

    def _flashinfer_steps(self, decode_kernel: str) -> "FlashInferSteps":
        """The node's attention (FlashInfer's wrappers, and the decode graphs' kernel picked by
        `decode_kernel`, `attention.graph_decode_kernel`), the float workspace sized for the whole
        packed graphs, warmed up on the dummy page."""
        from mstar.runtime.engine.gpu.attention import WORKSPACE_BYTES, FlashInferSteps
        from mstar.runtime.engine.gpu.packed_graphs import workspace_bytes_for

        sizes = sorted({b for b in self.batch_pad if b})
        dims, kv = self.forward.dims, self.kv
        workspace = workspace_bytes_for(self._whole_keys(), dims.num_qo_heads, dims.num_kv_heads, dims.head_dim,
                                        self.device, WORKSPACE_BYTES)
        steps = FlashInferSteps(self.device, dims.num_qo_heads, dims.num_kv_heads, dims.head_dim, kv.page_size,
                                self.max_row_pages, sizes, decode_kernel, workspace)
        steps.warm_up(kv.pages(0), kv.dummy_page)
        return steps

    def _whole_keys(self) -> list[tuple[int, int, str]]:
        return sorted({key for family in self.whole.values() for key in family.keys()})

    def _host(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor.pin_memory() if self.is_cuda else tensor

    def capture(self) -> int:
        """Capture the decode family's graphs and the packed families' piecewise graphs (a GPU with
        FlashInfer); returns the bytes measured for both (`capture_bytes` has each)."""
        from mstar.runtime.engine.gpu.graphs import DecodeGraphs
        from mstar.runtime.engine.gpu.packed_graphs import PackedGraphs
        from mstar.runtime.engine.gpu.piecewise import PiecewiseGraphs

        sizes = sorted({b for b in self.batch_pad if b})
        if self.attention is None:
            raise RuntimeError("graphs are captured over FlashInfer attention (is_flashinfer=True)")
        self.capture_bytes.clear()
        if sizes:
            self.graphs = DecodeGraphs(self.forward, self.attention, self.loop_tokens, sizes, self.kv.dummy_slot,
                                       self.device)
            self.capture_bytes["decode"] = self.graphs.measured_bytes
        if self.packed is not None:
            self.piecewise = PiecewiseGraphs(self.forward, self.loop_tokens, self.packed.token_buckets,
                                             self.packed.max_rows, self.kv.dummy_slot, self.device,
                                             keeps_hidden=self.packed.keeps_hidden)
            self.capture_bytes["packed"] = self.piecewise.measured_bytes
        if self.whole:
            self.packed_graphs = PackedGraphs(self.forward, self.attention, self.loop_tokens, self._whole_keys(),
                                              self.max_row_pages, self.kv.dummy_slot, self.device)
            self.capture_bytes["whole"] = self.packed_graphs.measured_bytes
        self._glue_views()
        return sum(self.capture_bytes.values())

    def _glue_views(self) -> None:
        """The glue's `PackBuffers` for each captured graph: views of the graph's inputs (and a
        decode bucket's FlashInfer index buffers), so `pack_step` writes what the replay reads.
        The graphs' token-source field stays -1 from capture (the glue resolves loop-back tokens
        itself), and so does the row-slot field (read only by a hybrid decoder's layers)."""
        from mstar.runtime.engine.gpu.attention import NUM_FIELDS

        if self.packer is None:
            return
        scratch = torch.zeros(self.max_rows + 1, dtype=INDEX_DTYPE, device=self.device)  # qo_indptr: unread
        if self.graphs is not None and self.attention is not None:
            for batch in self.graphs.graphs:
                indptr, last, indices, end = self.attention.layout(batch)
                staged = self.attention.staged[batch]
                fields = staged[:NUM_FIELDS * batch].view(NUM_FIELDS, batch)
                self._graph_out[batch] = PackBuffers(
                    fields[0], fields[1], fields[2], scratch[:batch + 1], staged[indptr:indptr + batch + 1],
                    staged[indices:end], staged[last:last + batch], fields[4])
        if self.piecewise is not None:
            rows = self.piecewise.max_rows
            for bucket in self.piecewise.pieces:
                ids, positions, slots, _src, last_index, _row_slot = self.piecewise.inputs[bucket].split(
                    [bucket] * 4 + [rows] * 2)
                # The index arrays of a piecewise step are read by its eager attention only: fresh per step.
                self._piecewise_out[bucket] = PackBuffers(ids, positions, slots, scratch[:rows + 1], scratch[:0],
                                                          scratch[:0], scratch[:0], last_index)
        if self.packed_graphs is not None:
            graphs = self.packed_graphs
            for key in graphs.graphs:
                tokens, rows = key[0], key[1]
                ids, positions, slots, _src, last_index, _row_slot = graphs.inputs[key].split(
                    [tokens] * NUM_TOKEN_FIELDS + [rows] * 2)
                qo, kv, last, pages, end = graphs.index_layout(rows)
                index = graphs.indices[rows]
                # The wrapper's own index buffers: pack_step writes what the graph's attention reads.
                self._whole_out[key] = PackBuffers(ids, positions, slots, index[qo:qo + rows + 1],
                                                   index[kv:kv + rows + 1], index[pages:end], index[last:last + rows],
                                                   last_index)

    def restore_loop_tokens(self, slots: list[int], tokens: list[int]) -> None:
        """Put host-known tokens back into the device token table (a step launched ahead that
        nobody claimed had written its guesses there)."""
        table = self.loop_tokens
        table[torch.tensor(slots, device=table.device)] = torch.tensor(tokens, dtype=table.dtype, device=table.device)

    def bucket(self, rows: list[RowSpec]) -> int:
        """The captured batch a decode-only step pads to, or 0 (eager)."""
        if self.graphs is None or not rows or len(rows) >= len(self.batch_pad):
            return 0
        if any(row.num_tokens != 1 for row in rows):
            return 0
        return self.batch_pad[len(rows)]

    def _unrolled(self, rows: list[RowSpec]) -> Optional[list[RowSpec]]:
        """The step's rows with its prompt rows unrolled (module docstring: the caller's rows, each
        prompt row replaced by its last token's row, then the other tokens' rows), or None when the
        plan does not unroll this step (no prompt row, one past `unroll_prompts` tokens, or more rows
        than the decode family's largest batch)."""
        limit = self.unroll_prompts
        if not limit or self.graphs is None:
            return None
        counts = [row.num_tokens for row in rows]
        if max(counts, default=0) < 2 or max(counts) > limit:
            return None
        total = sum(counts)  # a captured batch must hold them (batch_pad is 0 above the largest)
        if total >= len(self.batch_pad) or not self.batch_pad[total]:
            return None
        kept: list[RowSpec] = []
        others: list[RowSpec] = []
        for row in rows:
            tokens = row.token_ids
            if tokens is None or len(tokens) == 1:
                kept.append(row)
                continue
            last = len(tokens) - 1
            # RowSpec(...) rather than dataclasses.replace: 0.3 against 1.6 us a row, and a cached
            # request's first step unrolls 16 of them on the host before the device starts
            table, slot, is_decode, walk = row.page_table, row.row_slot, row.is_decode, row.walk_index
            kept.append(RowSpec(tokens[last:], row.num_cached + last, table, slot, is_decode, walk))
            others.extend(RowSpec([token], row.num_cached + i, table, slot, is_decode, walk)
                          for i, token in enumerate(tokens[:last]))
        return kept + others

    def _stage(self, host: np.ndarray, dest: Optional[torch.Tensor] = None) -> torch.Tensor:
        """One host-to-device copy of an int32 array (through a pinned buffer of the ring on a GPU).
        Each buffer keeps its numpy view and its event, made once: a serial step waits for this
        before its replay (47 us a call on an H200's host with a fresh view and event each call)."""
        size = host.shape[0]
        index = self._next_staging
        self._next_staging = (index + 1) % NUM_STAGING
        event = self._staged_event[index]
        if event is not None:
            event.synchronize()  # the copy that read this buffer last has passed
        if self._staging[index].shape[0] < size:
            self._staging[index] = self._host(torch.empty(2 * size, dtype=torch.int32))
            self._staging_view[index] = self._staging[index].numpy()
        if dest is None:
            if self._device_in.shape[0] < size:
                self._device_in = torch.empty(2 * size, dtype=torch.int32, device=self.device)
            dest = self._device_in[:size]
        self._staging_view[index][:size] = host
        dest.copy_(self._staging[index][:size], non_blocking=True)
        if self.is_cuda:
            if event is None:
                event = self._staged_event[index] = torch.cuda.Event()
            event.record()
        return dest

    def _record(self) -> torch.cuda.Event:
        event = torch.cuda.Event()
        event.record()
        return event

    def _mark_replay(self) -> None:
        """Where the host has issued a step's copies, packing and planning and its graph replay or
        eager forward comes next: `StepEvents.replay` (`mstar bench kv` tells a step's device work from
        the device waiting for the host inside the step)."""
        if self.step_events is not None:
            self.step_events.replay()

    def _wait_previous_inputs(self) -> None:
        """Before a plan: FlashInfer reuses its pinned plan buffer, which the previous step's
        asynchronous copy may still be reading."""
        if self._inputs_copied is not None:
            self._inputs_copied.synchronize()
            self._inputs_copied = None

    def _eager_attend(self, step: "Indices", num_decode: int) -> Attend:
        """An eager step's attention over its CSR arrays (numpy- or glue-packed alike): FlashInfer
        planned for its rows, else the torch reference (the CPU)."""
        if self.attention is None:
            return torch_attend(step.qo_indptr.tolist(), step.kv_indptr.tolist(), step.kv_indices,
                                step.last_page_len.tolist(), self.kv.page_size, self.forward.dims.head_dim ** -0.5)
        self._wait_previous_inputs()
        attend = self.attention.plan_eager(step, num_decode)
        self._planned()
        return attend

    def _run_eager(self, packed: PackedStep, num_decode: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        # A hybrid decoder's prompt rows: their layout for the linear layers rides in the same copy.
        layout = self.forward.linear_layout(packed)
        size = packed.host.shape[0]
        data = self._stage(packed.host if layout is None else np.concatenate([packed.host, layout.host]))
        ids, positions, slots, src, last_index, row_slot = data[:size].split(packed.field_sizes())
        linear = (self.forward.decode_step(row_slot) if layout is None
                  else self.forward.eager_linear_step(layout, data[size:], row_slot))
        attend = self._eager_attend(packed, num_decode)
        self._mark_replay()
        logits = self.forward(ids, positions, slots, last_index, attend, linear, fed=(src, self.loop_tokens))
        return logits, self.forward.greedy(logits), row_slot

    def _run_graph(self, batch: int, packed: PackedStep) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        graphs, attention = self.graphs, self.attention
        assert graphs is not None and attention is not None, "bucket() picks a graph only once captured"
        self._plan_decode_graph(batch, packed)
        host = attention.decode_host(batch, packed)  # the graph's inputs and the attention's indices
        self._stage(host, attention.staged[batch][:host.shape[0]])
        self._mark_replay()
        graphs.replay(batch)
        return graphs.logits[batch], graphs.greedy[batch], graphs.inputs[batch][5 * batch:6 * batch]

    def token_bucket(self, rows: list[RowSpec], family: Optional[str], bucket: int) -> int:
        """The piecewise graphs' bucket a step of the plan's packed `family` and token `bucket`
        replays, or 0 (eager): the step must fit the bucket and the graphs' row entries."""
        if (self.piecewise is None or self.packed is None or family not in self.packed.names
                or bucket not in self.piecewise.pieces or len(rows) > self.piecewise.max_rows):
            return 0
        return bucket if sum(row.num_tokens for row in rows) <= bucket else 0

    def whole_key(self, rows: list[RowSpec], family: Optional[str], bucket: int, num_decode: int
                  ) -> Optional[tuple[int, int, str]]:
        """The whole graph (token bucket, batch size, route) a step of the plan's packed `family`
        and token `bucket` replays, or None: the family is captured whole, the step's rows pad to one
        of its batch sizes and its tokens fit the bucket. num_decode: the decode rows the plan's
        split route puts first (`_split`), 0 for one prefill call (the packed route, or a split
        step of one kind of row)."""
        spec = self.whole.get(family or "")
        if spec is None or self.packed_graphs is None or len(rows) >= len(spec.batch_pad):
            return None
        return self.packed_graphs.key(len(rows), sum(row.num_tokens for row in rows), spec.batch_pad[len(rows)],
                                      bucket, "split" if num_decode else "packed")

    def _plan_whole(self, key: tuple[int, int, str], qo_indptr: np.ndarray, kv_indptr: np.ndarray,
                    last_page_len: np.ndarray, num_decode: int) -> None:
        graphs = self._whole_graphs()
        if key[2] == "split":
            self._stage(np.array([num_decode], dtype=np.int32), graphs.split[key[1]].num_decode)
        if not graphs.needs_plan(key):  # attention on Triton kernels alone: nothing to schedule on the host
            return
        self._wait_previous_inputs()
        graphs.plan(key, qo_indptr, kv_indptr, last_page_len, num_decode)
        self._planned()

    def _run_whole(self, key: tuple[int, int, str], packed: PackedStep, num_decode: int
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """A whole packed graph from the numpy packing (`packed` at the key's token bucket, its real
        rows only): the row fields and the CSR arrays padded to the key's rows as zero-length rows."""
        graphs = self._whole_graphs()
        tokens, rows = key[0], key[1]
        offset = NUM_TOKEN_FIELDS * tokens
        self._stage(_padded_row_fields(packed, offset, rows), graphs.inputs[key])
        qo_host, kv_host = packed.qo_indptr.numpy(), packed.kv_indptr.numpy()
        qo, kv = padded(qo_host, rows + 1, int(qo_host[-1])), padded(kv_host, rows + 1, int(kv_host[-1]))
        last = padded(packed.last_page_len.numpy(), rows, 0)
        qo_at, kv_at, last_at, pages_at, _ = graphs.index_layout(rows)
        indices = np.zeros(pages_at + packed.kv_indices.shape[0], dtype=np.int32)
        indices[qo_at:qo_at + rows + 1], indices[kv_at:kv_at + rows + 1] = qo, kv
        indices[last_at:last_at + rows] = last
        indices[pages_at:] = packed.kv_indices.numpy()
        self._stage(indices, graphs.indices[rows][:indices.shape[0]])
        self._plan_whole(key, qo, kv, last, num_decode)
        self._mark_replay()
        logits, greedy = graphs.replay(key)
        return logits, greedy, graphs.inputs[key][offset + rows:offset + 2 * rows]

    def _run_piecewise(self, bucket: int, packed: PackedStep, num_decode: int = 0
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        graphs, attention = self.piecewise, self.attention
        assert graphs is not None and attention is not None, "token_bucket() picks a bucket only once captured"
        offset, rows = graphs.row_fields_offset(bucket), graphs.max_rows
        self._stage(_padded_row_fields(packed, offset, rows), graphs.inputs[bucket])
        row_slot = graphs.inputs[bucket][offset + rows:offset + 2 * rows]
        linear = self._piecewise_linear(packed, row_slot[:packed.num_rows])
        self._wait_previous_inputs()
        planned = attention.plan_eager(packed, num_decode)
        self._planned()
        self._mark_replay()
        logits, greedy = graphs.replay(bucket, int(packed.qo_indptr[-1]), planned.run, linear)
        return logits, greedy, row_slot

    def _piecewise_linear(self, packed: PackedStep, row_slot: torch.Tensor) -> Optional[Callable]:
        """A hybrid decoder's step between its pieces: each linear layer's middle over the step's
        real rows (`GdnForward.middle`), their layout staged as an eager step's; None for a plain
        decoder."""
        gdn = self.forward.gdn
        if gdn is None:
            return None
        layout = self.forward.linear_layout(packed)
        step = (LinearStep.of(row_slot, gdn.states) if layout is None
                else self.forward.eager_linear_step(layout, self._stage(layout.host), row_slot))
        return lambda index, mixed, g, beta, out: gdn.middle(index, mixed, g, beta, step, out)

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
               family: Optional[str] = None, token_bucket: int = 0, route: str = "packed",
               glue: Optional[KeyGlue] = None, scoring: Sequence[int] = ()) -> Pending:
        """family, token_bucket: the step's capture family and token bucket from the plan (a packed
        family's step replays its piecewise graphs); a decode-only step picks its decode graph.
        route: the step's attention route from the plan (`split`: its decode rows on the decode
        kernel, launched first; `collect` returns the tokens in the caller's row order).
        glue: the generated glue of the step's key, which an executor with the glue packer needs
        (the rows' `walk_index` index its walks); an executor without one takes none.
        scoring: the caller's rows whose every position's final hidden state is wanted (a prompt's
        log-probabilities, engine/prompt_logprobs.py): the step then runs on the piecewise graphs
        where they keep those states, else eagerly (`_path`; `Pending.hidden`, `.spans`)."""
        if (glue is None) != (self.packer is None):
            raise ValueError("an executor packing with the generated glue takes each step's KeyGlue, and only it")
        began = self.step_events.begin() if self.step_events is not None else None
        num_rows = len(rows)  # the caller's: the rows sampled, scattered and copied back
        unrolled = None if scoring else self._unrolled(rows)
        if unrolled is not None:
            rows, order, num_decode = unrolled, None, 0
            self.num_unrolled_steps += 1
        else:
            order, num_decode = self._split(rows, route)
        if order is not None:
            rows = [rows[index] for index in order]
            sampling = sampling.take(order) if sampling is not None else None
        batch, whole, padded_tokens = self._path(rows, family, token_bucket, num_decode, bool(scoring))
        with torch.no_grad():
            inputs: Optional[RowInputs] = None
            self.forward.keep_hidden = bool(scoring)
            try:
                if glue is not None:
                    logits, greedy, inputs = self._run_glue(glue, rows, batch, padded_tokens, num_decode, whole)
                else:
                    logits, greedy, row_slot = self._run_numpy(rows, batch, whole, padded_tokens, num_decode)
            finally:
                self.forward.keep_hidden = False
            self._count(batch, whole, padded_tokens)
            tokens, logprobs = greedy[:num_rows], None
            if sampling is not None:
                tokens, logprobs = self._sampled(logits[:num_rows], tokens, sampling)
            if glue is not None and inputs is not None:
                glue.scatter_after_sampling(num_rows, tokens, inputs, self.token_buffers)
            else:
                self.loop_tokens[row_slot[:num_rows].long()] = tokens.to(self.loop_tokens.dtype)
            buffer = (self._free_out.pop() if self._free_out
                      else self._host(torch.empty(self.max_rows, dtype=torch.long)))
            out = buffer[:num_rows]
            out.copy_(tokens, non_blocking=True)
        if began is not None and self.step_events is not None:
            event: Optional[torch.cuda.Event] = self.step_events.end(
                began, len(rows), sum(row.num_tokens for row in rows), path_of(batch, whole, padded_tokens))
        else:
            event = self._record() if self.is_cuda else None
        pending = Pending(num_rows, event, out, bool(batch), buffer, order, logprobs)
        if scoring:
            pending.hidden = self._kept_hidden(rows, padded_tokens)
            pending.spans = _spans(rows, order, scoring)
        return pending

    def _path(self, rows: list[RowSpec], family: Optional[str], token_bucket: int, num_decode: int,
              is_scoring: bool) -> tuple[int, Optional[tuple[int, int, str]], int]:
        """How a step runs: (its decode graph's batch, its whole packed graph's key, its piecewise
        bucket), all empty for an eager step. A step scoring a prompt keeps every position's final
        hidden state (`_scoring_bucket`)."""
        if is_scoring:
            return 0, None, self._scoring_bucket(rows)
        batch = self.bucket(rows)
        whole = None if batch else self.whole_key(rows, family, token_bucket, num_decode)
        return batch, whole, 0 if batch or whole else self.token_bucket(rows, family, token_bucket)

    def _scoring_bucket(self, rows: list[RowSpec]) -> int:
        """The piecewise bucket of a step scoring a prompt: the smallest that holds its tokens,
        whatever family the plan gave the step, where the piecewise graphs keep every position's
        final hidden state (`PiecewiseGraphs.hidden`) and `scores_on_pieces`; else 0, eagerly (the
        decode and whole graphs keep the last positions only)."""
        pieces = self.piecewise
        if pieces is None or pieces.hidden is None or not self.scores_on_pieces or len(rows) > pieces.max_rows:
            return 0
        tokens = sum(row.num_tokens for row in rows)
        return next((bucket for bucket in pieces.token_buckets if bucket >= tokens), 0)

    def _kept_hidden(self, rows: list[RowSpec], padded_tokens: int) -> Optional[torch.Tensor]:
        """A scoring step's final hidden states, every position: the piecewise graphs' buffer, copied
        now in the stream (the next replay, a step launched ahead say, writes it again), or the
        eager forward's."""
        if padded_tokens:
            assert self.piecewise is not None and self.piecewise.hidden is not None, "_path picked the pieces"
            return self.piecewise.hidden[:sum(row.num_tokens for row in rows)].clone()
        hidden, self.forward.hidden = self.forward.hidden, None
        return hidden

    def _sampled(self, logits: torch.Tensor, greedy: torch.Tensor, sampling: SamplingRows
                 ) -> tuple[torch.Tensor, Optional[DeviceLogprobs]]:
        """The rows' tokens (their penalties and logit additions applied; the sampler only where a
        row draws, over its whole vocabulary without a sort where no row limits it) and
        `Pending.logprobs` of the rows that ask (of the logits before any of that: sampling.py)."""
        rows_logits = logits
        if sampling.penalties is not None:
            # (float32 out: penalise copies the step's logits once, bf16 or not)
            rows_logits = penalise(rows_logits, sampling.penalties, self.penalty_table, self.loop_tokens)
        if sampling.bias is not None:
            rows_logits = bias_rule(rows_logits.float(), *(self._moved(a) for a in sampling.bias))
        if sampling.is_greedy:  # (the sampler sorts every row's vocabulary: none here needs it)
            tokens = greedy if rows_logits is logits else rows_logits.float().argmax(-1)
        else:
            temperature, top_p, seeds, counters, top_k = self._sampling_tensors(sampling)
            # (the nucleus search finds the top k first only where a row also has a top_p)
            has_both = bool(((sampling.top_k > 0) & (sampling.top_p < 1.0)).any())
            tokens = sample(rows_logits, temperature, top_p, seeds, counters, top_k, is_whole=sampling.is_whole,
                            has_both=has_both)
        logprobs = self._logprobs(logits, tokens, sampling.logprobs) if sampling.logprobs is not None else None
        return tokens, logprobs

    def _logprobs(self, logits: torch.Tensor, tokens: torch.Tensor, counts: np.ndarray) -> Optional[DeviceLogprobs]:
        """`Pending.logprobs` of the rows whose count is not -1, computed on the device now and copied
        to the host behind the step (the host reads them at `collect_logprobs`, after its event)."""
        rows = np.flatnonzero(counts >= 0).tolist()
        if not rows:
            return None
        wanted = counts[rows].tolist()
        index = self._moved(np.asarray(rows, dtype=np.int64))
        on_device = logprob_tensors(logits.index_select(0, index), tokens.index_select(0, index), max(wanted))
        # Copied to pinned host tensors now, in the step's stream, as its tokens are: `tolist()` on
        # the device tensors at `collect_logprobs` waited for every step queued since (the step
        # launched ahead), which made a step holding such a row as slow as two (torch.tensor(rows,
        # device=...) here waited for the step before).
        on_host = [self._host(torch.empty(t.shape, dtype=t.dtype)) for t in on_device]
        for host, device in zip(on_host, on_device):
            host.copy_(device, non_blocking=True)
        return (rows, wanted, *on_host)

    def _run_numpy(self, rows: list[RowSpec], batch: int, whole: Optional[tuple[int, int, str]], padded_tokens: int,
                   num_decode: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """A step packed by `packing.pack` on the graph `launch` picked (or eagerly): (logits,
        greedy ids, the rows' slots)."""
        packed = pack(rows, self.kv.page_size, self.kv.dummy_page, padded_rows=batch,
                      padded_tokens=batch or (whole[0] if whole else 0) or padded_tokens)
        if batch:
            return self._run_graph(batch, packed)
        if whole:
            return self._run_whole(whole, packed, num_decode)
        if padded_tokens:
            return self._run_piecewise(padded_tokens, packed, num_decode)
        return self._run_eager(packed, num_decode)

    def _count(self, batch: int, whole: Optional[tuple[int, int, str]], padded_tokens: int) -> None:
        if batch:
            self.num_graph_steps += 1
        elif whole:
            self.num_whole_packed_steps += 1
        elif padded_tokens:
            self.num_piecewise_steps += 1
        else:
            self.num_eager_steps += 1

    def _run_glue(self, glue: KeyGlue, rows: list[RowSpec], batch: int, padded_tokens: int, num_decode: int,
                  whole: Optional[tuple[int, int, str]] = None) -> tuple[torch.Tensor, torch.Tensor, RowInputs]:
        """A step packed by the generated glue: (logits, greedy ids, the rows' inputs for the scatter)."""
        packer = self.packer
        assert packer is not None, "launch checked the executor's packer"
        step: GlueStep = packer.host_step(glue, rows, batch or (whole[1] if whole else len(rows)))
        bucket = batch or (whole[0] if whole else 0) or padded_tokens or step.num_tokens
        data = self._stage(step.host, packer.row_buffer(step.host.shape[0], bucket))
        if batch:
            return self._glue_graph(glue, step, data, batch)
        if whole:
            inputs = packer.launch(glue, step, data, whole[0], self._whole_out[whole], self.loop_tokens)
            self._plan_whole(whole, step.qo_indptr.numpy(), step.kv_indptr.numpy(), step.last_page_len.numpy(),
                             num_decode)
            self._mark_replay()
            logits, greedy = self._whole_graphs().replay(whole)
            return logits, greedy, inputs
        if padded_tokens:
            return self._glue_piecewise(glue, step, data, padded_tokens, num_decode)
        out = eager_buffers(step.num_tokens, len(rows), step.num_pages, self.device)
        inputs = packer.launch(glue, step, data, step.num_tokens, out, self.loop_tokens)
        attend = self._eager_attend(step, num_decode)
        self._mark_replay()
        logits = self.forward(out.tokens, out.positions, out.kv_slots, out.logits_index, attend)
        return logits, self.forward.greedy(logits), inputs

    def _glue_graph(self, glue: KeyGlue, step: GlueStep, data: torch.Tensor, batch: int
                    ) -> tuple[torch.Tensor, torch.Tensor, RowInputs]:
        """The decode graph of `batch` rows: `pack_step` writes its inputs and the decode wrapper's
        index buffers in place, FlashInfer (not the Triton kernel) plans from the host's CSR arrays, the graph
        replays."""
        graphs, attention, packer = self.graphs, self.attention, self.packer
        assert graphs is not None and attention is not None and packer is not None, "bucket() picks a captured graph"
        inputs = packer.launch(glue, step, data, batch, self._graph_out[batch], self.loop_tokens)
        self._plan_decode_graph(batch, step)
        self._mark_replay()
        graphs.replay(batch)
        return graphs.logits[batch], graphs.greedy[batch], inputs

    def _plan_decode_graph(self, batch: int, indices: "Indices") -> None:
        """The decode graph's FlashInfer plan for this step, after the previous plan's copies; a
        graph on the Triton kernel plans nothing, so it neither waits nor records."""
        attention = self.attention
        assert attention is not None, "a decode graph is captured with its attention"
        if attention.plans_decode(batch):
            self._wait_previous_inputs()
            attention.plan_decode(batch, indices)
            self._planned()

    def _glue_piecewise(self, glue: KeyGlue, step: GlueStep, data: torch.Tensor, bucket: int, num_decode: int
                        ) -> tuple[torch.Tensor, torch.Tensor, RowInputs]:
        """The piecewise graphs of a token bucket: `pack_step` writes the bucket's inputs in place
        and the step's page index arrays into fresh buffers its eager attention reads."""
        pieces, attention, packer = self.piecewise, self.attention, self.packer
        assert pieces is not None and attention is not None and packer is not None, "token_bucket() picks a bucket"
        views = self._piecewise_out[bucket]
        index_arrays = eager_buffers(0, step.num_rows, step.num_pages, self.device)
        out = PackBuffers(views.tokens, views.positions, views.kv_slots, views.qo_indptr, index_arrays.kv_indptr,
                          index_arrays.kv_indices, index_arrays.kv_last_page_len, views.logits_index)
        inputs = packer.launch(glue, step, data, bucket, out, self.loop_tokens)
        self._wait_previous_inputs()
        planned = attention.plan_eager(step, num_decode)
        self._planned()
        self._mark_replay()
        logits, greedy = pieces.replay(bucket, step.num_tokens, planned.run)
        return logits, greedy, inputs

    def _whole_graphs(self) -> "PackedGraphs":
        assert self.packed_graphs is not None, "whole_key() picks a key only once captured"
        return self.packed_graphs

    def _planned(self) -> None:
        """After a plan: the event the next plan waits for (FlashInfer copies its pinned plan buffer
        asynchronously)."""
        self._inputs_copied = self._record() if self.is_cuda else None

    def _sampling_tensors(self, sampling: SamplingRows) -> list[torch.Tensor]:
        arrays = (sampling.temperature, sampling.top_p, sampling.seeds, sampling.counters, sampling.top_k)
        return [self._moved(a) for a in arrays]

    def _moved(self, array: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(array)).to(self.device, non_blocking=True)

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

    def collect_logprobs(self, pending: Pending) -> dict[int, TokenLogprobs]:
        """The step's log-probabilities by the caller's row index (the rows that asked); call after
        `collect`, which waits for the step."""
        if pending.logprobs is None:
            return {}
        rows, counts, chosen, values, ids = pending.logprobs
        found = as_token_logprobs(chosen.tolist(), values.tolist(), ids.tolist(), counts)
        order = pending.order
        return {(order[row] if order is not None else row): row_logprobs for row, row_logprobs in zip(rows, found)}


def _spans(rows: list[RowSpec], order: Optional[list[int]], scoring: Sequence[int]) -> dict[int, tuple[int, int]]:
    """Each scored row's token span in an eager step's positions (rows laid out one after another
    in launch order), by the caller's row index."""
    wanted = set(scoring)
    spans: dict[int, tuple[int, int]] = {}
    start = 0
    for position, row in enumerate(rows):
        caller = order[position] if order is not None else position
        if caller in wanted:
            spans[caller] = (start, start + row.num_tokens)
        start += row.num_tokens
    return spans


def path_of(batch: int, whole: Optional[tuple[int, int, str]], padded_tokens: int) -> str:
    """How `launch` ran a step, for the step events: the decode graph of `batch` rows, a whole packed
    graph (its token bucket, rows and route), the piecewise graphs of a token bucket, or eagerly."""
    if batch:
        return f"decode graph {batch}"
    if whole:
        return f"whole {whole[0]}x{whole[1]} {whole[2]}"
    return f"piecewise {padded_tokens}" if padded_tokens else "eager"


def _padded_row_fields(packed: PackedStep, offset: int, rows: int) -> np.ndarray:
    """The numpy packing's host array with its two row fields (last-token index, row slot) widened
    to a graph's `rows` row entries: the real rows' values, then zeros (token 0, slot 0). `offset`:
    where the row fields start (after the token fields)."""
    num_rows = packed.num_rows
    host = np.zeros(offset + 2 * rows, dtype=np.int32)
    host[:offset] = packed.host[:offset]
    host[offset:offset + num_rows] = packed.host[offset:offset + num_rows]
    host[offset + rows:offset + rows + num_rows] = packed.host[offset + num_rows:offset + 2 * num_rows]
    return host
