"""`mstar bench offload`: what a KV host pool does to a load, on the simulated engine.

The same poisson workload runs twice per seed on the simulated engine (its admission and offload
are the torch engines' code, kv/admission.py and kv/offload.py), on `--kv-pages` device pages a kv
node: without a host pool and with `--host-pages` (default: the plan's, else 4096). Per run: the
simulated span (first arrival to the last step's end), the TTFT median and p90, the request latency
(arrival to finish) p99 and most (simulated seconds: a request a host pool moved out and kept
waiting shows there, not in the TTFT), the pages moved to the host, and the host pool's span, TTFT
and latency p99 as ratios of the same seed's run without it. The sim charges `sim.PAGE_MOVE_S` a
page moved; its step times are its roofline (docs/runtime.md, "Simulated engine"), so the figures
say what the policy does, not what a GPU takes.

Usage: mstar bench offload [--plan generated/llama_chunked.plan] [--requests 2000] [--rate 2000]
                           [--kv-pages 256] [--host-pages N] [--prompt-len 8..40]
                           [--output-len 8..60] [--seeds 1,2] [--json]
"""
from __future__ import annotations

import argparse
import sys
from statistics import median
from typing import Any, Optional

from mstar.arg_types import float_range, int_list, int_range, path_arg
from mstar.plan.io import load_plan
from mstar.plan.schema import Plan
from mstar.runtime.serve.bench_runner import BenchError, measure_and_print
from mstar.runtime.serve.driver import Driver
from mstar.runtime.serve.workload import WorkloadError, generate, parse_range

DEFAULT_HOST_PAGES = 4096  # llama_chunked's own (configs/llama_chunked.yaml)


def with_host_pages(plan: Plan, host_pages: int) -> Plan:
    """The plan with every kv node's host pool `host_pages` pages (0: none)."""
    pools = [pool.model_copy(update={"host_pages": host_pages}) for pool in plan.deployment.kv_pools]
    return plan.model_copy(update={"deployment": plan.deployment.model_copy(update={"kv_pools": pools})})


def one_run(plan: Plan, args: argparse.Namespace, seed: int) -> dict[str, Any]:
    """One simulated run of the seed's workload: span, TTFT median and p90, request latency p99 and
    most, pages moved out."""
    from mstar.runtime.engine.sim import SimEngine

    try:
        workload = generate(args.requests, prompt_len=args.prompt_len, output_len=args.output_len,
                            arrival="poisson", rate=args.rate, seed=seed)
    except WorkloadError as error:
        raise BenchError(str(error)) from None
    engine = SimEngine(plan, num_pages=args.kv_pages)
    driver = Driver(plan, engine)
    driver.run(workload)
    records = list(driver.conductor.records.values())
    failed = [r.request.id for r in records if r.first_token_s is None]
    if failed:
        raise BenchError(f"{len(failed)} requests produced no token ({failed[0]}: {records[0].finish_reason}); "
                         "a pool too small for one request measures nothing: raise --kv-pages")
    ttfts = sorted(r.first_token_s - r.arrival_s for r in records if r.first_token_s is not None)
    latencies = sorted(r.finish_s - r.arrival_s for r in records if r.finish_s is not None)
    moved = sum(pool.offload.num_offloaded_pages for pool in engine.pools.values() if pool.offload is not None)
    return {"span_s": round(max(driver.log.end_s) - driver.origin_s, 4), "ttft_p50_s": round(median(ttfts), 4),
            "ttft_p90_s": round(_quantile(ttfts, 0.9), 4), "latency_p99_s": round(_quantile(latencies, 0.99), 4),
            "latency_max_s": round(latencies[-1], 4), "pages_moved": moved}


def _quantile(values: list[float], q: float) -> float:
    """The q-quantile of sorted values, the nearest rank below."""
    return values[int(q * (len(values) - 1))]


