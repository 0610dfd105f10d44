"""`mstar bench runner`: the host work of the GPU fast path's kv runner per decode step, on the CPU.

What it measures: `TorchEngine.launch`, `wait` and `launch_ahead` as the run loop calls them for a
plan's fast-path decoder (`gpu/runner.py`, `GpuDecoderRunner`), with the device step stubbed out:
the runner's `StepExecutor` is replaced by a stand-in that answers each launched step at once with
one fixed token a row (no packing, no forward, no copies), so only the host's bookkeeping around
the device is timed (preparing rows, page admission, row specs, claiming a step launched ahead,
token outputs). The run loop (`Driver`) runs `--clients` clients in a closed loop, each sending one
request of `--prompt-len` prompt tokens and `--output-len` output tokens, once with run-ahead on and
once off, interleaved over `--rounds`. A step counts when it is a full decode step: `--clients`
rows, each feeding one token.

It prints, per variant, p50 microseconds per step of launch, wait and launch_ahead (the one that
follows the step's launch) and their sum, the sum's p90 and largest step (while the host's step is
longer than the device's, the device waits), the median over rounds, and (unless `--no-bytecodes`)
from one more traced run per variant the Python bytecodes each part executes per row: a figure that
does not move with the machine's speed or load (C work inside one bytecode is not counted). Runs on
any machine; the plan's node must be one the fast path takes (`fast_path_reason`).

`--per-row` turns the runner's columnar decode step off (`gpu/decode_columns.py`), so one tree
compares both; `--cpu-time` times with the thread's CPU time (`time.thread_time`), which other
jobs on a shared machine do not add to (they still share its caches).

Usage: mstar bench runner [--plan P] [--clients N] [--prompt-len N] [--output-len N] [--rounds N]
                          [--json] [--no-bytecodes] [--per-row] [--cpu-time]
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path
from statistics import median
from typing import Any, Callable, Optional

import numpy as np
import torch

from mstar.arg_types import int_range
from mstar.plan.io import PlanError, load_plan
from mstar.plan.schema import Plan
from mstar.runtime.conductor.request import Request
from mstar.runtime.engine.gpu.device_model import build_decoder
from mstar.runtime.engine.gpu.packing import RowSpec
from mstar.runtime.engine.gpu.runner import GpuDecoderRunner, decode_family, fast_path_reason
from mstar.runtime.engine.placement import CPU
from mstar.runtime.engine.runners.decoder import DecoderRunner
from mstar.runtime.engine.torch_engine import EngineError, TorchEngine
from mstar.runtime.serve.driver import Driver, Workload

PARTS = ("launch", "wait", "launch_ahead")
VARIANTS = ("ahead", "no-ahead")


class BenchError(ValueError):
    """The plan cannot be benched this way (the message says why)."""


@dataclasses.dataclass
class _Answered:
    """A stand-in step: its tokens are known at launch."""

    tokens: np.ndarray


class StubExecutor:
    """Stands in for `StepExecutor` with the device work taken out: `launch` answers each row with
    `token` at once, `collect` returns those tokens. Keeps the device token table (`loop_tokens`),
    which the runner writes when it drops rows launched ahead."""

    is_cuda = False
    graphs = None
    packer = None  # no packing at all (neither the generated glue nor numpy)

    def __init__(self, max_rows: int, token: int):
        self.loop_tokens = torch.zeros(max_rows, dtype=torch.int32)
        self.token = token
        self.num_steps = 0

    def launch(self, rows: list[RowSpec], sampling: Any = None, family: Optional[str] = None,
               token_bucket: int = 0, route: str = "packed", glue: Any = None) -> _Answered:
        self.num_steps += 1
        return _Answered(np.full(len(rows), self.token, dtype=np.int64))

    def restore_loop_tokens(self, slots: list[int], tokens: list[int]) -> None:
        self.loop_tokens[torch.tensor(slots)] = torch.tensor(tokens, dtype=self.loop_tokens.dtype)

    def collect(self, pending: _Answered) -> np.ndarray:
        return pending.tokens


def _fast_node(plan: Plan, engine: TorchEngine) -> str:
    """The first decoder node the fast path takes."""
    for node in plan.nodes:
        runner = engine.runners.get(node.name)
        if isinstance(runner, DecoderRunner) and node.model_kind == "decoder" and not node.submodels \
                and fast_path_reason(node, engine.calls) is None:
            return node.name
    raise BenchError("the plan has no decoder node the GPU fast path takes (gpu/runner.py fast_path_reason)")


def build_engine(plan: Plan, can_run_ahead: bool, num_pages: int, is_columnar: bool = True
                 ) -> tuple[TorchEngine, GpuDecoderRunner]:
    """A tiny-dims CPU engine whose fast-path node runs a `GpuDecoderRunner` on a `StubExecutor`
    (is_columnar False: its steady decode steps row by row too, `gpu/decode_columns.py`)."""
    engine = TorchEngine(plan, num_pages=num_pages)
    name = _fast_node(plan, engine)
    reference = engine.runners[name]
    assert isinstance(reference, DecoderRunner)
    node = next(n for n in plan.nodes if n.name == name)
    position = engine.positions[name]
    model = build_decoder(reference.dims, torch.device("cpu"), torch.float32, position=position, seed=0)
    runner = GpuDecoderRunner(node, reference.dims, model, reference.pool.page_size, num_pages,
                              reference.max_seq_len, 0, CPU, decode_family(plan, name), is_flashinfer=False,
                              position=position, can_run_ahead=can_run_ahead, slots=reference.slots)
    token = next(t for t in range(1, 1 << 20) if t not in runner.stop_tokens)
    runner.executor = StubExecutor(runner.executor.max_rows, token)  # type: ignore[assignment]
    runner.is_columnar = is_columnar
    engine.runners[name] = runner
    engine.caps = dataclasses.replace(engine.caps, can_launch_ahead=runner.can_run_ahead)
    return engine, runner


class _Counter:
    """Counts executed Python bytecodes while `active` (sys.settrace only inside a timed call)."""

    def __init__(self) -> None:
        self.count = 0

    def trace(self, frame, event, arg):
        frame.f_trace_opcodes = True
        frame.f_trace_lines = False
        if event == "opcode":
            self.count += 1
        return self.trace


class _Parts:
    """Wraps the engine's launch / wait / launch_ahead: per call its wall time (or, traced, its
    bytecodes), attributed to the step launched last (launch_ahead follows its step's launch)."""

    def __init__(self, engine: TorchEngine, num_rows: int, counter: Optional[_Counter],
                 clock: Callable[[], float] = time.perf_counter):
        self.num_rows, self.counter, self.clock = num_rows, counter, clock
        self.steps: list[dict[str, float]] = []  # per launched step: part -> us (or bytecodes)
        self.is_full: list[bool] = []
        for part in PARTS:
            setattr(engine, part, self._wrap(part, getattr(engine, part)))

    def _wrap(self, part: str, fn: Callable) -> Callable:
        def timed(*args, **kwargs):
            if part == "launch":
                rows = args[0].rows
                self.steps.append(dict.fromkeys(PARTS, 0.0))
                self.is_full.append(len(rows) == self.num_rows and all(r.num_tokens == 1 for r in rows))
            entry = self.steps[-1] if part != "wait" else self.steps[self._index_of(args[0])]
            counter = self.counter
            if counter is not None:
                before = counter.count
                sys.settrace(counter.trace)
                try:
                    return fn(*args, **kwargs)
                finally:
                    sys.settrace(None)
                    entry[part] += counter.count - before
            clock = self.clock
            started = clock()
            try:
                return fn(*args, **kwargs)
            finally:
                entry[part] += (clock() - started) * 1e6
        return timed

    def _index_of(self, handle: Any) -> int:
        # the run loop waits for the step it launched last (one worker)
        return len(self.steps) - 1


def _requests(args) -> list[Request]:
    return [Request(id=f"r{i}", prompt_tokens=[(7 * i + j) % 1000 + 1 for j in range(args.prompt_len)],
                    max_tokens=args.output_len) for i in range(args.clients)]


def _one_run(plan: Plan, args, variant: str, is_traced: bool) -> dict[str, Any]:
    """One closed-loop run; per full decode step the parts' microseconds (or bytecodes when traced)."""
    page_size = next((p.page_size for p in plan.deployment.kv_pools), 16)
    num_pages = args.clients * (-(-(args.prompt_len + args.output_len + 1) // page_size) + 1)
    engine, runner = build_engine(plan, variant == "ahead", num_pages, is_columnar=not args.per_row)
    parts = _Parts(engine, args.clients, _Counter() if is_traced else None,
                   time.thread_time if args.cpu_time else time.perf_counter)
    driver = Driver(plan, engine)
    driver.run(Workload(_requests(args), closed_concurrency=args.clients))
    failed = [r.finish_reason for r in driver.conductor.records.values() if (r.finish_reason or "").startswith("error")]
    if failed:  # a fault of the bench's own stand-in or of the runner, not a short run: say which
        raise BenchError(f"{len(failed)} of {args.clients} requests failed, the first with {failed[0]}")
    full = [step for step, is_full in zip(parts.steps, parts.is_full) if is_full]
    return {"steps": full, "num_ahead_rows": runner.num_ahead_rows, "num_claimed_rows": runner.num_claimed_rows,
            "num_finished": driver.conductor.num_finished}


def measure(args) -> dict[str, Any]:
    plan = load_plan(args.plan, verify=False)
    timed: dict[str, list[dict[str, float]]] = {v: [] for v in VARIANTS}
    claims: dict[str, tuple[int, int]] = {}
    for _ in range(args.rounds):
        for variant in VARIANTS:
            run = _one_run(plan, args, variant, is_traced=False)
            if not run["steps"]:
                raise BenchError(f"no full decode step of {args.clients} rows ran (raise --output-len)")
            p50 = {part: float(np.percentile([s[part] for s in run["steps"]], 50)) for part in PARTS}
            totals = [sum(s.values()) for s in run["steps"]]
            p50["total"] = float(np.percentile(totals, 50))
            # The slow steps matter as much as the typical one: while the host's step is longer
            # than the device's, the device waits (a page boundary crossed by every row at once).
            p50["total_p90"], p50["total_max"] = float(np.percentile(totals, 90)), float(max(totals))
            timed[variant].append(p50)
            claims[variant] = (run["num_ahead_rows"], run["num_claimed_rows"])
    result: dict[str, Any] = {"plan": str(args.plan), "clients": args.clients, "prompt_len": args.prompt_len,
                              "output_len": args.output_len, "rounds": args.rounds, "variants": {},
                              "steps": "per-row" if args.per_row else "columns",
                              "clock": "thread cpu" if args.cpu_time else "wall"}
    for variant in VARIANTS:
        runs = timed[variant]
        medians = {key: float(median(r[key] for r in runs)) for key in runs[0]}
        entry: dict[str, Any] = {"p50_us_per_step": {key: medians[key] for key in (*PARTS, "total")},
                                 "total_us_per_step": {"p90": medians["total_p90"], "largest": medians["total_max"]},
                                 "rows_launched_ahead": claims[variant][0], "rows_claimed": claims[variant][1]}
        if args.bytecodes:
            steps = _one_run(plan, args, variant, is_traced=True)["steps"]
            num_rows = len(steps) * args.clients
            per_row = {part: sum(s[part] for s in steps) / num_rows for part in PARTS}
            per_row["total"] = sum(per_row.values())
            entry["bytecodes_per_row"] = per_row
        result["variants"][variant] = entry
    ahead, serial = (result["variants"][v]["p50_us_per_step"]["total"] for v in VARIANTS)
    result["ahead_over_no_ahead"] = ahead / serial if serial else None
    return result


def render(result: dict[str, Any]) -> str:
    lines = [f"plan {result['plan']}: {result['clients']} clients, prompt {result['prompt_len']}, output "
             f"{result['output_len']} tokens; device step stubbed; full decode steps of {result['clients']} rows "
             f"({result['steps']}); median of {result['rounds']} round(s), variants interleaved; "
             f"microseconds of {result['clock']} time",
             f"{'variant':<9} {'':<14} " + " ".join(f"{p:>12}" for p in (*PARTS, "total"))]
    for variant, entry in result["variants"].items():
        p50, slow = entry["p50_us_per_step"], entry["total_us_per_step"]
        lines.append(f"{variant:<9} {'us/step p50':<14} " + " ".join(f"{p50[p]:>12.1f}" for p in (*PARTS, "total"))
                     + f"   (total p90 {slow['p90']:.1f}, largest {slow['largest']:.1f})")
        if "bytecodes_per_row" in entry:
            codes = entry["bytecodes_per_row"]
            lines.append(f"{variant:<9} {'bytecodes/row':<14} "
                         + " ".join(f"{codes[p]:>12.1f}" for p in (*PARTS, "total")))
    ahead = result["variants"]["ahead"]
    lines.append(f"run ahead: {ahead['rows_claimed']} of {ahead['rows_launched_ahead']} rows launched ahead "
                 f"claimed (last round); ahead / no-ahead host time per step: {result['ahead_over_no_ahead']:.2f}x")
    return "\n".join(lines)


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="mstar bench runner", description=__doc__.split("\n")[0])
    parser.add_argument("--plan", type=Path, default=Path("generated/llama.plan"))
    count = int_range(1, 100_000)
    parser.add_argument("--clients", type=count, default=64, help="concurrent requests: rows of a full decode step")
    parser.add_argument("--prompt-len", type=count, default=16)
    parser.add_argument("--output-len", type=count, default=128)
    parser.add_argument("--rounds", type=count, default=3)
    parser.add_argument("--json", action="store_true", help="print the figures as JSON")
    parser.add_argument("--no-bytecodes", dest="bytecodes", action="store_false",
                        help="skip the traced runs that count bytecodes per row")
    parser.add_argument("--per-row", action="store_true",
                        help="run steady decode steps row by row (the runner's columns off: gpu/decode_columns.py)")
    parser.add_argument("--cpu-time", action="store_true",
                        help="time with this thread's CPU time, which other jobs on the machine do not add to")
    args = parser.parse_args(argv)
    try:
        result = measure(args)
    except (PlanError, EngineError, BenchError) as error:
        print(f"mstar bench runner: {error}", file=sys.stderr)
        return 1
    print(json.dumps(result, indent=1, sort_keys=True) if args.json else render(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
