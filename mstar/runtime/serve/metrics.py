"""Run metrics: a columnar log of steps, and the summary of a run.

In: the driver's launches (`StepLog.add`) and the conductor's request records. Out:
`summarize(...) -> dict` (the --report JSON), `render_table(summary)` (a rich table).

Times: `*_s` fields are run-clock seconds (simulated seconds under the sim engine, wall seconds
under a real one); scheduler and postprocess times are host wall time on this machine.
TTFT = first output token (or first client emission) - arrival; inter-token latency = gaps
between a request's successive token events. A percentile with no sample (no request produced
a token) is None in the summary and "-" in the table.

Finish reasons: the summary's `finish_reasons` counts each full reason text; `finish_kinds`
counts them by kind (the text before the first ':', e.g. "error"); `failed_requests` maps each
failed request's id to its full reason. The table shows the kinds;
`error_lines` lists the distinct failure texts (one line each, counted) for stderr.
"""
from __future__ import annotations

from collections import Counter
from operator import attrgetter
from typing import Any, Iterable, Optional

import numpy as np

from mstar.runtime.conductor.request import RequestRecord

# Per-row fields read in C (map), so a step's log entry costs no Python work per row.
_walk_of = attrgetter("walk")
_tokens_of = attrgetter("num_tokens")


class StepLog:
    """One entry per step run (TP follower copies included), as parallel lists."""

    def __init__(self) -> None:
        self.worker: list[int] = []
        self.start_s: list[float] = []
        self.end_s: list[float] = []
        self.key: list[str] = []
        self.num_rows: list[int] = []
        self.num_tokens: list[int] = []
        self.walk_rows: list[dict[str, int]] = []
        self.sched_s: list[float] = []
        self.post_s: list[float] = []
        self.is_speculative: list[bool] = []
        self.is_follower: list[bool] = []
        self.is_captured: list[bool] = []
        self.is_oom: list[bool] = []  # some row failed allocation
        self.num_held_rows: list[int] = []  # rows that failed allocation (held and retried)
        self.held_requests: set[str] = set()  # the requests any of those rows was of
        # host seconds around the step (Launch.launch_s, wait_s) and the collector's passes the
        # run loop made since the step logged before it (Driver._collect)
        self.launch_s: list[float] = []
        self.wait_s: list[float] = []
        self.gc_s: list[float] = []

    def __len__(self) -> int:
        return len(self.key)

    def add(self, launch: Any, post_s: float, end_s: float, gc_s: float = 0.0) -> None:
        batch = launch.batch
        step = launch.step
        self.worker.append(launch.worker)
        self.start_s.append(launch.start_s)
        self.end_s.append(end_s)
        self.key.append(batch.key)
        # Rows the engine ran: a partial step leaves out its allocation_failed rows (held and
        # retried, logged again in the step that runs them).
        rows = launch.ran_rows
        walks = list(map(_walk_of, rows)) if step is not None else batch.walks
        self.num_rows.append(len(walks))
        self.num_tokens.append(sum(map(_tokens_of, rows)) if step is not None else batch.total_tokens)
        self.walk_rows.append(dict(Counter(walks)))
        self.sched_s.append(launch.sched_s)
        self.post_s.append(post_s)
        self.is_speculative.append(batch.is_speculative)
        self.is_follower.append(batch.is_follower)
        self.is_captured.append(batch.padded_batch > 0)
        self.is_oom.append(bool(launch.result.allocation_failed))
        self.num_held_rows.append(len(launch.result.allocation_failed))
        self.held_requests.update(launch.result.allocation_failed)
        self.launch_s.append(launch.launch_s)
        self.wait_s.append(launch.wait_s)
        self.gc_s.append(gc_s)


def _percentiles(values: Iterable[float], scale: float) -> dict[str, Optional[float]]:
    """p50/p90/p99/mean of `values` times `scale`; all None when there is no value."""
    array = np.fromiter(values, dtype=float)
    if array.size == 0:
        return {"p50": None, "p90": None, "p99": None, "mean": None}
    p50, p90, p99 = np.percentile(array, [50, 90, 99]) * scale
    return {"p50": float(p50), "p90": float(p90), "p99": float(p99), "mean": float(array.mean() * scale)}


def _of_leaders(values: list[float], is_follower: list[bool]) -> list[float]:
    """The values of the steps that are not TP follower copies."""
    return [value for value, follows in zip(values, is_follower) if not follows]


