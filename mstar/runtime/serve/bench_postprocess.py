"""`mstar bench postprocess`: host time to post-process a step, per step and per row.

Post-process is what `mstar run` reports as `postprocess_us_per_step`: the conductor taking a
step's row results (`Conductor.on_step`) and the rows that became ready going to the schedulers
(`Driver._drain`). The bench runs the simulated engine on a plan (default generated/llama.plan)
with a closed loop of `--clients` clients sending `--requests` requests of `--prompt-len` prompt
tokens and `--output-len` output tokens, once per variant and round, interleaved:

    columnar   decode lanes (conductor/lanes.py, lane_pass.py): a step's laned decode rows
               advanced at once from the engine's columns, the other rows through the loop pass
    steady     without lanes: every row through the loop pass (conductor/loop_pass.py), a decode
               row through its steady case (Conductor.is_laned = False: what a decode row cost
               before lanes)
    general    the loop pass with every row of the fast kernel through its general case, never
               the steady one (Conductor.is_steady = False: what a decode row cost before that)
    per-row    every row through its walk run's tables (Conductor.is_columnar = False)

and prints, per variant, the steps whose rows are all at one loop step (a decode step; what the
target is about) and every step: p50/p90 microseconds per step and p50 per row, the median over
rounds; each variant's ratio to columnar; and the host time split of the columnar and steady runs per step
(scheduler with the next step's speculation, step building, engine call, post-process, the rest of
the run loop). With
`--bytecodes`, one more columnar run is traced and the Python bytecodes each part executes per row
are printed: a figure that does not move with the machine's speed or load (C-level work, such as
dict and list operations inside one bytecode, is not counted).

Usage: mstar bench postprocess [--plan P] [--clients N] [--requests N] [--prompt-len N]
                               [--output-len N] [--rounds N] [--json] [--bytecodes]
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from statistics import median
from typing import Any, Callable, Optional

import numpy as np

from mstar.arg_types import int_range, path_arg
from mstar.plan.io import PlanError, load_plan
from mstar.plan.rounds import max_request_tokens
from mstar.runtime.conductor.request import Request
from mstar.runtime.engine.prompt_limits import text_prompt_vocab
from mstar.runtime.engine.sim import SimEngine
from mstar.runtime.serve.bench_errors import BenchError, check_every_request_ran
from mstar.runtime.serve.driver import Driver, Workload, freeze_start_up

VARIANTS = ("columnar", "steady", "general", "per-row")
TARGET_US = 50.0  # post-process p50 per decode step (issue 8)
SPLIT_PARTS = ("scheduler", "step building", "engine call", "post-process", "run loop rest")


class _Opcodes:
    """Counts the Python bytecodes executed per host part (`--bytecodes`): a figure of the Python
    work per row that does not move with the machine or its load (C work is not counted)."""

    def __init__(self) -> None:
        self.part: Optional[str] = None
        self.counts: dict[str, int] = dict.fromkeys(SPLIT_PARTS, 0)

    def trace(self, frame, event, arg):
        frame.f_trace_opcodes = True
        frame.f_trace_lines = False
        if event == "opcode" and self.part is not None:
            self.counts[self.part] += 1
        return self.trace


class _Timed:
    """Wraps a callable, adding its wall time to `total` (and its bytecodes to `opcodes`' part)."""

    def __init__(self, fn: Callable, totals: dict[str, float], part: str, opcodes: Optional[_Opcodes] = None):
        self.fn, self.totals, self.part, self.opcodes = fn, totals, part, opcodes

    def __call__(self, *args, **kwargs):
        opcodes = self.opcodes
        outer = opcodes.part if opcodes is not None else None
        if opcodes is not None:
            opcodes.part = self.part
        started = time.perf_counter()
        try:
            return self.fn(*args, **kwargs)
        finally:
            self.totals[self.part] += time.perf_counter() - started
            if opcodes is not None:
                opcodes.part = outer


def _requests(args, vocab: Optional[int]) -> list[Request]:
    prompt = [t % vocab for t in range(args.prompt_len)] if vocab else list(range(args.prompt_len))
    return [Request(id=f"r{i}", prompt_tokens=list(prompt), max_tokens=args.output_len) for i in range(args.requests)]


def _one_run(plan, args, variant: str, opcodes: Optional[_Opcodes] = None) -> dict[str, Any]:
    """One closed-loop run; the post-process figures of its steps and the host time split (and,
    given `opcodes`, the bytecodes of each part: the run is traced, so its times mean nothing)."""
    engine = SimEngine(plan)
    driver = Driver(plan, engine)
    driver.conductor.is_columnar = variant != "per-row"
    driver.conductor.is_steady = variant in ("columnar", "steady")
    driver.conductor.is_laned = variant == "columnar"
    totals = dict.fromkeys(SPLIT_PARTS, 0.0)
    # The timers replace these objects' bound methods for this run only, wrapping them with their
    # signatures unchanged; mypy refuses any assignment to a method, so each says so.
    for scheduler in driver.schedulers.values():
        scheduler.next_batch = _Timed(scheduler.next_batch, totals, "scheduler", opcodes)  # type: ignore[method-assign]
    driver.conductor.build_step = _Timed(driver.conductor.build_step, totals,  # type: ignore[method-assign]
                                         "step building", opcodes)
    # the speculation of the next step between a step's launch and its wait is the scheduler's too
    driver.cover.speculate = _Timed(driver.cover.speculate, totals,  # type: ignore[method-assign]
                                    "scheduler", opcodes)
    engine.launch = _Timed(engine.launch, totals, "engine call", opcodes)  # type: ignore[method-assign]
    engine.wait = _Timed(engine.wait, totals, "engine call", opcodes)  # type: ignore[method-assign]
    if opcodes is not None:  # post-process is timed by the run loop itself; counted here
        driver._postprocess = _Timed(driver._postprocess, {"post-process": 0.0},  # type: ignore[method-assign]
                                     "post-process", opcodes)
        opcodes.part = "run loop rest"
        sys.settrace(opcodes.trace)
    # The process's one collection before its first run (`Driver.run` makes it, once): inside the
    # timed span it went to the first run's "run loop rest" (246.6 against 77.6 us a step).
    freeze_start_up()
    started = time.perf_counter()
    try:
        driver.run(Workload(_requests(args, text_prompt_vocab(plan)), closed_concurrency=args.clients))
    finally:
        sys.settrace(None)
    wall = time.perf_counter() - started
    check_every_request_ran(driver, args.requests)  # refused requests: a table of dashes measured nothing
    log = driver.log
    totals["post-process"] = float(sum(log.post_s))
    totals["run loop rest"] = wall - sum(totals.values())
    post = np.array(log.post_s) * 1e6
    rows = np.array(log.num_rows, dtype=float)
    # Walks whose calls are loop steps (a decode loop): a step of only those is a loop step.
    loop_walks = {walk.name for walk in driver.conductor.walks.values() if any(c.is_loop_step for c in walk.calls)}
    loop_only = np.array([bool(w) and set(w) <= loop_walks for w in log.walk_rows], dtype=bool)
    if not loop_only.any():  # the target is per loop step: a table of dashes and "missed" measured nothing
        raise BenchError(f"{len(log)} steps and not one loop step (a step whose rows are all at a decode loop's "
                         "step): this bench's figure is per loop step; use a plan whose requests decode in a loop")
    return {"post_us": post, "rows": rows, "is_loop_step": loop_only, "num_steps": len(log),
            "split_us": {part: seconds * 1e6 / max(len(log), 1) for part, seconds in totals.items()},
            "num_finished": driver.conductor.num_finished}


def _figures(post: np.ndarray, rows: np.ndarray) -> dict[str, Optional[float]]:
    if post.size == 0:
        return {"steps": 0, "rows_per_step": None, "p50_us": None, "p90_us": None, "p50_us_per_row": None}
    return {
        "steps": int(post.size),
        "rows_per_step": float(rows.mean()),
        "p50_us": float(np.percentile(post, 50)),
        "p90_us": float(np.percentile(post, 90)),
        "p50_us_per_row": float(np.percentile(post / np.maximum(rows, 1), 50)),
    }


def _median_of(runs: list[dict], key: str) -> dict[str, Optional[float]]:
    entries = [run[key] for run in runs]
    out: dict[str, Optional[float]] = {}
    for name in entries[0]:
        values = [e[name] for e in entries if e[name] is not None]
        out[name] = float(median(values)) if values else None
    return out


def _check_lengths(plan, args) -> None:
    """BenchError for requests the plan refuses, before the runs (`--prompt-len 200000` ran 44 s,
    then named its token ids past the vocabulary rather than its length)."""
    limit = max_request_tokens(plan)
    if args.prompt_len + args.output_len > limit:
        raise BenchError(f"--prompt-len {args.prompt_len} + --output-len {args.output_len} is past the plan's "
                         f"max_seq_len {limit}: every request would be refused")


def measure(args) -> dict[str, Any]:
    plan = load_plan(args.plan, verify=False)
    _check_lengths(plan, args)
    runs: dict[str, list[dict]] = {v: [] for v in VARIANTS}
    for _ in range(args.rounds):
        for variant in VARIANTS:
            run = _one_run(plan, args, variant)
            mask = run["is_loop_step"]
            run["loop_steps"] = _figures(run["post_us"][mask], run["rows"][mask])
            run["all_steps"] = _figures(run["post_us"], run["rows"])
            runs[variant].append(run)
    result: dict[str, Any] = {"plan": str(args.plan), "clients": args.clients, "requests": args.requests,
                              "prompt_len": args.prompt_len, "output_len": args.output_len,
                              "rounds": args.rounds, "variants": {}}
    for variant, variant_runs in runs.items():
        result["variants"][variant] = {
            "loop_steps": _median_of(variant_runs, "loop_steps"),
            "all_steps": _median_of(variant_runs, "all_steps"),
            "split_us_per_step": _median_of(variant_runs, "split_us"),
        }
    columnar = result["variants"]["columnar"]["loop_steps"]["p50_us"]
    result["over_columnar"] = {}
    for variant in VARIANTS[1:]:
        other = result["variants"][variant]["loop_steps"]["p50_us"]
        result["over_columnar"][variant] = other / columnar if columnar and other else None
    result["target_us"] = TARGET_US
    if args.bytecodes:
        opcodes = _Opcodes()
        run = _one_run(plan, args, "columnar", opcodes)
        num_rows = max(float(run["rows"].sum()), 1.0)
        result["bytecodes_per_row"] = {part: opcodes.counts[part] / num_rows for part in SPLIT_PARTS}
    return result


def _cell(value: Optional[float], digits: int = 1) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def render(result: dict[str, Any]) -> str:
    lines = [f"plan {result['plan']}: {result['clients']} clients, {result['requests']} requests, prompt "
             f"{result['prompt_len']}, output {result['output_len']} tokens; median of {result['rounds']} "
             "round(s), variants interleaved",
             f"{'variant':<10} {'steps':<14} {'rows/step':>9} {'p50 us':>8} {'p90 us':>8} {'us/row p50':>10}"]
    for variant, entry in result["variants"].items():
        for kind, label in (("loop_steps", "loop steps"), ("all_steps", "all steps")):
            f = entry[kind]
            lines.append(f"{variant:<10} {label:<14} {_cell(f['rows_per_step']):>9} {_cell(f['p50_us']):>8} "
                         f"{_cell(f['p90_us']):>8} {_cell(f['p50_us_per_row'], 2):>10}")
    lines.append("over columnar, loop steps p50: " + "; ".join(
        f"{variant} {_cell(ratio, 2)}x" for variant, ratio in result["over_columnar"].items()))
    for variant in ("columnar", "steady"):
        split = result["variants"][variant]["split_us_per_step"]
        lines.append(f"host time per step, {variant} (us, mean): "
                     + ", ".join(f"{part} {_cell(split[part])}" for part in SPLIT_PARTS))
    if "bytecodes_per_row" in result:
        lines.append("Python bytecodes per row, columnar (all steps): "
                     + ", ".join(f"{part} {result['bytecodes_per_row'][part]:.1f}" for part in SPLIT_PARTS))
    p50 = result["variants"]["columnar"]["loop_steps"]["p50_us"]
    met = p50 is not None and p50 <= result["target_us"]
    lines.append(f"post-process p50 per loop step {_cell(p50)} us (target <= {result['target_us']:.0f} us): "
                 + ("met" if met else "missed"))
    return "\n".join(lines)


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="mstar bench postprocess", description=__doc__.split("\n")[0])
    parser.add_argument("--plan", type=path_arg, default="generated/llama.plan")
    count = int_range(1, 1_000_000)
    parser.add_argument("--clients", type=count, default=64)
    parser.add_argument("--requests", type=count, default=256)
    parser.add_argument("--prompt-len", type=count, default=100)
    parser.add_argument("--output-len", type=count, default=200)
    parser.add_argument("--rounds", type=count, default=3)
    parser.add_argument("--json", action="store_true", help="print the figures as JSON")
    parser.add_argument("--bytecodes", action="store_true",
                        help="also count the Python bytecodes per row of each host part (one traced run, slow)")
    args = parser.parse_args(argv)
    try:
        result = measure(args)
    except (PlanError, BenchError) as error:
        print(f"mstar bench postprocess: {error}", file=sys.stderr)
        return 1
    print(json.dumps(result, indent=1, sort_keys=True) if args.json else render(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
