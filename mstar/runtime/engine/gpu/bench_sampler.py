"""`mstar bench sampler`: what the device sampler (`sampler.sample`) costs a step, per kind of
request, at 1, 8 and 64 rows of a vocabulary (default 128,256: Llama-3.2-1B's, llama.plan's):
greedy rows (the executor's argmax, no sampler), temperature alone (the whole-vocabulary draw), a
top_p of 0.9, a top_k of 50 and both (the sorted nucleus; with both, top_p of the top 50's mass),
each with the torch ops and with the Triton
draws (`sampling_kernels.py`) where they run ("fused": the whole draw, or a nucleus by torch's sort
with the kernels' noise; "search": a nucleus by `nucleus_draw`'s search, `sampler.NUCLEUS`), their
ratios measured in the same run. Each figure is the median of `--iters` eager calls (the executor
calls the sampler eagerly, after the step's graph), timed with CUDA events on a GPU; on the CPU the
torch ops alone, by the clock (no kernels there, so no ratios; absolute times count on a GPU). Beside the draws, what
the step's other sampling work costs: `penalise` (a repetition and a presence penalty, 1,000
tokens seen and 64 sampled a row held in a `PenaltyTable`, a step adding one of each: the host's
update built and applied, then the rules: by the Triton kernels of `penalty_kernels.py` where they
run, beside the torch ops) and `logprob_tensors` (one
alternative). Each variant gives the share of rows whose tokens are the torch ops' ("same": the
kernels' noise is the torch ops' bit for bit; a search keeps the ties at a nucleus' edge that the
sort cuts, and bf16 logits tie often).

Usage: mstar bench sampler [--vocab V] [--rows 1,8,64] [--iters N] [--device cuda|cpu] [--json]
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from functools import partial
from types import SimpleNamespace
from typing import Callable, Optional, Sequence

import numpy as np
import torch

from mstar.arg_types import ITERS, int_list, int_range
from mstar.runtime.engine.gpu import kernels
from mstar.runtime.engine.gpu.sampler import sample

LLAMA_VOCAB = 128256
# kind -> (temperature, top_p, top_k) of every row
KINDS = {"temperature": (1.0, 1.0, 0), "top_p": (0.9, 0.9, 0), "top_k": (1.0, 1.0, 50),
         "top_k_top_p": (1.0, 0.9, 50)}  # (both: the search finds the top k, then top_p of its mass)


def _timed_us(call: Callable[[], torch.Tensor], iters: int, device: torch.device) -> float:
    """Median microseconds of one call (two warm-up calls first)."""
    for _ in range(2):
        call()
    times = []
    for _ in range(iters):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            call()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) * 1e3)
        else:
            began = time.perf_counter()
            call()
            times.append((time.perf_counter() - began) * 1e6)
    return statistics.median(times)


def run(vocab: int, rows_list: Sequence[int], iters: int, device: torch.device) -> dict:
    has_kernels = kernels.available(device)
    cases: dict[str, dict] = {}
    for done, rows in enumerate(rows_list):
        # a line of progress on stderr: the torch ops on the CPU took about a minute, silent, at the defaults
        print(f"mstar bench sampler: {rows} rows ({done + 1}/{len(rows_list)})", file=sys.stderr, flush=True)
        generator = torch.Generator().manual_seed(rows)
        logits = (torch.randn(rows, vocab, generator=generator) * 3).to(device, torch.bfloat16)
        seeds = torch.arange(rows, dtype=torch.long, device=device) * 7919
        counters = torch.full((rows,), 5, dtype=torch.long, device=device)
        case: dict = {"greedy_us": round(_timed_us(partial(logits.argmax, -1), iters, device), 2)}
        for kind, (temperature, top_p, top_k) in KINDS.items():
            args = (logits, torch.full((rows,), temperature, device=device), torch.full((rows,), top_p, device=device),
                    seeds, counters, torch.full((rows,), top_k, dtype=torch.long, device=device) if top_k else None)
            is_whole = top_p >= 1.0 and not top_k
            variants: dict[str, dict] = {"torch": {"is_fused": False}}
            if has_kernels:  # the whole draw, or a nucleus by torch's sort with the kernels' noise; and by search
                variants["fused"] = {"is_fused": True, "nucleus": "sort"}
                if not is_whole:  # (has_both as the executor tells it)
                    variants["search"] = {"is_fused": True, "nucleus": "search", "has_both": bool(top_k) and top_p < 1}
            figures = {f"{name}_us": round(_timed_us(partial(sample, *args, is_whole=is_whole, **options), iters,
                                                     device), 2) for name, options in variants.items()}
            expected = sample(*args, is_whole=is_whole, is_fused=False)
            for name, options in list(variants.items())[1:]:
                figures[f"torch_over_{name}"] = round(figures["torch_us"] / figures[f"{name}_us"], 2)
                same = sample(*args, is_whole=is_whole, **options) == expected
                figures[f"{name}_same_rows"] = round(float(same.float().mean()), 3)
            case[kind] = figures
        case.update(_beside_the_draw(logits, iters, device))
        cases[str(rows)] = case
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    return {"vocab": vocab, "device": name, "has_kernels": has_kernels, "rows": cases}


# the penalties' workload a row: a repetition and a presence penalty over SEEN_TOKENS tokens seen
# (a prompt's) and SAMPLED_TOKENS sampled
SEEN_TOKENS, SAMPLED_TOKENS = 1000, 64


def _beside_the_draw(logits: torch.Tensor, iters: int, device: torch.device) -> dict[str, float]:
    """What a step's sampling rows cost besides the draw, the executor's calls as they are:
    `penalise` (each row's request in a `PenaltyTable` holding its seen and sampled tokens, one more
    of each a step: the host's update built, moved and applied, then the rules) and
    `logprob_tensors` (one alternative a row)."""
    from mstar.runtime.engine.gpu.penalties import PenaltyTable, penalise
    from mstar.runtime.engine.sampling import SamplingParams, logprob_tensors

    rows, vocab = logits.shape
    generator = np.random.default_rng(rows)
    params = SamplingParams(repetition_penalty=1.1, presence_penalty=0.5)
    requests = [SimpleNamespace(request_id=f"r{row}", params=params,
                                history={"LLM": generator.integers(0, vocab, SEEN_TOKENS).tolist()},
                                sampled={"LLM": generator.integers(0, vocab, SAMPLED_TOKENS).tolist()})
                for row in range(rows)]

    def step(penalty_table: PenaltyTable, is_fused: bool) -> torch.Tensor:
        for request in requests:  # a decode step's new sample, fed next
            request.sampled["LLM"].append(request.history["LLM"][-1])
            request.history["LLM"].append(request.sampled["LLM"][-1])
        penalised = penalty_table.rows([(row, request, ()) for row, request in enumerate(requests)], "LLM")
        return penalise(logits, penalised, penalty_table, is_fused=is_fused)  # (bf16, as the executor passes them)

    tokens = logits.argmax(-1)
    figures = {"penalise_torch_us": round(_timed_us(partial(step, PenaltyTable(device), False), iters, device), 2)}
    if kernels.available(device):  # (penalty_kernels.py, where `penalise` takes them)
        figures["penalise_us"] = round(_timed_us(partial(step, PenaltyTable(device), True), iters, device), 2)
    figures["logprobs_us"] = round(_timed_us(lambda: logprob_tensors(logits, tokens, 1)[0], iters, device), 2)
    return figures


def table(result: dict) -> str:
    lines = [f"the device sampler per step, vocabulary {result['vocab']}, on {result['device']} "
             f"(median us of eager calls; greedy: the argmax alone)"]
    header = f"{'rows':>5} {'greedy':>8}"
    for kind in KINDS:
        header += f" {kind + ' torch':>18}"
        for name in _fused_variants(result, kind):
            header += f" {name:>9} {'ratio':>6} {'same':>5}"
    lines.append(header)
    for rows, case in result["rows"].items():
        line = f"{rows:>5} {case['greedy_us']:>8.1f}"
        for kind in KINDS:
            figures = case[kind]
            line += f" {figures['torch_us']:>18.1f}"
            for name in _fused_variants(result, kind):
                line += (f" {figures[name + '_us']:>9.1f} {figures['torch_over_' + name]:>5.2f}x"
                         f" {figures[name + '_same_rows']:>5.2f}")
        lines.append(line)
    lines.append(f"besides the draw: penalise (repetition and presence penalties, {SEEN_TOKENS} tokens seen and "
                 f"{SAMPLED_TOKENS} sampled a row in the table, one more of each a step) "
                 f"and the log-probabilities (one alternative), us: "
                 + "; ".join(f"{rows} rows {_penalise(case)} and {case['logprobs_us']:.1f}"
                             for rows, case in result["rows"].items()))
    if not result["has_kernels"]:
        lines.append("(no Triton draws here: they run on a CUDA GPU; the torch ops alone were timed)")
    return "\n".join(lines)


def _penalise(case: dict) -> str:
    """`penalise`'s figure: the kernels' beside the torch ops' where both ran, else the torch ops'
    alone (the CPU printed that one twice, as if the kernels had been timed)."""
    if "penalise_us" not in case:
        return f"{case['penalise_torch_us']:.1f} (torch ops)"
    return f"{case['penalise_us']:.1f} (torch ops {case['penalise_torch_us']:.1f})"


def _fused_variants(result: dict, kind: str) -> list[str]:
    """The kernels' variants a kind was timed with (none without them)."""
    first = next(iter(result["rows"].values()))[kind]
    return [name for name in ("fused", "search") if f"{name}_us" in first]


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="mstar bench sampler", description=__doc__.split("\n")[0])
    parser.add_argument("--vocab", type=int_range(2, 1 << 20), default=LLAMA_VOCAB)
    parser.add_argument("--rows", type=int_list(1, 4096), default=[1, 8, 64])
    parser.add_argument("--iters", type=ITERS, default=20)
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--json", action="store_true", help="print the figures as JSON")
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("mstar bench sampler: error: --device cuda needs a CUDA GPU; none is visible", file=sys.stderr)
        return 1
    result = run(args.vocab, args.rows, args.iters, torch.device(args.device))
    print(json.dumps(result) if args.json else table(result))
    return 0
