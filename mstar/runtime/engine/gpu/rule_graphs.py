"""fla's chunked gated delta rule over an eager or piecewise step's prompt rows, captured as a CUDA
graph on the step's first gated delta-net layer and replayed by its later ones.

Why: a hybrid step waits on its host, and most of the host's time was fla's Python (docs/engine.md:
some 10 Triton launches a call through the JIT and its autotuners, 18 calls a step of Qwen3.5),
while every layer of one step calls fla on the same token layout (the step's `cu_seqlens`); only the
values differ. So a step captures the call once into a CUDA graph, and that call and every later
one replay it: one graph launch instead of fla's Python.

What a capture needs: fla's kernels tuned and compiled (their autotuners time configurations on
the first call at a shape, and Triton compiles a variant for each specialization of the counts a
kernel takes, neither of which a capture can hold: so the engine's first call of each kernel
variant runs fla as it is, `_kernel_variant`, and its step captures on its second call), and no
host work inside the call. fla derives the chunk indices of a layout from `cu_seqlens` (on the
host, from `cu_seqlens_cpu`, then copied to the device); each step computes them once here
(`chunk_indices`, the [chunks, 2] (row, chunk) pairs fla's `prepare_chunk_indices` makes) and passes
them to every call of the step, so the capture derives only what device ops derive (the chunk
offsets). Before, every step's first call ran fla as it is to fill fla's identity caches for that
step's `cu_seqlens` (the A/B in docs/engine.md, "The rule as a CUDA graph a step").

An input that lies where the step's graph (or, on a step's first call, the previous step's graph)
read it in place is read in place: the step's conv output buffer and a piecewise step's gates in
the handover (`gdn_forward.py`, `piecewise.py`) stay put from step to step; the others are copied
into buffers of the graph's own before each replay. A later call whose in-place input lies
elsewhere is captured again with that input copied instead (a step's graphs then number two or
more; each call is checked, so no graph reads a stale address).

Steps over `MAX_TOKENS` prompt tokens run fla as it is: their kernels outlast the host's launches,
and the graph's pool would hold their intermediates. The graphs share one memory pool; a step's
graph is replayed only while its step runs (stream order on the step's stream), and it is kept
alive until the device is past its last replay. The graph reads the step's `cu_seqlens` and chunk
indices, which the step holds for all its calls. A capture that fails (a kernel fla could not
launch under capture) turns the graphs off for this engine and the step runs fla as it is.
"""

from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass
from typing import Any, Callable, Optional

import numpy as np
import torch

__all__ = ["MAX_TOKENS", "PromptRuleGraphs", "RuleCall", "StepRule", "chunk_indices", "set_enabled"]

log = logging.getLogger(__name__)

_why_off: Optional[str] = None  # why rule graphs built from now on start off (a what-if), None: on


def set_enabled(enabled: bool) -> None:
    """Let the rule graphs built afterwards capture (the default), or never (fla in every layer:
    `mstar bench engine --no-rule-graphs`, the what-if beside them)."""
    global _why_off
    _why_off = None if enabled else "turned off (--no-rule-graphs)"

# Prompt tokens of a step up to which the rule is graphed. A judgement, not a measured crossover:
# the 16 x 1024-token prefill is bound by its kernels, not its launches (docs/engine.md), and the
# pool keeps the largest graphed step's intermediates (the chunks' fp32 states: 2048 tokens of
# Qwen3.5 hold 32 chunks of 16 heads' 128 x 128 states, 32 MB).
MAX_TOKENS = 2048
CHUNK_SIZE = 64  # fla's chunk for the gated delta rule (its default, which the calls keep)


