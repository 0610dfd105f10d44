"""`mstar bench lone`: the host's path of a lone request to its first token, on the CPU, device stubbed.

A request that arrives while nothing runs waits for the host's Python (admission, the scheduler,
the runner), then one device step, then the host again: on a GPU most of a cached request's TTFT is
host time (docs/runtime.md, "Prefix cache on the GPU"). Here the plan's fast-path decoder runs with
its executor stubbed (`bench_runner.build_engine`: each launched step answered at once, no packing,
no copies), so what is timed is the Python above the executor, the part any machine can measure.

Requests arrive one after another (one client), each `--prefix-len` tokens then 16 of its own, the
prefix the same for all (`mstar bench kv --scenario prefix`'s requests: with the plan's prefix cache,
llama_chunked's, the 2nd and later start on the first's cached pages) or each its own with
`--no-shared-prefix`. Per point of a request's path (`host_timeline.py`: admitted, step built, the
engine's launch entered, waiting for the device, tokens back, first token), the median ms after
its arrival over the 2nd and later requests; printed per run (`--rounds`, a fresh engine each) and
as the median over runs.

Usage: mstar bench lone [--plan generated/llama_chunked.plan] [--requests 40] [--prefix-len 1024]
                        [--no-shared-prefix] [--rounds 3] [--json]
"""
from __future__ import annotations

import argparse
import sys
from statistics import median
from typing import Any, Optional

from mstar.arg_types import int_range, path_arg
from mstar.plan.io import load_plan
from mstar.runtime.serve.bench_kv import one_after_another_timed, shared_prefix_requests
from mstar.runtime.serve.bench_runner import BenchError, build_engine, measure_and_print


def one_run(plan: Any, num_requests: int, prefix_len: int, is_shared: bool) -> dict[str, Any]:
    """One run on a fresh engine: the timeline's points (ms after arrival, medians over the 2nd and
    later requests) and the tokens each request found cached."""
    requests = shared_prefix_requests(num_requests, prefix_len, is_shared)
    pages = -(-(prefix_len + 18) // 16)  # a request's pages at the smallest page size a plan uses
    engine, _ = build_engine(plan, True, max(256, 4 * pages))
    driver, points = one_after_another_timed(plan, engine, requests)
    records = [driver.conductor.records[request.id] for request in requests]
    failed = [r.request.id for r in records if r.first_token_s is None]
    if failed:
        raise BenchError(f"requests {failed[:3]} produced no token: {records[0].finish_reason}")
    return {"points_ms": points, "cached_tokens": [r.num_cached_tokens for r in records]}


def measure(args: argparse.Namespace) -> dict[str, Any]:
    plan = load_plan(args.plan, verify=False)
    runs = [one_run(plan, args.requests, args.prefix_len, args.shared_prefix) for _ in range(args.rounds)]
    order = [point for point, _ in runs[0]["points_ms"]]
    per_point = {point: [dict(run["points_ms"]).get(point) for run in runs] for point in order}
    return {"plan": str(args.plan), "requests": args.requests, "prefix_len": args.prefix_len,
            "shared_prefix": args.shared_prefix, "rounds": args.rounds,
            "cached_tokens": runs[0]["cached_tokens"], "runs": [run["points_ms"] for run in runs],
            "median_ms": [(point, round(median(v for v in values if v is not None), 3))
                          for point, values in per_point.items()]}


def render(result: dict[str, Any]) -> str:
    shared = "the same prefix" if result["shared_prefix"] else "prefixes of their own"
    cached = sorted(set(result["cached_tokens"][1:]))
    lines = [f"plan {result['plan']}: {result['requests']} requests one after another, {shared} of "
             f"{result['prefix_len']} tokens + 16 each (the 2nd and later found {cached} tokens cached); device "
             f"stubbed; ms after a request's arrival, medians over the 2nd and later requests"]
    points = [point for point, _ in result["median_ms"]]
    width = max(len(point) for point in points)
    for point, ms in result["median_ms"]:
        per_run = ", ".join(f"{dict(run).get(point, float('nan')):.3f}" for run in result["runs"])
        lines.append(f"  {point:<{width}}  {ms:7.3f}   (runs: {per_run})")
    return "\n".join(lines)


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="mstar bench lone", description=__doc__.split("\n")[0])
    parser.add_argument("--plan", type=path_arg, default="generated/llama_chunked.plan")
    parser.add_argument("--requests", type=int_range(2, 100_000), default=40,
                        help="at least 2: the figures are about the 2nd request and later")
    parser.add_argument("--prefix-len", type=int_range(1, 1_000_000), default=1024)
    parser.add_argument("--no-shared-prefix", dest="shared_prefix", action="store_false",
                        help="give each request a prefix of its own (nothing to find cached)")
    parser.add_argument("--rounds", type=int_range(1, 1000), default=3)
    parser.add_argument("--json", action="store_true", help="print the figures as JSON")
    return measure_and_print("mstar bench lone", parser.parse_args(argv), measure, render)


if __name__ == "__main__":
    sys.exit(main())
