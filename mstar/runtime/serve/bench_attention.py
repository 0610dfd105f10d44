"""`mstar bench attention`: one mixed step's paged attention on a GPU, FlashInfer vs the torch path.

The step is the one the engine packs for a combined walk: 30 decode rows (one new token each after
contexts of 200..867 tokens) beside two prompt chunks of 300 and 700 fresh tokens, over a bf16
paged cache (page size 16, NHD). Both variants get the same q/k/v and cache; times are per layer
call, measured with CUDA events in one run (FlashInfer's per-step `plan()` is timed apart: it runs
once per step, not per layer). Also prints the relative error of FlashInfer against the torch path.

With `--decode`, the decode graphs' attention instead: the Triton decode kernel against FlashInfer's
decode kernels per layer call in CUDA graphs (`engine/gpu/bench_decode_attention.py`).

Usage: mstar bench attention [--decode [--context N] [--spread] [--split-what-ifs]] [--json] [--iters N]
       [--head-dim D] [--qo-heads H] [--kv-heads H]
Needs a CUDA GPU and the gpu extra (flashinfer-python); elsewhere it says so and exits 1.
"""
from __future__ import annotations

import argparse
import json
import sys
from typing import Callable, Optional, Sequence

import torch

from mstar.arg_types import ITERS, int_range
from mstar.runtime.engine.attention.torch_paged import Segment, paged_attention

PAGE_SIZE = 16
ROWS = [(1, 200 + 23 * i) for i in range(30)] + [(300, 0), (700, 0)]  # (new tokens, cached tokens)


