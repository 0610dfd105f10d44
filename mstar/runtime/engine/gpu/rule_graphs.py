"""fla's chunked gated delta rule over an eager step's prompt rows, captured once a step and
replayed by the step's later gated delta-net layers.

Why: an eager hybrid step waits on its host, and most of the host's time is fla's Python
(docs/engine.md: some 10 Triton launches a call through the JIT and its autotuners, 18 calls a step
of Qwen3.5), while every layer of one step calls fla on the same token layout (the step's
`cu_seqlens`); only the values differ. So the step's first call runs fla as it is (that call tunes
its kernels for these shapes and caches the chunk indices of this `cu_seqlens`, so nothing in a
capture tunes or copies from the host), the second captures the call into a CUDA graph, and that
call and every later one replay it: one graph launch instead of fla's Python. An input that lay at
the same address, shape and strides in the first two calls (the step's conv output buffer, a
piecewise step's gates in the handover: `gdn_forward.py`, `piecewise.py`) is read in place; the
others are copied into buffers of the graph's own before each replay. A later call whose in-place
input lies elsewhere is captured again with that input copied instead (a step's graphs then number
two or more; each call is checked, so no graph reads a stale address).

Steps over `MAX_TOKENS` prompt tokens run fla as it is: their kernels outlast the host's launches,
and the graph's pool would hold their intermediates. The graphs share one memory pool; a step's
graph is replayed only while its step runs (stream order on the step's stream), and it is kept
alive until the device is past its last replay. The graph reads the step's `cu_seqlens` and the
chunk indices fla derived from it, which fla's identity caches hold (its last few argument tuples a
helper): every call of a step passes the same two tensors, so nothing evicts them mid-step. A
capture that fails (a kernel fla could not
launch under capture) turns the graphs off for this engine and the step runs fla as it is.
"""

from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch

__all__ = ["MAX_TOKENS", "PromptRuleGraphs", "RuleCall", "StepRule", "set_enabled"]

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

    def run(self, inputs: Optional[tuple[torch.Tensor, ...]] = None):
        """fla over this call's tensors (or `inputs`, buffers of the same shapes) -> (out `[1, T, HV,
        d_v]`, final states)."""
        q, k, v, g, beta, initial = inputs or (self.q.unsqueeze(0), self.k.unsqueeze(0), self.v.unsqueeze(0),
                                               self.g.unsqueeze(0), self.beta.unsqueeze(0), self.states[self.read])
        return self.kernel(q, k, v, g=g, beta=beta, initial_state=initial, output_final_state=True,
                           use_qk_l2norm_in_kernel=True, cu_seqlens=self.cu,
                           # the host copy spares fla a device sync to count chunks
                           cu_seqlens_cpu=self.cu_cpu)

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
        self._pool: Any = None  # torch.cuda.graph_pool_handle() on the first capture
        self._stream: Optional[torch.cuda.Stream] = None
        self._live: deque[_Captured] = deque()  # captured graphs the device may still be replaying

    def __call__(self, call: RuleCall, step: "StepRule") -> tuple[torch.Tensor, torch.Tensor]:
        """fla over `call`, the `step.calls`-th call of its step -> (out `[1, T, HV, d_v]`, final states)."""
        step.calls += 1
        graphed = self.why_off is None and call.q.is_cuda and call.q.shape[0] <= MAX_TOKENS
        if step.captured is None and (step.calls == 1 or not graphed):
            step.first = call.layouts() if graphed else None
            return call.run()
        layouts = call.layouts()
        if step.captured is None or not step.captured.reads_in_place(layouts):
            # In place: what lay where it did in the step's first call (first capture), or still
            # lies where the step's graph read it (a capture again).
            before = step.captured.fixed if step.captured is not None else step.first or (None,) * len(layouts)
            step.captured = self._capture(call, tuple(f if f == now else None for f, now in zip(before, layouts)))
            if step.captured is None:
                return call.run()
        captured = step.captured
        call.load(captured)
        captured.graph.replay()
        captured.replayed.record()
        self.num_replayed += 1
        return captured.out, captured.final

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


@dataclass
class StepRule:
    """One eager step's share of the rule graphs: how many calls it made, and its graph."""

    calls: int = 0
    captured: Optional[_Captured] = None
    first: Optional[tuple[tuple, ...]] = None  # the layouts of the step's first call's values (graphed calls)