def measure(args: argparse.Namespace) -> dict[str, Any]:
    plan = load_plan(args.plan, verify=False)
    if not plan.deployment.kv_pools:
        raise BenchError(f"{args.plan} has no kv node: nothing to offload")
    host_pages = args.host_pages if args.host_pages is not None else (
        max(pool.host_pages for pool in plan.deployment.kv_pools) or DEFAULT_HOST_PAGES)
    runs = []
    for done, seed in enumerate(args.seeds):
        # a line of progress on stderr: the defaults' runs took about 30 s, silent
        print(f"mstar bench offload: seed {seed} ({done + 1}/{len(args.seeds)})", file=sys.stderr, flush=True)
        without = one_run(with_host_pages(plan, 0), args, seed)
        with_pool = one_run(with_host_pages(plan, host_pages), args, seed)
        runs.append({"seed": seed, "no_host_pool": without, "host_pool": with_pool,
                     "span_ratio": round(with_pool["span_s"] / without["span_s"], 3),
                     "ttft_p50_ratio": round(with_pool["ttft_p50_s"] / without["ttft_p50_s"], 3),
                     "latency_p99_ratio": round(with_pool["latency_p99_s"] / without["latency_p99_s"], 3)})
    return {"plan": str(args.plan), "requests": args.requests, "rate": args.rate, "kv_pages": args.kv_pages,
            "host_pages": host_pages, "prompt_len": list(args.prompt_len), "output_len": list(args.output_len),
            "runs": runs}


def render(result: dict[str, Any]) -> str:
    lines = [f"plan {result['plan']}: {result['requests']} requests, poisson at {result['rate']:g}/s, prompts "
             f"{'..'.join(map(str, result['prompt_len']))} tokens, outputs {'..'.join(map(str, result['output_len']))}"
             f"; {result['kv_pages']} device pages, host pool {result['host_pages']} pages; the simulated engine "
             "(simulated seconds)",
             f"  {'seed':>4}  {'host pool':<9}  {'span s':>8}  {'TTFT p50':>9}  {'TTFT p90':>9}  {'latency p99':>11}  "
             f"{'latency max':>11}  {'pages moved':>11}"]
    for run in result["runs"]:
        for name, key in (("none", "no_host_pool"), ("on", "host_pool")):
            figures = run[key]
            lines.append(f"  {run['seed']:>4}  {name:<9}  {figures['span_s']:>8.3f}  {figures['ttft_p50_s']:>9.3f}  "
                         f"{figures['ttft_p90_s']:>9.3f}  {figures['latency_p99_s']:>11.3f}  "
                         f"{figures['latency_max_s']:>11.3f}  {figures['pages_moved']:>11}")
        lines.append(f"  {run['seed']:>4}  on / none  {run['span_ratio']:>7.3f}x  {run['ttft_p50_ratio']:>8.3f}x  "
                     f"{'':>9}  {run['latency_p99_ratio']:>10.3f}x")
    return "\n".join(lines)


def _range(what: str):
    def parse(text: str) -> tuple[int, int]:
        try:
            return parse_range(text, what, most=1_000_000)
        except WorkloadError as error:
            raise argparse.ArgumentTypeError(str(error)) from None
    return parse


def _seeds(text: str) -> list[int]:
    seeds = int_list(-2**31, 2**31)(text)
    if len(seeds) > 100:
        raise argparse.ArgumentTypeError(f"at most 100 seeds, got {len(seeds)}")
    return seeds


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="mstar bench offload", description=__doc__.split("\n")[0])
    parser.add_argument("--plan", type=path_arg, default="generated/llama_chunked.plan")
    parser.add_argument("--requests", type=int_range(1, 100_000), default=2000)
    parser.add_argument("--rate", type=float_range(0.0, 1e9, is_low_open=True), default=2000.0,
                        help="requests/s (poisson arrivals)")
    parser.add_argument("--kv-pages", type=int_range(1, 2**31 - 1), default=256, help="device pages a kv node")
    parser.add_argument("--host-pages", type=int_range(1, 2**31 - 1), default=None,
                        help=f"the host pool's pages (default: the plan's, else {DEFAULT_HOST_PAGES})")
    parser.add_argument("--prompt-len", type=_range("--prompt-len"), default=(8, 40))
    parser.add_argument("--output-len", type=_range("--output-len"), default=(8, 60))
    parser.add_argument("--seeds", type=_seeds, default=[1, 2], help="workload seeds, comma-separated")
    parser.add_argument("--json", action="store_true", help="print the figures as JSON")
    return measure_and_print("mstar bench offload", parser.parse_args(argv), measure, render)


if __name__ == "__main__":
    sys.exit(main())