def _composition(log: StepLog) -> dict[str, dict[str, Any]]:
    """Per scheduling key: its steps that ran a row (TP follower copies left out, and steps whose
    every row was short of memory: `num_oom_steps` counts them; they pulled the mean down), mean
    rows, mean rows per walk."""
    composition: dict[str, dict[str, Any]] = {}
    for key, num_rows, walk_rows, is_follower in zip(log.key, log.num_rows, log.walk_rows, log.is_follower):
        if is_follower or not num_rows:
            continue
        entry = composition.setdefault(key, {"steps": 0, "rows": 0, "walk_rows": Counter()})
        entry["steps"] += 1
        entry["rows"] += num_rows
        entry["walk_rows"].update(walk_rows)
    for entry in composition.values():
        steps = entry["steps"]
        entry["mean_rows"] = entry["rows"] / steps
        entry["mean_rows_per_walk"] = {w: n / steps for w, n in sorted(entry.pop("walk_rows").items())}
        del entry["rows"]
    return composition


def summarize(records: Iterable[RequestRecord], log: StepLog, host_wall_s: float) -> dict[str, Any]:
    records = list(records)
    finished = [r for r in records if r.is_finished]
    failed = [r for r in finished if r.is_failed]
    start = min((r.arrival_s for r in records), default=0.0)
    # the run clock's span from the first arrival to the last finish or step: with nothing finished
    # (all failed, or interrupted) it was a made-up 1e-9 s beside a thousand steps
    end = max([r.finish_s for r in finished if r.finish_s is not None] + list(log.end_s), default=start)
    duration = max(end - start, 0.0)
    per_s = 1.0 / duration if duration > 0 else 0.0
    # The finished requests' tokens: an interrupted run's unfinished ones are not in its outputs,
    # and their tokens came after `end`.
    num_tokens = sum(r.num_output_tokens for r in finished)
    # Latencies of the finished requests too: an interrupted run's report gave them over requests
    # its outputs.jsonl does not hold.
    ttfts = (r.first_token_s - r.arrival_s for r in finished if r.first_token_s is not None)
    gaps: list[float] = []
    for record in finished:
        times = record.token_times_s
        gaps.extend(b - a for a, b in zip(times, times[1:]))
    composition = _composition(log)
    reasons = Counter(r.finish_reason or "unfinished" for r in records)
    kinds: Counter = Counter()
    for reason, count in reasons.items():
        kinds[reason.split(":", 1)[0].strip()] += count
    return {
        "num_requests": len(records),
        "num_completed": len(finished) - len(failed),
        "num_failed": len(failed),
        "finish_reasons": dict(sorted(reasons.items())),
        "finish_kinds": dict(sorted(kinds.items())),
        "failed_requests": {r.request.id: r.finish_reason for r in failed},
        "duration_s": duration,
        "host_wall_s": host_wall_s,
        "requests_per_s": (len(finished) - len(failed)) * per_s,
        "output_tokens": num_tokens,
        "tokens_per_s": num_tokens * per_s,
        "ttft_ms": _percentiles(ttfts, 1000.0),
        "itl_ms": _percentiles(gaps, 1000.0),
        "num_steps": len(log),
        "num_speculative_steps": int(sum(log.is_speculative)),
        "num_follower_steps": int(sum(log.is_follower)),
        "num_oom_steps": int(sum(log.is_oom)),
        "num_oom_rows": int(sum(log.num_held_rows)),
        "num_held_requests": len(log.held_requests),
        "scheduler_us_per_step": _percentiles(log.sched_s, 1e6),
        # The host's times of the steps it ran itself: a TP follower's copy is logged with none
        # (its leader's post-process covers it), which pulled these percentiles down.
        "postprocess_us_per_step": _percentiles(_of_leaders(log.post_s, log.is_follower), 1e6),
        # the host around the engine (StepLog.launch_s, wait_s, gc_s): a run whose launch is near
        # its inter-token time is the host's, one whose wait is, the device's
        "launch_us_per_step": _percentiles(_of_leaders(log.launch_s, log.is_follower), 1e6),
        "wait_us_per_step": _percentiles(_of_leaders(log.wait_s, log.is_follower), 1e6),
        "collector_ms": float(sum(log.gc_s) * 1e3),
        "step_composition": dict(sorted(composition.items())),
        **_prefix_figures(records),
    }


