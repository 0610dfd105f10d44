"""The figures of one `mstar bench serve` run: a summary dict (`--json`) and a rich table.

In: the `RequestResult`s (bench_serve_client.py) and the run's wall time. Out: `summarize(...)`
with request and token throughput, TTFT, inter-token latency (ITL, gaps between output events),
time per output token (TPOT, per request: (e2e - TTFT) / (tokens - 1)) and end-to-end latency,
each as p50/p90/p99/mean in milliseconds over the requests that succeeded, and the errors counted
by message. The percentiles are numpy's (linear interpolation), as `mstar run`'s metrics take
them, so the two commands' figures compare directly. A figure with no sample is None ("-").
"""
from __future__ import annotations

from collections import Counter
from typing import Any, Iterable, Optional

import numpy as np

from mstar.runtime.serve.bench_serve_client import RequestResult

MAX_ERROR_KINDS = 10  # distinct error messages kept in the summary (the rest are counted together)


def percentiles_ms(values: Iterable[float]) -> dict[str, Optional[float]]:
    array = np.fromiter(values, dtype=float) * 1000.0
    if array.size == 0:
        return {"p50": None, "p90": None, "p99": None, "mean": None}
    p50, p90, p99 = np.percentile(array, [50, 90, 99])
    return {"p50": float(p50), "p90": float(p90), "p99": float(p99), "mean": float(array.mean())}


def _errors(failed: list[RequestResult]) -> dict[str, int]:
    counts = Counter(r.error or "" for r in failed)
    kept = dict(counts.most_common(MAX_ERROR_KINDS))
    num_other = sum(counts.values()) - sum(kept.values())
    if num_other:
        kept["(other errors)"] = num_other
    return kept


def summarize(results: list[RequestResult], duration_s: float, settings: dict[str, Any]) -> dict[str, Any]:
    ok = [r for r in results if r.error is None]
    failed = [r for r in results if r.error is not None]
    duration_s = max(duration_s, 1e-9)
    num_output = sum(r.num_output_tokens for r in ok)
    num_prompt = sum(r.num_prompt_tokens or 0 for r in ok)
    tpots = [(r.e2e_s - r.ttft_s) / (r.num_output_tokens - 1) for r in ok
             if r.ttft_s is not None and r.num_output_tokens > 1]
    return {
        **settings,
        "num_requests": len(results),
        "num_completed": len(ok),
        "num_errors": len(failed),
        "errors": _errors(failed),
        "num_without_output": sum(1 for r in ok if r.ttft_s is None),
        "duration_s": duration_s,
        "requests_per_s": len(ok) / duration_s,
        "output_tokens": num_output,
        "prompt_tokens": num_prompt,
        "output_tokens_per_s": num_output / duration_s,
        "total_tokens_per_s": (num_output + num_prompt) / duration_s,
        "ttft_ms": percentiles_ms(r.ttft_s for r in ok if r.ttft_s is not None),
        "itl_ms": percentiles_ms(gap for r in ok for gap in r.gaps_s),
        "tpot_ms": percentiles_ms(tpots),
        "e2e_ms": percentiles_ms(r.e2e_s for r in ok),
    }


def _cell(value: Optional[float]) -> str:
    return "-" if value is None else f"{value:.2f}"


def render_table(summary: dict[str, Any]):
    """A rich Table of the summary (rich imported here: only the command prints)."""
    from rich.table import Table

    table = Table(title=f"mstar bench serve: {summary['base_url']} ({summary['model']})")
    table.add_column("metric")
    table.add_column("value", justify="right")
    table.add_row("requests", f"{summary['num_requests']} ({summary['num_completed']} ok, "
                              f"{summary['num_errors']} errors)")
    table.add_row("arrivals", summary["arrivals"])
    table.add_row("duration (s)", f"{summary['duration_s']:.3f}")
    table.add_row("requests/s", f"{summary['requests_per_s']:.2f}")
    table.add_row("output tokens/s", f"{summary['output_tokens_per_s']:.1f}")
    table.add_row("total tokens/s (prompt + output)", f"{summary['total_tokens_per_s']:.1f}")
    for name, label in (("ttft_ms", "TTFT ms"), ("itl_ms", "inter-token ms"), ("tpot_ms", "time per output token ms"),
                        ("e2e_ms", "end-to-end ms")):
        p = summary[name]
        table.add_row(f"{label} p50/p90/p99", " / ".join(_cell(p[q]) for q in ("p50", "p90", "p99")))
    for message, count in summary["errors"].items():
        table.add_row(f"error x{count}", " ".join(message.split())[:100])
    return table
