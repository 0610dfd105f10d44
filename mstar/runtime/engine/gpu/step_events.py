"""`mstar run --gpu-idle`: the device's idle time between steps, from CUDA events, no profiler.

A profiler trace (`--gpu-profile`) sees every kernel, but tracing costs the host time on every
launch: on the H200 a decode graph's `cudaGraphLaunch` took 210-350 us of host time under it, so a
run whose host keeps barely ahead of the device falls behind under the profiler, and the trace
shows idle time the run without it does not have. Here each step an executor launches records one
timing event before its first device work (the copy of its inputs) and one after its last (the
copy of its sampled ids, which is also the event `collect` waits for). The executor's steps run on
one stream in launch order, so step N+1's first event passes once N's last has passed and the
host has issued N+1's first work: the time between the two is the device waiting for the host
between steps, and nothing else. Idle inside a step (between its own copy, pack kernel, planning
and graph launch) is step time here; `--gpu-profile` shows it.

In: `StepEvents.begin()` at a launch's start, `replay()` just before its graph replay or eager
forward, `end(begin, rows, tokens, path)` at its end (path: how the executor ran it,
`StepExecutor.path_of`). Out (once the run is over: both wait for the
device): `summary()`, the steps' spans and the gaps between them for the whole run and its middle
half (without start-up and the tail where rows drain); `steps()`, each step's device start, span,
the gap before it, its rows and tokens, its path and the part of its span before its replay
(`mstar bench kv` picks the chunk steps out of them: more tokens than rows).
"""
from __future__ import annotations

from typing import Any, Optional

import torch


class StepEvents:
    def __init__(self) -> None:
        self.pairs: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []
        self.shapes: list[tuple[int, int]] = []  # (rows, tokens) launched, per step
        self.paths: list[str] = []  # how each ran: decode graph, whole or piecewise packed graphs, eager
        self.replays: list[Optional[torch.cuda.Event]] = []  # per step: before its replay (`replay`)
        self._replay: Optional[torch.cuda.Event] = None

    @staticmethod
    def begin() -> torch.cuda.Event:
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def replay(self) -> None:
        """Just before the step's graph replay (or eager forward), once the host has issued the
        step's copies, packing kernels and planning: the device reaches it when that is done and
        the host got there, so the time from the step's first event to it is the device's share of
        those plus its waiting for the host inside the step (a launch ahead whose host work outlasts
        the step before it: docs/runtime.md)."""
        self._replay = torch.cuda.Event(enable_timing=True)
        self._replay.record()

    def end(self, begin: torch.cuda.Event, num_rows: int = 0, num_tokens: int = 0, path: str = "") -> torch.cuda.Event:
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        self.pairs.append((begin, event))
        self.shapes.append((num_rows, num_tokens))
        self.paths.append(path)
        self.replays.append(self._replay)
        self._replay = None
        return event

    def _spans(self) -> list[tuple[float, float]]:
        self.pairs[-1][1].synchronize()
        origin = self.pairs[0][0]
        return [(origin.elapsed_time(begin), origin.elapsed_time(end)) for begin, end in self.pairs]

    def _before_replays(self) -> list[Optional[float]]:
        """Each step's ms from its first event to its replay's (None: a step that marked none)."""
        return [None if replay is None else begin.elapsed_time(replay)
                for (begin, _), replay in zip(self.pairs, self.replays)]

    def summary(self) -> dict[str, Any]:
        if not self.pairs:
            return {"error": "no step ran on the device"}
        return idle_between(self._spans())

    def steps(self) -> list[dict[str, Any]]:
        return step_table(self._spans(), self.shapes, self.paths, self._before_replays()) if self.pairs else []


def attach(engine: Any) -> dict[str, StepEvents]:
    """CUDA events on each step of the engine's device fast-path executors: node -> its `StepEvents`
    (`mstar run --gpu-idle`, `mstar bench kv` on a GPU)."""
    attached = {}
    for node, runner in getattr(engine, "runners", {}).items():
        executor = getattr(runner, "executor", None)
        if executor is not None and executor.is_cuda:
            executor.step_events = attached[node] = StepEvents()
    return attached


def step_table(spans: list[tuple[float, float]], shapes: list[tuple[int, int]],
               paths: Optional[list[str]] = None,
               before_replays: Optional[list[Optional[float]]] = None) -> list[dict[str, Any]]:
    """Each step's device start and span (ms), the gap before it, its rows and tokens, its path, and
    the part of its span before its replay (`StepEvents.replay`; None where unknown)."""
    table = []
    for index, ((start, end), (rows, tokens)) in enumerate(zip(spans, shapes)):
        gap = max(0.0, start - spans[index - 1][1]) if index else 0.0
        before = before_replays[index] if before_replays else None
        table.append({"start_ms": round(start, 3), "span_ms": round(end - start, 3), "gap_before_ms": round(gap, 3),
                      "rows": rows, "tokens": tokens, "path": paths[index] if paths else "",
                      "before_replay_ms": None if before is None else round(before, 3)})
    return table


def idle_between(spans: list[tuple[float, float]]) -> dict[str, Any]:
    """Steps' (start, end) in ms on the device, in launch order -> their gaps, whole and middle half."""
    first, last = spans[0][0], spans[-1][1]
    quarter = (last - first) / 4
    return {"num_steps": len(spans), "whole_run": _window(spans, first, last),
            "middle_half": _window(spans, first + quarter, last - quarter)}


def _window(spans: list[tuple[float, float]], lo: float, hi: float) -> dict[str, Any]:
    gaps = [max(0.0, b[0] - a[1]) for a, b in zip(spans, spans[1:]) if lo <= a[1] and b[0] <= hi]
    span = max(hi - lo, 1e-9)
    return {"span_ms": round(span, 3), "idle_between_steps_ms": round(sum(gaps), 3),
            "idle_between_steps_pct": round(100.0 * sum(gaps) / span, 2),
            "num_gaps_over_20us": sum(1 for g in gaps if g > 0.02),
            "largest_gap_ms": round(max(gaps, default=0.0), 3)}


def summary_line(node: str, summary: dict[str, Any]) -> str:
    if "error" in summary:
        return f"gpu idle ({node}): {summary['error']}"
    whole, middle = summary["whole_run"], summary["middle_half"]
    return (f"gpu idle between steps ({node}, CUDA events, {summary['num_steps']} steps): "
            f"{whole['idle_between_steps_pct']}% of {whole['span_ms']} ms (middle half: "
            f"{middle['idle_between_steps_pct']}%, {middle['num_gaps_over_20us']} gaps over 20 us, "
            f"largest {middle['largest_gap_ms']} ms)")
