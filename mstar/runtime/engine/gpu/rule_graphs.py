"""fla's chunked gated delta rule over an eager step's prompt rows, captured once a step and
replayed by the step's later gated delta-net layers.

Why: an eager hybrid step waits on its host, and most of the host's time is fla's Python
(docs/engine.md: some 10 Triton launches a call through the JIT and its autotuners, 18 calls a step
of Qwen3.5), while every layer of one step calls fla on the same token layout (the step's
`cu_seqlens`); only the values differ. So the step's first call runs fla as it is (that call tunes
its kernels for these shapes and caches the chunk indices of this `cu_seqlens`, so nothing in a
capture tunes or copies from the host), the second captures the call into a CUDA graph over input
buffers of its own, and that call and every later one copy their inputs into those buffers and
replay the graph: a few copies and one graph launch instead of fla's Python.

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

__all__ = ["MAX_TOKENS", "PromptRuleGraphs", "RuleCall", "StepRule"]

log = logging.getLogger(__name__)

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

    def load(self, buffers: tuple[torch.Tensor, ...]) -> None:
        """Copy this call's tensors into a graph's input buffers (one launch each)."""
        for buffer, value in zip(buffers, (self.q, self.k, self.v, self.g, self.beta)):
            buffer[0].copy_(value)
        torch.index_select(self.states, 0, self.read, out=buffers[5])


@dataclass
class _Captured:
    """A step's graph: its input buffers, its outputs (in the pool) and an event after its last replay."""

    graph: torch.cuda.CUDAGraph
    inputs: tuple[torch.Tensor, ...]
    out: torch.Tensor
    final: torch.Tensor
    replayed: torch.cuda.Event


class PromptRuleGraphs:
    """The rule graphs of one engine's gated delta-net layers (module docstring)."""

    def __init__(self) -> None:
        self.enabled = True
        self.num_captured = 0
        self.num_replayed = 0
        self._pool: Any = None  # torch.cuda.graph_pool_handle() on the first capture
        self._stream: Optional[torch.cuda.Stream] = None
        self._live: deque[_Captured] = deque()  # captured graphs the device may still be replaying

    def __call__(self, call: RuleCall, step: "StepRule") -> tuple[torch.Tensor, torch.Tensor]:
        """fla over `call`, the `step.calls`-th call of its step -> (out `[1, T, HV, d_v]`, final states)."""
        step.calls += 1
        graphed = self.enabled and call.q.is_cuda and call.q.shape[0] <= MAX_TOKENS
        if step.captured is None and (step.calls == 1 or not graphed):
            return call.run()
        if step.captured is None:
            step.captured = self._capture(call)
            if step.captured is None:
                return call.run()
        captured = step.captured
        call.load(captured.inputs)
        captured.graph.replay()
        captured.replayed.record()
        self.num_replayed += 1
        return captured.out, captured.final

    def _capture(self, call: RuleCall) -> Optional[_Captured]:
        """The call captured over new input buffers, or None (and the graphs off) when it cannot be."""
        self._retire()
        inputs = tuple(torch.empty((1, *t.shape), dtype=t.dtype, device=t.device)
                       for t in (call.q, call.k, call.v, call.g, call.beta))
        inputs += (call.states.new_empty((call.read.shape[0], *call.states.shape[1:])),)
        if self._stream is None:
            self._stream, self._pool = torch.cuda.Stream(), torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        self._stream.wait_stream(torch.cuda.current_stream())  # the buffers were made on the step's stream
        try:
            with torch.cuda.stream(self._stream):
                graph.capture_begin(pool=self._pool, capture_error_mode="thread_local")
                try:
                    out, final = call.run(inputs)
                finally:
                    graph.capture_end()
        except Exception as error:  # noqa: BLE001 (any failure to capture falls back to fla as it is)
            self.enabled = False
            log.warning("the prompt rule runs without CUDA graphs from now on: its capture failed (%s)", error)
            return None
        torch.cuda.current_stream().wait_stream(self._stream)
        captured = _Captured(graph, inputs, out, final, torch.cuda.Event())
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