def paged_step(rows: list[tuple[int, int]], page_size: int, num_pages: int, device: torch.device,
               generator: torch.Generator) -> tuple[list[Segment], list[list[int]], int]:
    """A packed step over a cache of `num_pages` pages: per (new tokens, cached tokens) row a
    segment whose page table takes random free pages. Returns (segments, page tables, tokens)."""
    free = torch.randperm(num_pages, generator=generator).tolist()
    segments, tables, start = [], [], 0
    for num_tokens, num_cached in rows:
        total = num_tokens + num_cached
        table = [free.pop() for _ in range(-(-total // page_size))]
        pos = torch.arange(total)
        flat = torch.tensor(table)[pos // page_size] * page_size + pos % page_size
        segments.append(Segment(start, num_tokens, num_cached, flat.to(device)))
        tables.append(table)
        start += num_tokens
    return segments, tables, start


def _time_us(fn: Callable[[], object], iters: int) -> float:
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1000.0 / iters


def run(iters: int, head_dim: int, qo_heads: int, kv_heads: int) -> dict:
    import time

    from mstar.runtime.engine.attention.flashinfer_paged import FlashInferAttention

    device = torch.device("cuda")
    generator = torch.Generator().manual_seed(0)
    num_pages = sum(-(-(n + c) // PAGE_SIZE) for n, c in ROWS) + 8
    segments, tables, start = paged_step(ROWS, PAGE_SIZE, num_pages, device, generator)
    shape = lambda heads: (start, heads, head_dim)  # noqa: E731
    q = torch.randn(shape(qo_heads), generator=generator).to(device, torch.bfloat16)
    k = torch.randn(shape(kv_heads), generator=generator).to(device, torch.bfloat16)
    v = torch.randn(shape(kv_heads), generator=generator).to(device, torch.bfloat16)
    cache = [torch.randn(num_pages * PAGE_SIZE, kv_heads, head_dim, generator=generator).to(device, torch.bfloat16)
             for _ in range(2)]
    scale = head_dim ** -0.5
    start_up = time.perf_counter()
    backend = FlashInferAttention(device, qo_heads, kv_heads, head_dim, PAGE_SIZE)  # JIT-compiles here
    start_up_s = time.perf_counter() - start_up
    rows = [(s.num_tokens, s.num_cached, t) for s, t in zip(segments, tables)]
    new_index = torch.cat([s.flat_index[s.num_cached:] for s in segments]).cpu()
    attend = backend.plan_step(rows, new_index, scale)
    fast = attend(q, k, v, *cache, scale)
    with torch.device(device):
        slow = paged_attention(q, k, v, cache[0], cache[1], segments, scale)
    error = ((fast.float() - slow.float()).norm() / slow.float().norm()).item()
    with torch.device(device):  # paged_attention builds its masks on the default device
        torch_us = _time_us(lambda: paged_attention(q, k, v, cache[0], cache[1], segments, scale), max(1, iters // 10))
    flashinfer_us = _time_us(lambda: attend(q, k, v, *cache, scale), iters)
    plan_us = _time_us(lambda: backend.plan_step(rows, new_index, scale), max(1, iters // 10))
    return {
        "step": {"decode_rows": 30, "prompt_tokens": [300, 700], "head_dim": head_dim, "qo_heads": qo_heads,
                 "kv_heads": kv_heads, "page_size": PAGE_SIZE, "dtype": "bfloat16"},
        "torch_us": round(torch_us, 1), "flashinfer_us": round(flashinfer_us, 1),
        "flashinfer_plan_us": round(plan_us, 1), "speedup": round(torch_us / flashinfer_us, 1),
        "relative_error": error, "start_up_s": round(start_up_s, 1),
        "device": torch.cuda.get_device_name(device),
    }


MAX_DECODE_REPLAYS = 100


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="mstar bench attention", description=__doc__.split("\n")[0])
    parser.add_argument("--json", action="store_true", help="print one JSON object and nothing else")
    parser.add_argument("--iters", type=ITERS, help="timed FlashInfer calls (torch: a tenth; default 200); --decode: "
                                                    "graph replays, at most 100 (the default)")
    parser.add_argument("--head-dim", type=int_range(64, 256), default=128, choices=(64, 128, 256))
    parser.add_argument("--qo-heads", type=int_range(1, 256), default=32)
    parser.add_argument("--kv-heads", type=int_range(1, 256), default=8)
    parser.add_argument("--decode", action="store_true",
                        help="the decode graphs' attention: the Triton decode kernel against FlashInfer's, at 1 to "
                             "64 rows (--iters: graph replays)")
    parser.add_argument("--context", type=int_range(1, 1 << 20), help="--decode: positions a row (default 1024)")
    parser.add_argument("--spread", action="store_true",
                        help="--decode: rows of unequal length, a quarter of --context to four times it")
    parser.add_argument("--split-what-ifs", action="store_true",
                        help="--decode: also time the Triton kernel at half and twice the graph's split count")
    args = parser.parse_args(argv)
    decode_only = [flag for flag, given in (("--context", args.context is not None), ("--spread", args.spread),
                                            ("--split-what-ifs", args.split_what_ifs)) if given]
    if decode_only and not args.decode:  # (they were accepted and ignored)
        parser.error(f"{', '.join(decode_only)}: options of --decode, which was not given")
    if args.decode and args.iters is not None and args.iters > MAX_DECODE_REPLAYS:  # (it was cut to 100 unsaid)
        parser.error(f"--decode: --iters is at most {MAX_DECODE_REPLAYS} graph replays, got {args.iters}")
    if args.qo_heads % args.kv_heads:
        parser.error(f"--qo-heads ({args.qo_heads}) must be a multiple of --kv-heads ({args.kv_heads})")
    from mstar.runtime.engine.attention.flashinfer_paged import unavailable_reason

    reason = unavailable_reason(torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu"),
                                args.head_dim)
    if reason is not None:
        print(f"mstar bench attention: {reason}", file=sys.stderr)
        return 1
    if args.decode:
        return _decode(args)
    result = run(args.iters or 200, args.head_dim, args.qo_heads, args.kv_heads)
    if args.json:
        print(json.dumps(result, sort_keys=True))
        return 0
    print(f"mixed step: 30 decode rows + prompts of 300 and 700 tokens, {args.qo_heads}/{args.kv_heads} heads "
          f"x {args.head_dim}, bf16, page size {PAGE_SIZE}, on {result['device']}")
    print(f"torch path       {result['torch_us']:>10.1f} us per layer")
    print(f"FlashInfer run   {result['flashinfer_us']:>10.1f} us per layer  ({result['speedup']}x)")
    print(f"FlashInfer plan  {result['flashinfer_plan_us']:>10.1f} us per step")
    print(f"relative error vs torch path: {result['relative_error']:.2e}; FlashInfer start-up (JIT "
          f"compile and warm-up, cached on disk after the first time) {result['start_up_s']} s")
    return 0


def _decode(args: argparse.Namespace) -> int:
    from mstar.runtime.engine.gpu import bench_decode_attention, decode_attention

    heads = (args.qo_heads, args.kv_heads, args.head_dim)
    if not decode_attention.supports(*heads):
        print(f"mstar bench attention --decode: the Triton decode kernel does not serve {heads[0]}/{heads[1]} heads "
              f"x {heads[2]} (decode_attention.supports)", file=sys.stderr)
        return 1
    result = bench_decode_attention.run(args.iters or MAX_DECODE_REPLAYS, args.context or 1024, heads, args.spread,
                                        args.split_what_ifs)
    print(json.dumps(result, sort_keys=True) if args.json else bench_decode_attention.table(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