def _prefix_figures(records: list[RequestRecord]) -> dict[str, int]:
    """Prefix cache: prompts looked up, those with a hit, and prompt tokens found cached."""
    return {
        "num_prefix_lookups": sum(r.num_prefix_lookups for r in records),
        "num_prefix_hits": sum(1 for r in records if r.num_cached_tokens),
        "num_prefix_cached_tokens": sum(r.num_cached_tokens for r in records),
    }


def _one_line(text: str, width: int) -> str:
    line = " ".join(text.split())
    return line if len(line) <= width else line[: width - 3] + "..."


def error_lines(records: Iterable[RequestRecord], *, limit: int = 5, width: int = 160) -> list[str]:
    """The distinct failure reasons of a run's records, most frequent first, each as one line
    naming a request that failed so (at most `limit`, then an "and N more" line); empty when
    nothing failed."""
    ids: dict[str, list[str]] = {}
    for record in records:
        if record.finish_reason is not None and record.is_failed:  # a failed record has a reason
            ids.setdefault(record.finish_reason, []).append(record.request.id)
    ordered = sorted(ids.items(), key=lambda item: (-len(item[1]), item[0]))
    lines = []
    for reason, request_ids in ordered[:limit]:
        who = (f"request {request_ids[0]} failed" if len(request_ids) == 1
               else f"{len(request_ids)} requests failed (first {request_ids[0]})")
        lines.append(f"{who}: {_one_line(reason, width)}")
    if len(ordered) > limit:
        lines.append(f"and {len(ordered) - limit} more distinct failure reason(s) (see --report)")
    return lines


def _cell(value: Optional[float], digits: int) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def render_table(summary: dict[str, Any]):
    """A rich Table of the summary (import rich lazily: only the CLI prints)."""
    from rich.table import Table

    table = Table(title="mstar run", show_header=True)
    table.add_column("metric")
    table.add_column("value", justify="right")
    table.add_row("requests",
                  f"{summary['num_requests']} ({summary['num_completed']} ok, {summary['num_failed']} failed)")
    table.add_row("finish reasons", ", ".join(f"{k}: {v}" for k, v in summary["finish_kinds"].items()))
    table.add_row("run time (s)", f"{summary['duration_s']:.3f}")
    table.add_row("host wall time (s)", f"{summary['host_wall_s']:.3f}")
    table.add_row("requests/s", f"{summary['requests_per_s']:.2f}")
    table.add_row("output tokens/s", f"{summary['tokens_per_s']:.1f}")
    for name, label in (("ttft_ms", "TTFT ms"), ("itl_ms", "inter-token ms")):
        p = summary[name]
        table.add_row(label + " p50/p90/p99", " / ".join(_cell(p[q], 2) for q in ("p50", "p90", "p99")))
    for name, label in (("scheduler_us_per_step", "scheduler us/step"),
                        ("postprocess_us_per_step", "postprocess us/step"),
                        ("launch_us_per_step", "launch and launch-ahead us/step"),
                        ("wait_us_per_step", "wait for the step us/step")):
        p = summary[name]
        table.add_row(label + " p50/p90", " / ".join(_cell(p[q], 1) for q in ("p50", "p90")))
    table.add_row("collector passes (ms, in all)", f"{summary['collector_ms']:.1f}")
    table.add_row(
        "steps (speculative, follower, out-of-memory)",
        f"{summary['num_steps']} ({summary['num_speculative_steps']}, {summary['num_follower_steps']}, "
        f"{summary['num_oom_steps']})",
    )
    table.add_row(
        "rows held out of memory (requests)", f"{summary['num_oom_rows']} ({summary['num_held_requests']})",
    )
    if summary["num_prefix_lookups"]:
        table.add_row("prefix cache hits (lookups, cached tokens)",
                      f"{summary['num_prefix_hits']} ({summary['num_prefix_lookups']}, "
                      f"{summary['num_prefix_cached_tokens']})")
    for node, moved in (summary.get("kv_offload") or {}).items():
        table.add_row(f"KV pages offloaded / restored {node}",
                      f"{moved['offloaded_pages']} / {moved['restored_pages']}")
    for key, entry in summary["step_composition"].items():
        walks = ", ".join(f"{w} {_rows(n)}" for w, n in entry["mean_rows_per_walk"].items())
        table.add_row(f"rows/step {key}", f"{_rows(entry['mean_rows'])} ({walks})")
    return table


def _rows(mean: float) -> str:
    """Mean rows a step to one decimal, "<0.1" for a walk that ran but rounds to none (one prefill
    row in 64 steps read "prefill 0.0", as if it had not run)."""
    return "<0.1" if 0 < mean < 0.05 else f"{mean:.1f}"
