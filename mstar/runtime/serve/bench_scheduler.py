"""`mstar bench scheduler`: host time to decide one step, plan-driven scheduler vs a baseline.

Each figure is the time for one step's scheduler work, engine excluded: the previous step's
rows coming back ready (add_ready_many, as the conductor does after a loop step) plus the
decision (next_batch, or speculate for spec_merge_48). The baseline (mstar.runtime.scheduler.
baseline) makes the same decisions row by row without the plan's tables; both run in
the same process on the same plan: an Orpheus-like LLM key (prefill cap 16, decode cap 64,
combined `mixed` cap 64 with `rows prefill <= 4`, the Orpheus captures).

Scenarios: decode_N - N decode rows ready, each step takes up to the cap (64) and they come
back; mixed_63_1 - 63 decode rows and one new prompt (100 tokens) make one mixed step;
spec_merge_48 - a decode chain of 40 rows speculates step N+1 and merges 8 fresh decode rows.

Usage: python3 -m mstar.runtime.serve.bench_scheduler [--json] [--iters N] [--warmup N]
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Callable, Literal, Optional, Sequence

from mstar.arg_types import int_range
from mstar.plan.schema import (
    CaptureFamily,
    DeploymentPlan,
    KeyPlan,
    MixtureEntry,
    SpeculationPlan,
    WorkerPlan,
)
from mstar.runtime.scheduler.baseline import BaselineScheduler
from mstar.runtime.scheduler.batch import Batch
from mstar.runtime.scheduler.scheduler import WorkerScheduler

SCENARIOS = ["decode_48", "decode_64", "mixed_63_1", "spec_merge_48", "decode_256", "decode_1024"]
TARGETS_US = {"decode_64": 10.0, "mixed_63_1": 15.0}


def _family(name: str, kind: Literal["batched", "packed"], sizes: list[int],
            tokens: Sequence[int] = ()) -> CaptureFamily:
    pad = [0] + [min(s for s in sizes if s >= b) for b in range(1, max(sizes) + 1)]
    return CaptureFamily(
        name=name, kind=kind, batch_sizes=sizes, token_buckets=list(tokens), batch_pad=pad,
        num_graphs=len(sizes) * max(1, len(tokens)), memory_bytes=0,
    )


def orpheus_like_worker(decode_cap: int = 64) -> tuple[WorkerPlan, DeploymentPlan]:
    """The LLM key of an Orpheus deployment on one worker (as compiled from specs/orpheus.mw);
    decode_cap other than 64 widens the decode cap and its capture (for one-step figures)."""
    decode_sizes = [1 << i for i in range(decode_cap.bit_length()) if 1 << i <= decode_cap]
    captures = [
        _family("LLM:decode", "batched", decode_sizes),
        _family("LLM:mixed", "packed", [1, 4, 16, 64], [128, 256, 512, 1024, 2048, 4096, 8192]),
        _family("LLM:prefill", "packed", [1, 2, 4, 8, 16], [32, 64, 128, 256, 512, 1024]),
    ]
    key = KeyPlan(
        name="LLM:mixed", node="LLM", walks=["prefill", "decode"], is_combined=True,
        mixtures=[
            MixtureEntry(mask=0, walks=[], cap=0, attention="none"),
            MixtureEntry(mask=1, walks=["prefill"], cap=16, label="prefill", capture="LLM:prefill",
                         attention="prefill"),
            MixtureEntry(mask=2, walks=["decode"], cap=decode_cap, label="decode", capture="LLM:decode",
                         attention="decode"),
            MixtureEntry(mask=3, walks=["prefill", "decode"], cap=64, capture="LLM:mixed", attention="split"),
        ],
        rows_limits={"prefill": 4}, captures=captures,
    )
    worker = WorkerPlan(
        rank=0, placements=["LLM/decode", "LLM/prefill"],
        walk_to_key={"LLM/decode": "LLM:mixed", "LLM/prefill": "LLM:mixed"}, keys=[key],
        speculation=[
            SpeculationPlan(node="LLM", walk="decode", can_speculate=True, mixes_walks=False),
            SpeculationPlan(node="LLM", walk="prefill", can_speculate=False, mixes_walks=False),
        ],
        tp_groups=[], capture_memory_bytes=0,
    )
    return worker, DeploymentPlan(max_seq_len=4096, kv_pools=[])


def _decode_step(sched, num_rows: int) -> Callable[[], object]:
    """One decode step: the last step's rows come back ready, then the next step is decided."""
    sched.add_ready_many([f"d{i}" for i in range(num_rows)], "LLM", "decode")
    state: dict[str, list[str]] = {"back": []}

    def step() -> object:
        if state["back"]:
            sched.add_ready_many(state["back"], "LLM", "decode")
        batch = sched.next_batch()
        state["back"] = batch.request_ids
        return batch

    return step


