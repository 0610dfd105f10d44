"""`mstar run --gpu-profile TRACE.json`: how much of a run the GPU sat idle, from a torch profiler trace.

In: the run, wrapped in `profiled(path)` (torch.profiler, CUDA activity only, so the host side
costs little); out: a Chrome trace at `path` (open it in Perfetto or chrome://tracing) and
`idle_summary(path)`: the device's busy time (the union of its kernel, copy and set intervals)
against the span from its first to its last, for the whole run, for its middle half (the steady
state, without start-up and the tail where rows drain) and for each tenth of the span, plus the
gaps between device work longer than `GAP_US` (each one a place where the device waited for the host).

Idle time is split by where it falls. A gap between two pieces of work of one launch (the kernels
of one CUDA graph replay share the graph launch's correlation id) is the device's own latency
from one graph node to the next: part of the step, nothing the host could fill. A gap between
work of two launches (a copy, a glue kernel, the next graph) is the device waiting for the host's
next launch, or the launch's own latency: what "idle between steps" means.
"""
from __future__ import annotations

import contextlib
import json
from typing import Any, Iterator, NamedTuple

GAP_US = 20.0  # a gap shorter than this is a launch's own latency, not the host holding the device
DEVICE_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")


@contextlib.contextmanager
def profiled(path: str) -> Iterator[None]:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        yield
    prof.export_chrome_trace(path)


class Interval(NamedTuple):
    """Merged device work: its span, and the launches (correlation ids) it starts and ends with."""
    start: float
    end: float
    first_launch: Any
    last_launch: Any


def device_work(trace: dict[str, Any]) -> list[Interval]:
    """Every device event, merged where they overlap, in order (times in microseconds)."""
    raw = sorted((float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0.0)), e.get("args", {}).get("correlation"))
                 for e in trace.get("traceEvents", [])
                 if e.get("ph") == "X" and e.get("cat") in DEVICE_CATEGORIES)
    merged: list[Interval] = []
    for start, end, launch in raw:
        if merged and start <= merged[-1].end:
            last = merged[-1]
            merged[-1] = last._replace(end=end, last_launch=launch) if end > last.end else last
        else:
            merged.append(Interval(start, end, launch, launch))
    return merged


def device_intervals(trace: dict[str, Any]) -> list[tuple[float, float]]:
    """(start, end) in microseconds of every device event, merged where they overlap, in order."""
    return [(work.start, work.end) for work in device_work(trace)]


def _window(intervals: list[Interval], lo: float, hi: float) -> dict[str, float]:
    busy = sum(max(0.0, min(work.end, hi) - max(work.start, lo)) for work in intervals)
    pairs = [(a, b) for a, b in zip(intervals, intervals[1:]) if lo <= a.end and b.start <= hi]
    # a launch id of None (a trace without correlation ids) counts as another launch
    inside = sum(b.start - a.end for a, b in pairs if a.last_launch is not None and a.last_launch == b.first_launch)
    between = [b.start - a.end for a, b in pairs if a.last_launch is None or a.last_launch != b.first_launch]
    long_gaps = [g for g in between if g > GAP_US]
    span = max(hi - lo, 1e-9)
    return {"span_ms": round(span / 1e3, 3), "busy_ms": round(busy / 1e3, 3),
            "idle_pct": round(100.0 * (1.0 - busy / span), 2),
            "idle_between_launches_pct": round(100.0 * sum(between) / span, 2),
            "idle_inside_launches_pct": round(100.0 * inside / span, 2),
            "num_gaps_over_20us": len(long_gaps), "gaps_over_20us_ms": round(sum(long_gaps) / 1e3, 3)}


def idle_summary(path: str) -> dict[str, Any]:
    with open(path) as handle:
        intervals = device_work(json.load(handle))
    if not intervals:
        return {"error": "the trace holds no device work"}
    first, last = intervals[0].start, intervals[-1].end
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
    return (f"gpu profile: idle {whole['idle_pct']}% of {whole['span_ms']} ms, "
            f"{whole['idle_between_launches_pct']}% between launches (middle half: idle {middle['idle_pct']}%, "
            f"{middle['idle_between_launches_pct']}% between launches and {middle['idle_inside_launches_pct']}% "
            f"inside graph launches; {middle['num_gaps_over_20us']} gaps over {GAP_US:.0f} us "
            f"adding to {middle['gaps_over_20us_ms']} ms)")
