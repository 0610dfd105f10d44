"""`mstar run --gpu-profile TRACE.json`: how much of a run the GPU sat idle, from a torch profiler trace.

In: the run, wrapped in `profiled(path)` (torch.profiler, CUDA activity only, so the host side
costs little); out: a Chrome trace at `path` (open it in Perfetto or chrome://tracing) and
`idle_summary(path)`: the device's busy time (the union of its kernel, copy and set intervals)
against the span from its first to its last, for the whole run, for its middle half (the steady
state, without start-up and the tail where rows drain) and for each tenth of the span, plus the
gaps between device work longer than `GAP_US` (each one a place where the device waited for the host).
"""
from __future__ import annotations

import contextlib
import json
from typing import Any, Iterator

GAP_US = 20.0  # a gap shorter than this is a launch's own latency, not the host holding the device
DEVICE_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")


@contextlib.contextmanager
def profiled(path: str) -> Iterator[None]:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        yield
    prof.export_chrome_trace(path)


def device_intervals(trace: dict[str, Any]) -> list[tuple[float, float]]:
    """(start, end) in microseconds of every device event, merged where they overlap, in order."""
    raw = sorted((float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0.0)))
                 for e in trace.get("traceEvents", [])
                 if e.get("ph") == "X" and e.get("cat") in DEVICE_CATEGORIES)
    merged: list[tuple[float, float]] = []
    for start, end in raw:
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged


def _window(intervals: list[tuple[float, float]], lo: float, hi: float) -> dict[str, float]:
    busy = sum(max(0.0, min(end, hi) - max(start, lo)) for start, end in intervals)
    gaps = [b[0] - a[1] for a, b in zip(intervals, intervals[1:]) if lo <= a[1] and b[0] <= hi]
    long_gaps = [g for g in gaps if g > GAP_US]
    span = max(hi - lo, 1e-9)
    return {"span_ms": round(span / 1e3, 3), "busy_ms": round(busy / 1e3, 3),
            "idle_pct": round(100.0 * (1.0 - busy / span), 2), "num_gaps_over_20us": len(long_gaps),
            "gaps_over_20us_ms": round(sum(long_gaps) / 1e3, 3)}


def idle_summary(path: str) -> dict[str, Any]:
    with open(path) as handle:
        intervals = device_intervals(json.load(handle))
    if not intervals:
        return {"error": "the trace holds no device work"}
    first, last = intervals[0][0], intervals[-1][1]
    quarter, tenth = (last - first) / 4, (last - first) / 10
    return {"whole_run": _window(intervals, first, last),
            "middle_half": _window(intervals, first + quarter, last - quarter),
            # where in the run the device waited: start-up, prefill waves, the steady decode, the tail
            "idle_pct_by_tenth": [_window(intervals, first + i * tenth, first + (i + 1) * tenth)["idle_pct"]
                                  for i in range(10)]}


def summary_line(summary: dict[str, Any]) -> str:
    if "error" in summary:
        return f"gpu profile: {summary['error']}"
    whole, middle = summary["whole_run"], summary["middle_half"]
    return (f"gpu profile: idle {whole['idle_pct']}% of {whole['span_ms']} ms (middle half: idle "
            f"{middle['idle_pct']}%, {middle['num_gaps_over_20us']} gaps over {GAP_US:.0f} us "
            f"adding to {middle['gaps_over_20us_ms']} ms)")