def _mixed_step(sched) -> Callable[[], object]:
    decode_ids = [f"d{i}" for i in range(63)]

    def step() -> object:
        sched.add_ready_many(decode_ids, "LLM", "decode")
        sched.add_ready("p", "LLM", "prefill", 100)
        batch = sched.next_batch()
        if batch.num_rows != 64:
            raise RuntimeError(f"mixed_63_1 built a step of {batch.num_rows} rows, not 64")
        return batch

    return step


def _spec_step(sched) -> Callable[[], object]:
    continuing = [f"c{i}" for i in range(40)]
    fresh = [f"f{i}" for i in range(8)]
    running = Batch(
        worker=0, key="LLM:mixed", node="LLM", mask=2, label="decode", request_ids=continuing,
        walks=["decode"] * 40, num_tokens=[1] * 40, capture="LLM:decode", padded_batch=64,
        token_bucket=0, attention="decode",
    )

    def step() -> object:
        sched.add_ready_many(fresh, "LLM", "decode")
        batch = sched.speculate(running)
        if batch is None or batch.num_rows != 48:
            raise RuntimeError("spec_merge_48 did not merge 8 fresh rows into a 40-row chain")
        return batch

    return step


def _make_step(name: str, sched) -> Callable[[], object]:
    if name.startswith("decode_"):
        return _decode_step(sched, int(name.split("_")[1]))
    if name == "mixed_63_1":
        return _mixed_step(sched)
    return _spec_step(sched)


def _percentiles(samples_ns: list[int]) -> dict[str, float]:
    ordered = sorted(samples_ns)
    pick = lambda q: ordered[min(len(ordered) - 1, int(q * len(ordered)))] / 1000.0  # noqa: E731
    return {"p50_us": round(pick(0.5), 2), "p90_us": round(pick(0.9), 2)}


def measure(make_scheduler, name: str, iters: int, warmup: int, decode_cap: int = 64) -> dict[str, float]:
    """p50/p90 microseconds per step of one scenario on a fresh scheduler."""
    worker, deployment = orpheus_like_worker(decode_cap)
    sched = make_scheduler(worker, deployment, time.monotonic)
    step = _make_step(name, sched)
    for _ in range(warmup):
        step()
    clock = time.perf_counter_ns
    samples = []
    for _ in range(iters):
        start = clock()
        step()
        samples.append(clock() - start)
    return _percentiles(samples)


def run(iters: int = 2000, warmup: int = 200) -> dict:
    return {
        "scenarios": {name: measure(WorkerScheduler, name, iters, warmup) for name in SCENARIOS},
        "baseline": {name: measure(BaselineScheduler, name, iters, warmup) for name in SCENARIOS},
    }


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="mstar bench scheduler", description=__doc__.split("\n")[0])
    parser.add_argument("--json", action="store_true", help="print one JSON object and nothing else")
    parser.add_argument("--iters", type=int_range(1, 1_000_000), default=2000, help="timed steps per scenario")
    parser.add_argument("--warmup", type=int_range(0, 1_000_000), default=200, help="untimed steps first")
    args = parser.parse_args(argv)
    result = run(args.iters, args.warmup)
    if args.json:
        print(json.dumps(result, sort_keys=True))
        return 0
    print(f"{'scenario':<14} {'p50 us':>8} {'p90 us':>8} {'baseline p50':>13} {'speed-up':>9}")
    for name in SCENARIOS:
        fast, base = result["scenarios"][name], result["baseline"][name]
        ratio = base["p50_us"] / fast["p50_us"] if fast["p50_us"] else float("inf")
        print(f"{name:<14} {fast['p50_us']:>8.2f} {fast['p90_us']:>8.2f} {base['p50_us']:>13.2f} {ratio:>8.1f}x")
    # Not part of the JSON: steps that themselves hold N rows (decode cap raised to N). The
    # per-row lists of a Batch make these grow with N; the plan cannot decide that away.
    for num_rows in (256, 1024):
        one = measure(WorkerScheduler, f"decode_{num_rows}", args.iters, args.warmup, decode_cap=num_rows)
        label = f"(one step of {num_rows} rows)"
        print(f"{label:<28} p50 {one['p50_us']:.2f} us  p90 {one['p90_us']:.2f} us")
    growth = result["scenarios"]["decode_1024"]["p50_us"] / max(result["scenarios"]["decode_64"]["p50_us"], 1e-9)
    print(f"decode_1024 / decode_64 p50: {growth:.2f}x (target <= 2x)")
    for name, target in TARGETS_US.items():
        got = result["scenarios"][name]["p50_us"]
        print(f"{name} p50 {got:.2f} us (target <= {target:.0f} us): {'met' if got <= target else 'missed'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
