"""`mstar`: run a compiled plan (`mstar run`) and benchmark the scheduler (`mstar bench scheduler`).

    mstar run --plan generated/orpheus.plan                       # torch engine, tiny dims
    mstar run --plan generated/orpheus.plan --engine sim --requests 10000
    mstar run --plan P --prompts prompts.jsonl --out outdir --report run.json --timeline run.png
    mstar bench scheduler --json

Exit status: 0 when every request ran (a request that failed alone is reported, not fatal);
1 for a refused plan, a bad workload or an engine that cannot start (one message, no
traceback); 2 for bad command-line usage.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any, Optional, Sequence

from mstar.runtime.serve.workload import (
    ARRIVALS, WorkloadError, check_route, generate, parse_range, parse_route, read_prompts, route_names,
)


class CliError(Exception):
    """A user-facing failure: printed as `mstar: error: <message>`, exit 1."""


def _run_parser(sub: Any) -> None:
    run = sub.add_parser("run", help="run a compiled plan on a workload and print its metrics",
                         description="Run a compiled plan on a generated workload or a prompts file.")
    run.add_argument("--plan", required=True, help="compiled plan (generated/<config>.plan)")
    run.add_argument("--engine", choices=("torch", "sim"), default="torch",
                     help="torch: real models on the CPU (default); sim: cost-model engine")
    run.add_argument("--requests", type=int, default=8, help="generated requests (default 8)")
    run.add_argument("--concurrency", type=int, default=8,
                     help="closed-loop clients (default 8; --arrival closed and --prompts)")
    run.add_argument("--prompt-len", default="8..32", help="prompt length range A..B (default 8..32)")
    run.add_argument("--output-len", default="32..64", help="max output tokens range A..B (default 32..64)")
    run.add_argument("--arrival", choices=ARRIVALS, default="closed", help="arrival process (default closed)")
    run.add_argument("--rate", type=float, default=100.0, help="requests/s for poisson and staggered (default 100)")
    run.add_argument("--seed", type=int, default=0, help="workload and engine seed (default 0)")
    run.add_argument("--prompts", help="JSONL file of requests instead of a generated workload")
    run.add_argument("--route", action="append", default=[], metavar="PARTITION=WALK,WALK",
                     help="walks every request takes in a partition (repeatable), e.g. LLM=prefill_text,image_gen")
    run.add_argument("--out", help="directory for outputs.jsonl and media (WAV, PNG)")
    run.add_argument("--report", help="write the metrics as JSON to this file")
    run.add_argument("--timeline", help="draw step composition and latency over time to this PNG")
    run.add_argument("--dims", choices=("tiny", "spec"), default="tiny", help="torch engine model dims (default tiny)")
    run.add_argument("--weights", action="append", metavar="[NODE=]DIR",
                     help="torch engine: a local checkpoint directory (config.json + *.safetensors) for "
                          "the plan's kv node; NODE=DIR when the plan has several (repeat per node)")
    run.add_argument("--kv-pages", type=int, help="KV pool pages per kv node (overrides the plan)")
    run.add_argument("--device", default="cpu",
                     help="torch engine: cpu (fp32, default) or cuda[:N] (bf16 autocast, KV cache in bf16)")
    run.add_argument("--attention", choices=("auto", "torch", "flashinfer"), default="auto",
                     help="torch engine attention: FlashInfer on a GPU where it can run (auto, default), "
                          "the torch path, or FlashInfer required")
    run.add_argument("--no-progress", action="store_true", help="no progress bar")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="mstar", description="Run compiled mstar plans.")
    sub = parser.add_subparsers(dest="command", required=True)
    _run_parser(sub)
    bench = sub.add_parser("bench", help="benchmarks")
    bench.add_argument("what", choices=("scheduler", "attention"),
                       help="scheduler: host time per step decision; attention: FlashInfer vs torch on a GPU")
    return parser


def _load_plan(path: str):
    from mstar.plan.io import PlanError, load_plan

    try:
        return load_plan(path)
    except PlanError as error:
        raise CliError(str(error)) from None


def _engine(plan: Any, args: argparse.Namespace) -> Any:
    if args.kv_pages is not None and args.kv_pages <= 0:
        raise CliError(f"--kv-pages must be a positive number of pages, got {args.kv_pages}")
    if args.engine == "sim":
        from mstar.runtime.engine.sim import SimEngine

        return SimEngine(plan, seed=args.seed, num_pages=args.kv_pages)
    try:
        from mstar.runtime.engine import torch_engine
    except ImportError as error:
        raise CliError(f"the torch engine is not available ({error}); use --engine sim") from None
    if args.dims == "spec":  # full-size models initialise for a while before the progress bar starts
        print("mstar: building the models at the spec's dims (random weights are drawn on the CPU; "
              "a 1B model takes about a minute)...", file=sys.stderr, flush=True)
    try:
        return torch_engine.build(plan, args)
    except ValueError as error:  # EngineError and the engine's other start-up refusals
        raise CliError(str(error)) from None


def _workload(args: argparse.Namespace, plan: Any) -> Any:
    """The run's requests, each route checked against the plan's partitions and walks."""
    names = route_names(plan)
    try:
        route = parse_route(args.route)
        check_route(route, names, "--route")
        if args.prompts:
            workload = read_prompts(args.prompts, concurrency=args.concurrency, names=names)
        else:
            workload = generate(
                args.requests,
                prompt_len=parse_range(args.prompt_len, "--prompt-len"),
                output_len=parse_range(args.output_len, "--output-len"),
                arrival=args.arrival,
                concurrency=args.concurrency,
                rate=args.rate,
                seed=args.seed,
            )
    except WorkloadError as error:
        raise CliError(str(error)) from None
    for request in workload.requests:
        for partition, walks in route.items():
            request.route.setdefault(partition, walks)
    return workload


def _check_file_target(option: str, path: str) -> None:
    """Refuse a file output that cannot be written: a directory, or an unwritable place."""
    if os.path.isdir(path):
        raise CliError(f"{option} {path} is a directory")
    parent = os.path.dirname(os.path.abspath(path))
    try:
        os.makedirs(parent, exist_ok=True)
    except OSError as error:
        raise CliError(f"{option} {path}: cannot create directory {parent}: {error.strerror}") from None
    target = path if os.path.exists(path) else parent
    if not os.access(target, os.W_OK):
        raise CliError(f"{option} {path} is not writable")


def _check_outputs(args: argparse.Namespace) -> None:
    """Check --out, --report and --timeline before the run, so a bad path costs no run time."""
    if args.out:
        if os.path.exists(args.out) and not os.path.isdir(args.out):
            raise CliError(f"--out {args.out} exists and is not a directory")
        try:
            os.makedirs(args.out, exist_ok=True)
        except OSError as error:
            raise CliError(f"--out {args.out}: cannot create directory: {error.strerror}") from None
        if not os.access(args.out, os.W_OK):
            raise CliError(f"--out {args.out} is not writable")
    for option, path in (("--report", args.report), ("--timeline", args.timeline)):
        if path:
            _check_file_target(option, path)
    if args.timeline:
        from mstar.runtime.serve.timeline import format_problem

        problem = format_problem(args.timeline)
        if problem:
            raise CliError(f"--timeline {args.timeline}: {problem}")


def _tokens_json(values: list[Any]) -> list[Any]:
    out = []
    for value in values:
        item = getattr(value, "tolist", None)
        out.append(item() if callable(item) else value)
    return out


def _write_outputs(out_dir: str, records: list[Any], plan: Any) -> None:
    os.makedirs(out_dir, exist_ok=True)
    sample_rate = next(
        (n.dims["sample_rate"] for n in plan.nodes if isinstance(n.dims.get("sample_rate"), int)), 24000
    )
    with open(os.path.join(out_dir, "outputs.jsonl"), "w", encoding="utf-8") as handle:
        for record in records:
            ttft = None
            if record.first_token_s is not None:
                ttft = round((record.first_token_s - record.arrival_s) * 1000.0, 3)
            line = {"id": record.request.id, "output_tokens": _tokens_json(record.output_tokens),
                    "ttft_ms": ttft, "finish_reason": record.finish_reason}
            handle.write(json.dumps(line) + "\n")
    audio = {r.request.id: [e.value for e in r.emissions if e.modality == "audio"] for r in records}
    images = {r.request.id: [e.value for e in r.emissions if e.modality == "image"] for r in records}
    if not any(audio.values()) and not any(images.values()):
        return
    from mstar.runtime.serve import media

    for request_id, chunks in audio.items():
        if chunks:
            media.write_wav(os.path.join(out_dir, f"{request_id}.wav"), chunks, sample_rate)
    for request_id, values in images.items():
        for index, image in enumerate(values):
            suffix = "" if len(values) == 1 else f"_{index}"
            try:
                media.write_png(os.path.join(out_dir, f"{request_id}{suffix}.png"), image)
            except ValueError as error:
                print(f"mstar: warning: {request_id}: image not written: {error}", file=sys.stderr)


def run_command(args: argparse.Namespace) -> int:
    from mstar.runtime.serve.driver import Driver, DriverError
    from mstar.runtime.scheduler.key_tables import PlanTableError
    from mstar.runtime.serve.metrics import error_lines, render_table, summarize

    plan = _load_plan(args.plan)
    workload = _workload(args, plan)
    _check_outputs(args)
    engine = _engine(plan, args)
    progress = None
    if not args.no_progress:
        from tqdm import tqdm

        progress = tqdm(total=len(workload.requests), desc="requests", unit="req", file=sys.stderr,
                        disable=not sys.stderr.isatty())
    try:
        driver = Driver(plan, engine, on_finish=progress.update if progress is not None else None)
        started = time.perf_counter()
        driver.run(workload)
    except (DriverError, PlanTableError) as error:  # a plan whose tables do not hold together
        raise CliError(str(error)) from None
    host_wall_s = time.perf_counter() - started
    if progress is not None:
        progress.close()
    records = list(driver.conductor.records.values())
    summary = summarize(records, driver.log, host_wall_s)
    summary["plan"] = args.plan
    summary["engine"] = args.engine
    from rich.console import Console

    Console().print(render_table(summary))
    for line in error_lines(records):
        print(f"mstar: {line}", file=sys.stderr)
    if args.report:
        with open(args.report, "w", encoding="utf-8") as handle:
            json.dump(summary, handle, indent=2, sort_keys=True)
    if args.timeline:
        from mstar.runtime.serve.timeline import draw

        draw(driver.log, records, args.timeline, origin_s=driver.origin_s)
    if args.out:
        _write_outputs(args.out, records, plan)
    return 0


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:2] == ["bench", "scheduler"]:
        from mstar.runtime.serve import bench_scheduler

        return bench_scheduler.main(argv[2:])
    if argv[:2] == ["bench", "attention"]:
        from mstar.runtime.serve import bench_attention

        return bench_attention.main(argv[2:])
    args = _parser().parse_args(argv)
    try:
        return run_command(args)
    except CliError as error:
        print(f"mstar: error: {error}", file=sys.stderr)
        return 1
    except OSError as error:
        print(f"mstar: error: {error}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("mstar: interrupted", file=sys.stderr)
        return 1
    except Exception as error:  # a bug (or a plan edited by hand with its hash redone): no traceback
        if os.environ.get("MSTAR_TRACEBACK"):
            raise
        print(f"mstar: internal error ({type(error).__name__}: {error}); this is a bug in mstar, or the "
              "plan was edited by hand (recompile it with mstarc). Set MSTAR_TRACEBACK=1 to see where.",
              file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