def chunk_indices(cu_cpu: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """The (row, chunk) pairs of a layout's chunks, `[chunks, 2]` in `like`'s dtype and device: what
    fla's `prepare_chunk_indices(cu_seqlens, 64, cu_seqlens_cpu=...)` derives, from the host's
    `cu_seqlens` (no device sync)."""
    bounds = cu_cpu.numpy().astype(np.int64)
    lengths = bounds[1:] - bounds[:-1]
    counts = (lengths + CHUNK_SIZE - 1) // CHUNK_SIZE
    rows = np.repeat(np.arange(counts.shape[0]), counts)
    starts = np.concatenate([[0], np.cumsum(counts)[:-1]])
    pairs = np.stack([rows, np.arange(rows.shape[0]) - starts[rows]], 1)
    return torch.from_numpy(pairs).to(device=like.device, dtype=like.dtype)


@dataclass
class RuleCall:
    """One call of the rule: fla's kernel and its arguments (q, k, v `[T, H, d]`, g and beta `[T,
    HV]`, the rows' initial states: rows `read` of `states`) and the step's `cu_seqlens` on the device
    and the host."""

    kernel: Callable
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    g: torch.Tensor
    beta: torch.Tensor
    states: torch.Tensor
    read: torch.Tensor
    cu: torch.Tensor
    cu_cpu: torch.Tensor
    chunks: Optional[torch.Tensor] = None  # the layout's chunk indices (`chunk_indices`), None: fla derives them

    def run(self, inputs: Optional[tuple[torch.Tensor, ...]] = None):
        """fla over this call's tensors (or `inputs`, buffers of the same shapes) -> (out `[1, T, HV,
        d_v]`, final states)."""
        q, k, v, g, beta, initial = inputs or (self.q.unsqueeze(0), self.k.unsqueeze(0), self.v.unsqueeze(0),
                                               self.g.unsqueeze(0), self.beta.unsqueeze(0), self.states[self.read])
        given = {} if self.chunks is None else {"chunk_indices": self.chunks}
        return self.kernel(q, k, v, g=g, beta=beta, initial_state=initial, output_final_state=True,
                           use_qk_l2norm_in_kernel=True, cu_seqlens=self.cu,
                           # the host copy spares fla a device sync to count chunks
                           cu_seqlens_cpu=self.cu_cpu, **given)

    def values(self) -> tuple[torch.Tensor, ...]:
        """q, k, v, g and beta: the inputs a graph may read in place."""
        return self.q, self.k, self.v, self.g, self.beta

    def layouts(self) -> tuple[tuple, ...]:
        """Where and how each of `values` lies: what a graph that reads it in place depends on."""
        return tuple((t.data_ptr(), tuple(t.shape), t.stride(), t.dtype) for t in self.values())

    def load(self, captured: "_Captured") -> None:
        """This call's values into the graph's input buffers (one launch each; none for the values it
        reads in place), and the rows' initial states."""
        for buffer, value in zip(captured.buffers, self.values()):
            if buffer is not None:
                buffer[0].copy_(value)
        torch.index_select(self.states, 0, self.read, out=captured.initial)


@dataclass
class _Captured:
    """A step's graph: its input buffers (none for a value it reads in place: `fixed` holds where that
    lay; the graph keeps no reference to it, so a later call's value can lie there), the initial
    states' buffer, its outputs (in the pool) and an event after its last replay."""

    graph: torch.cuda.CUDAGraph
    buffers: tuple[Optional[torch.Tensor], ...]  # None where the graph reads the value in place
    initial: torch.Tensor
    fixed: tuple[Optional[tuple], ...]
    out: torch.Tensor
    final: torch.Tensor
    replayed: torch.cuda.Event

    def reads_in_place(self, layouts: tuple[tuple, ...]) -> bool:
        """Whether every value this graph reads in place lies where it did at capture."""
        return all(fixed is None or fixed == layout for fixed, layout in zip(self.fixed, layouts))


class PromptRuleGraphs:
    """The rule graphs of one engine's gated delta-net layers (module docstring)."""

    def __init__(self) -> None:
        self.why_off = _why_off  # None while the graphs capture
        self.num_captured = 0
        self.num_replayed = 0
        self.num_as_is = 0  # calls that ran fla as it is (a new kernel variant, past the bound, graphs off)
        self._pool: Any = None  # torch.cuda.graph_pool_handle() on the first capture
        self._stream: Optional[torch.cuda.Stream] = None
        self._live: deque[_Captured] = deque()  # captured graphs the device may still be replaying
        self._tuned: set[tuple] = set()  # the kernel variants fla has run as it is (`_kernel_variant`)
        self._fixed: tuple[Optional[tuple], ...] = ()  # what the latest graph read in place (`_Captured.fixed`)

    def __call__(self, call: RuleCall, step: "StepRule") -> tuple[torch.Tensor, torch.Tensor]:
        """fla over `call`, the `step.calls`-th call of its step -> (out `[1, T, HV, d_v]`, final states)."""
        step.calls += 1
        if self.why_off is not None or not call.q.is_cuda or call.q.shape[0] > MAX_TOKENS:
            return self._as_is(call)
        if step.chunks is None:  # the step's layer calls share the layout, and so the kernel variant
            step.chunks = chunk_indices(call.cu_cpu, call.cu)
            step.variant = _kernel_variant(call, step.chunks)
        call.chunks = step.chunks
        layouts = call.layouts()
        if step.variant not in self._tuned:  # fla tunes and compiles its kernels for it; the next call captures
            self._tuned.add(step.variant)
            self._fixed = layouts
            return self._as_is(call)
        if step.captured is None or not step.captured.reads_in_place(layouts):
            # In place: what lies where the step's graph read it (a capture again), or on the step's
            # first call where the latest graph read it (a step's buffers stay put from step to step).
            before = step.captured.fixed if step.captured is not None else self._fixed or (None,) * len(layouts)
            step.captured = self._capture(call, tuple(f if f == now else None for f, now in zip(before, layouts)))
            if step.captured is None:
                return self._as_is(call)
            self._fixed = step.captured.fixed
        captured = step.captured
        call.load(captured)
        captured.graph.replay()
        captured.replayed.record()
        self.num_replayed += 1
        return captured.out, captured.final

    def _as_is(self, call: RuleCall) -> tuple[torch.Tensor, torch.Tensor]:
        self.num_as_is += 1
        return call.run()

    def _capture(self, call: RuleCall, fixed: tuple[Optional[tuple], ...]) -> Optional[_Captured]:
        """The call captured reading in place the values `fixed` gives a layout for and the others
        from new buffers, or None (and the graphs off) when it cannot be."""
        self._retire()
        buffers = tuple(None if layout is not None else torch.empty((1, *t.shape), dtype=t.dtype, device=t.device)
                        for t, layout in zip(call.values(), fixed))
        initial = call.states.new_empty((call.read.shape[0], *call.states.shape[1:]))
        inputs = tuple(t.unsqueeze(0) if buffer is None else buffer for t, buffer in zip(call.values(), buffers))
        if self._stream is None:
            self._stream, self._pool = torch.cuda.Stream(), torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        self._stream.wait_stream(torch.cuda.current_stream())  # the buffers were made on the step's stream
        try:
            with torch.cuda.stream(self._stream):
                graph.capture_begin(pool=self._pool, capture_error_mode="thread_local")
                try:
                    out, final = call.run((*inputs, initial))
                finally:
                    graph.capture_end()
        except Exception as error:  # noqa: BLE001 (any failure to capture falls back to fla as it is)
            self.why_off = f"a capture failed: {error}"
            log.warning("the prompt rule runs without CUDA graphs from now on: %s", self.why_off)
            return None
        torch.cuda.current_stream().wait_stream(self._stream)
        captured = _Captured(graph, buffers, initial, fixed, out, final, torch.cuda.Event())
        self._live.append(captured)
        self.num_captured += 1
        return captured

    def _retire(self) -> None:
        """Drop the graphs the device is past (the latest stays: it keeps the pool in use)."""
        while len(self._live) > 1 and self._live[0].replayed.query():
            self._live.popleft()


def _kernel_variant(call: RuleCall, chunks: torch.Tensor) -> tuple:
    """What selects the variants of fla's kernels a call launches: the inputs' shapes past the token
    axis and dtypes (its autotuners' keys), and how Triton specializes the tokens, rows and chunks
    counts its kernels take (one, a multiple of 16, other). A variant fla has not run yet would tune
    or compile inside a capture: such a call runs fla as it is."""
    def specialized(n: int) -> tuple[bool, bool]:
        return n == 1, n % 16 == 0

    counts = (call.q.shape[0], call.cu_cpu.shape[0] - 1, chunks.shape[0])
    return (tuple((t.shape[1:], t.dtype) for t in call.values()), tuple(map(specialized, counts)))


@dataclass
class StepRule:
    """One step's share of the rule graphs: how many calls it made, its graph, its layout's chunk
    indices (`chunk_indices`, which its graph reads) and the kernel variant of its calls
    (`_kernel_variant`)."""

    calls: int = 0
    captured: Optional[_Captured] = None
    chunks: Optional[torch.Tensor] = None
    variant: tuple = ()
