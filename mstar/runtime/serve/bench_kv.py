"""`mstar bench kv`: what chunked prefill under a step token budget does to the decode rows beside
a long prompt, and what the prefix cache does to the TTFT of prompts that share a prefix, measured
as ratios within one run.

Scenario (`--decode-rows 40 --prompt-len 8192` by default): that many requests decode (16-token
prompts); after `--arrive-after` of their steps (timed by a decode-only run of the same plan) one
long prompt arrives. For the plan as compiled (chunked, the plan's token budget) and the same plan
with its budget and chunk sizes switched off (whole prompts), it runs three workloads: the decode
rows alone, the decode rows with the long prompt, the long prompt alone. Figures:
- the decode rows' inter-token p99 while the long prompt prefills (gaps ending between its arrival
  and its first token) over their p99 in the same time window of the decode-only run (target:
  within 2x with chunking);
- the long prompt's TTFT beside the decode rows over its TTFT alone, on the same plan (target:
  within 1.5x with chunking).

Prefix scenario (`--prefix-requests 8 --prefix-len 1024`): requests one after another (one client),
each the same `--prefix-len` tokens then 16 of its own; the TTFT of the second and later ones with
the plan's prefix cache over their TTFT with the cache off (target: at least 5x lower), and the
cache's hits. `--prefix-rounds 2` (the default) runs the pair twice, cached first then uncached
first, and pools the TTFTs: each round's ratio is printed beside the pooled one, so a drift of
the host's speed between runs shows rather than landing on one side of the ratio.

Engines: `--engine sim` (the cost model: simulated seconds) or `--engine torch` (wall seconds on
this machine, so figures move with its load): the CPU torch reference with `--dims tiny` by
default, or `--device cuda --dims spec` for the GPU fast path at the spec's dims.

Usage: mstar bench kv [--plan generated/llama_chunked.plan] [--engine sim|torch] [--json]
                      [--device cpu|cuda[:N]] [--dims tiny|spec]
                      [--scenario all|chunk|prefix] [--decode-rows N] [--prompt-len N]
                      [--arrive-after STEPS] [--budget N | --budgets N,N] [--chunk-rounds N]
                      [--route packed|split]
                      [--no-whole] [--no-flat] [--per-row] [--no-run-ahead] [--automatic-gc]
                      [--prefix-requests N] [--prefix-len N] [--prefix-rounds N]
                      [--reference-weights]

Each decode row runs enough tokens to outlast the long prompt's prefill (`decode_max_tokens`); rows
that would pass the plan's max_seq_len are refused before anything runs, naming the options that
mend it and the nearest value of each that fits (`decode_rows_problem`).

`--budgets` and `--chunk-rounds` sweep the chunked variant over budgets and rounds, interleaved
(`bench_kv_sweep.py`).

`--decode-rows`, `--prompt-len`, `--arrive-after`, `--budgets`, `--chunk-rounds`, `--route`,
`--no-whole` and `--no-flat` are the chunk scenario's, `--prefix-*` the prefix scenario's: given
beside `--scenario` of the other, one is a usage error naming the scenario that reads it.
`--budget` is read by both (`--scenario all` runs the prefix scenario at it too).

On a GPU the engines' random weights are drawn by the device's generator (a spec-size model's host
draws, the CPU reference's values, took seconds of each engine's start; three engines a chunk
run); `--reference-weights` draws them as the reference does.

When the plan's budget counts a chunk token's context (KeyPlan.chunk_context_scale), the chunk
scenario also runs the plan with every chunk token counting one ("flat", the reference's rule),
so the two budgets compare in one run; `--no-flat` skips it. `--no-whole` skips the whole-prompt
reference runs of the chunk scenario (worth it on a GPU whose minutes are counted); `--per-row`
runs the GPU fast path's decode rows row by row instead of in columns (`gpu/decode_columns.py`),
a what-if for comparing the two in one session;
`--no-run-ahead` makes every step wait for the one before (no launch of step N+1 behind step N,
chunk steps included), the same what-if for the host/device overlap; `--automatic-gc` leaves
Python's collector passes where they fall instead of moving them to where the run loop waits for
the device (`serve/collector.py`).
"""
from __future__ import annotations

import argparse
import bisect
import json
import sys
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

import numpy as np

from mstar.arg_types import int_list, int_range, path_arg, shown_path
from mstar.plan.schema import KeyPlan, Plan
from mstar.runtime.conductor.request import Request
from mstar.runtime.engine.gpu import graph_what_ifs
from mstar.runtime.serve import bench_kv_sweep
from mstar.runtime.serve.bench_errors import BenchError, check_every_request_ran
from mstar.runtime.serve.collector import refreeze
from mstar.runtime.serve.driver import Driver, Workload

DECODE_PROMPT_LEN = 16
# The options only one scenario reads, with their defaults: given beside --scenario of the other,
# each is refused (`--scenario prefix --no-whole` ran the prefix scenario as if it were not given).
# `--budget` is read by both: `--scenario all` ran the prefix scenario at it, so `prefix` does too.
SCENARIO_OPTIONS: dict[str, dict[str, Any]] = {
    "chunk": {"decode_rows": 40, "prompt_len": 8192, "arrive_after": 10, "budgets": None, "chunk_rounds": 1,
              "route": None, "no_whole": False, "no_flat": False},
    "prefix": {"prefix_requests": 8, "prefix_len": 1024, "prefix_rounds": 2},
}
TAIL_STEPS = 12  # decode steps the decode rows run on after the long prompt's expected prefill


def _with_keys(plan: Plan, key_update: Callable[[KeyPlan], KeyPlan]) -> Plan:
    """The same plan with `key_update` applied to every worker's scheduling keys."""
    workers = [w.model_copy(update={"keys": [key_update(k) for k in w.keys]}) for w in plan.workers]
    return plan.model_copy(update={"workers": workers})


def with_budget(plan: Plan, budget: Optional[int], chunk: Optional[int] = None) -> Plan:
    """The same plan with every key's token budget replaced, and the chunk size of each walk it
    cuts (`chunk`, else the budget); `None` switches both off (prompts run whole)."""
    def key_update(key: KeyPlan) -> KeyPlan:
        sizes = {walk: chunk or budget for walk in key.chunk_sizes} if budget is not None else {}
        return key.model_copy(update={"token_budget": budget, "chunk_sizes": sizes})

    return _with_keys(plan, key_update)


def without_context_weight(plan: Plan) -> Plan:
    """The same plan with every chunk token counting one against the budget, whatever its depth
    (KeyPlan.chunk_context_scale off: the reference's rule)."""
    return _with_keys(plan, lambda key: key.model_copy(update={"chunk_context_scale": None}))


def counts_context(plan: Plan) -> bool:
    return any(k.chunk_context_scale for w in plan.workers for k in w.keys)


def with_route(plan: Plan, route: Optional[str]) -> Plan:
    """The same plan with every step that mixes prompt and decode rows (attention `packed` or
    `split`) on `route`; None keeps the plan's."""
    if route is None:
        return plan

    def key_update(key: KeyPlan) -> KeyPlan:
        mixtures = [m.model_copy(update={"attention": route}) if m.attention in ("packed", "split") else m
                    for m in key.mixtures]
        return key.model_copy(update={"mixtures": mixtures})

    return _with_keys(plan, key_update)


@dataclass(frozen=True)
class EngineChoice:
    name: str  # sim or torch
    device: str = "cpu"  # torch: cpu or cuda[:N]
    dims: str = "tiny"  # torch: tiny or spec
    plan_path: Optional[str] = None  # torch on a GPU: the plan's generated glue packs the steps
    is_columnar: bool = True  # torch: the GPU fast path's columnar decode rows (False: row by row)
    can_run_ahead: bool = True  # torch: launch step N+1 behind step N (False: every step waits)
    is_gc_deferred: bool = True  # the collector's passes where the loop waits (False: Python's own)


def _engine(plan: Plan, engine: EngineChoice) -> Any:
    if engine.name == "sim":
        from mstar.runtime.engine.sim import SimEngine

        return SimEngine(plan)
    from mstar.runtime.engine.torch_engine import TorchEngine, plan_glue

    # The glue packs the GPU fast path's steps as in `mstar run`; budgets and chunk sizes (what
    # the variants change) are not part of it.
    glue = plan_glue(plan, engine.plan_path, engine.device)
    torch_engine = TorchEngine(plan, dims=engine.dims, device=engine.device, glue=glue,
                               run_ahead=engine.can_run_ahead)
    if not engine.is_columnar:
        from mstar.runtime.engine.gpu.runner import GpuDecoderRunner

        for runner in torch_engine.runners.values():
            if isinstance(runner, GpuDecoderRunner):
                runner.is_columnar = False
    return torch_engine


def _run(plan: Plan, engine: EngineChoice, requests: list[Request], timed: Optional[list] = None) -> Driver:
    """timed: a list that gets the `StepEvents` of each device fast-path executor of the run (torch
    on a GPU), for the chunk steps' device times."""
    built = _engine(plan, engine)
    if timed is not None and engine.name == "torch":
        from mstar.runtime.engine.gpu.step_events import attach

        timed.extend(attach(built).values())
    driver = Driver(plan, built)
    refreeze()  # each workload's engine out of the collector's reach, as a process of one engine has it
    if not engine.is_gc_deferred:
        from mstar.runtime.serve.collector import AutomaticPasses

        driver.collector = AutomaticPasses()
    driver.run(Workload(requests))
    check_every_request_ran(driver, len(requests))  # a scenario of refused requests measures nothing
    return driver


def chunk_steps_on_device(timed: list, num_decode: int = 0, num: int = 3) -> dict[str, Any]:
    """The device's side of the steps that fed prompt chunks (more tokens than rows): their device
    times in order, and the `num` slowest (span plus the gap before it, the device waiting for the
    host), so a slow step of the prefill window shows as device work or as waiting; and of the
    chunk steps beside all `num_decode` decode rows (the long prompt's), the span's p90 and
    largest: what the decode rows' inter-token gaps are made of, without the host's stalls."""
    steps = [step for events in timed for step in events.steps() if step["tokens"] > step["rows"]]
    for index, step in enumerate(steps):
        step["index"] = index
    slowest = sorted(steps, key=lambda step: -(step["span_ms"] + step["gap_before_ms"]))[:num]
    spans = [step["span_ms"] for step in steps]
    beside_steps = [step for step in steps if step["rows"] > num_decode]
    beside = [step["span_ms"] for step in beside_steps]
    # which of them are slow (their index among the chunk steps: the long prompt's chunks run in
    # order, so it tells how deep the chunk was), with their tokens and paths
    slowest_beside = sorted(beside_steps, key=lambda step: -step["span_ms"])[:num]
    # how much of a typical such span is the device waiting for the host (or its own copies and
    # packing) before the replay: a host-bound chunk step shows here, not in the gaps between steps
    before = [step["before_replay_ms"] for step in beside_steps if step.get("before_replay_ms") is not None]
    return {"num_chunk_steps": len(steps), "span_p50_ms": float(np.median(spans)) if spans else None,
            "beside_decode_span_p90_ms": float(np.percentile(beside, 90)) if beside else None,
            "beside_decode_span_max_ms": max(beside) if beside else None,
            "beside_decode_before_replay_p50_ms": float(np.median(before)) if before else None,
            "slowest": slowest, "slowest_beside_decode": slowest_beside}


def _gaps(driver: Driver, prefix: str, start: float, end: float) -> np.ndarray:
    """Inter-token gaps of the requests whose id starts with `prefix`, for tokens in [start, end]."""
    gaps = []
    for rid, record in driver.conductor.records.items():
        if rid.startswith(prefix):
            times = np.asarray(record.token_times_s) - driver.origin_s
            ends = times[1:]
            gaps.append(np.diff(times)[(ends >= start) & (ends <= end)])
    return np.concatenate(gaps) if gaps else np.zeros(0)


def _p99(values: np.ndarray) -> Optional[float]:
    return float(np.percentile(values, 99)) if values.size else None


def _ttft(driver: Driver, rid: str) -> float:
    record = driver.conductor.records[rid]
    if record.first_token_s is None:  # refused (a prefix past max_seq_len, a pool too small): say so
        raise BenchError(f"request {rid} produced no token: {record.finish_reason}")
    return record.first_token_s - record.arrival_s


def slowest_steps(driver: Driver, start: float, end: float, num: int = 5) -> list[dict]:
    """The `num` steps overlapping [start, end] (seconds from the run's origin) that came longest after
    the step before them: a p99 over a few dozen steps that every decode row shares is about the
    slowest of them, so these say which step set it. Each: `gap_ms` (end after the previous step's
    end), `run_ms` (launch to end), its tokens, rows and walks, whether it was speculated, the
    scheduler's and post-processing's ms, the host's ms in the engine's launch with the launch
    ahead after it and in the wait for the step, the collector's passes since the step before
    (`StepLog.gc_s`), and its index among the window's steps. Overlapping, not ending inside: a
    step's logged end comes after its post-processing, so the step that gave the window's last
    token (the long prompt's first, on a wall clock) ends just past the window."""
    log, origin = driver.log, driver.origin_s
    found: list[dict[str, Any]] = []
    previous_end: Optional[float] = None
    for i in range(len(log)):
        end_s = log.end_s[i] - origin
        if previous_end is not None and start <= end_s and log.start_s[i] - origin <= end:
            found.append({"index": len(found), "gap_ms": (end_s - previous_end) * 1e3,
                          "run_ms": (log.end_s[i] - log.start_s[i]) * 1e3, "tokens": log.num_tokens[i],
                          "rows": log.num_rows[i], "walk_rows": dict(log.walk_rows[i]),
                          "is_speculative": log.is_speculative[i], "sched_ms": log.sched_s[i] * 1e3,
                          "post_ms": log.post_s[i] * 1e3, "launch_ms": log.launch_s[i] * 1e3,
                          "wait_ms": log.wait_s[i] * 1e3, "gc_ms": log.gc_s[i] * 1e3})
        previous_end = end_s
    return sorted(found, key=lambda step: -float(step["gap_ms"]))[:num]


def budget_and_scale(plan: Plan) -> tuple[int, int]:
    """The plan's step token budget and chunk context scale, the largest of its keys' (0: none)."""
    budget = max((k.token_budget or 0 for w in plan.workers for k in w.keys), default=0)
    scale = max((k.chunk_context_scale or 0 for w in plan.workers for k in w.keys), default=0)
    return budget, scale


def prefill_steps(budget: int, scale: int, num_decode: int, prompt_len: int) -> int:
    """The steps the long prompt's prefill is expected to take beside `num_decode` decode rows."""
    # a budget that counts context feeds deep chunks fewer tokens: 1 + c / scale each, on average
    # over the prompt 1 + prompt_len / (2 scale)
    weighted_len = prompt_len * (1 + prompt_len / (2 * scale)) if scale else prompt_len
    return int(-(-weighted_len // max(budget - num_decode, 1))) + 1 if budget else 1


def decode_max_tokens(budget: int, scale: int, num_decode: int, prompt_len: int, arrive_after: int) -> int:
    """The max_tokens of each decode row: enough to outlast the long prompt's prefill. Twice the
    expected steps: the prompt arrives at a wall-clock time taken from the first run, and a later
    run (caches warm) may have decoded more by then (on the H200 the decode rows of the mixed run
    once ended before the prompt's prefill did at 1x)."""
    return 2 * (arrive_after + prefill_steps(budget, scale, num_decode, prompt_len)) + TAIL_STEPS


def chunk_scenario(plan: Plan, engine: EngineChoice, num_decode: int, prompt_len: int, arrive_after: int) -> dict:
    """The figures of one plan variant (module docstring)."""
    budget, scale = budget_and_scale(plan)
    max_tokens = decode_max_tokens(budget, scale, num_decode, prompt_len, arrive_after)
    decode = [Request(id=f"d{i:03d}", prompt_tokens=[1 + i % 400] * DECODE_PROMPT_LEN, max_tokens=max_tokens)
              for i in range(num_decode)]
    alone_run = _run(plan, engine, decode)
    steady_steps = [t for t in alone_run.conductor.records["d000"].token_times_s]
    arrival = steady_steps[min(arrive_after, len(steady_steps) - 1)] - alone_run.origin_s
    long = Request(id="long", prompt_tokens=[(7 * i) % 500 for i in range(prompt_len)], max_tokens=1,
                   arrival_s=arrival)
    timed: list = []
    mixed = _run(plan, engine, decode + [long], timed)
    first = mixed.conductor.records["long"].first_token_s
    end = (first - mixed.origin_s) if first is not None else arrival
    # the ratio means what it says only when every decode row ran through the whole prefill window
    num_ended_early = sum(record.finish_s is not None and record.finish_s - mixed.origin_s < end
                          for rid, record in mixed.conductor.records.items() if rid != "long")
    during_gaps, steady_gaps = _gaps(mixed, "d", arrival, end), _gaps(alone_run, "d", arrival, end)
    during, steady = _p99(during_gaps), _p99(steady_gaps)
    only = _run(plan, engine, [Request(id="long", prompt_tokens=long.prompt_tokens, max_tokens=1)])
    ttft_mixed, ttft_alone = _ttft(mixed, "long"), _ttft(only, "long")
    return {"token_budget": budget or None, "chunk_context_scale": scale or None, "arrival_s": arrival,
            "prefill_window_s": end - arrival, "num_decode_ended_in_window": num_ended_early,
            "itl_p99_during_ms": during and during * 1e3, "itl_p99_steady_ms": steady and steady * 1e3,
            "itl_p99_ratio": (during / steady) if during and steady else None,
            # The p99 of a few dozen steps is about their slowest: the median and the largest
            # gap say whether it is one stall or every chunk step.
            "itl_p50_during_ms": float(np.median(during_gaps)) * 1e3 if during_gaps.size else None,
            "itl_max_during_ms": float(during_gaps.max()) * 1e3 if during_gaps.size else None,
            # the steady window's p99 is as much one step as the prefill's: its median beside it
            "itl_p50_steady_ms": float(np.median(steady_gaps)) * 1e3 if steady_gaps.size else None,
            "ttft_mixed_ms": ttft_mixed * 1e3, "ttft_alone_ms": ttft_alone * 1e3,
            "ttft_ratio": ttft_mixed / ttft_alone,
            "slowest_steps_during": slowest_steps(mixed, arrival, end),
            **({"chunk_steps_on_device": chunk_steps_on_device(timed, num_decode)} if timed else {})}


def with_prefix_cache(plan: Plan, state: str) -> Plan:
    """The same plan with every kv pool's prefix cache set to `state` ("pages" or "off")."""
    pools = [p.model_copy(update={"prefix_cache": state}) for p in plan.deployment.kv_pools]
    return plan.model_copy(update={"deployment": plan.deployment.model_copy(update={"kv_pools": pools})})


def shared_prefix_requests(num_requests: int, prefix_len: int, is_shared: bool = True) -> list[Request]:
    """The prefix scenario's requests: the same `prefix_len` tokens (each its own with `is_shared`
    False), then 16 of the request's own; two output tokens each."""
    def prefix(index: int) -> list[int]:
        return [(7 * i + (0 if is_shared else 13 * index)) % 500 for i in range(prefix_len)]

    return [Request(id=f"p{i:03d}", prompt_tokens=prefix(i) + [(11 * i + j) % 500 for j in range(16)], max_tokens=2)
            for i in range(num_requests)]


def prefix_scenario(plan: Plan, engine: EngineChoice, num_requests: int, prefix_len: int, rounds: int = 2) -> dict:
    """Mean TTFT of the 2nd and later requests sharing a prefix, with the cache and without, over
    `rounds` rounds of one run each, the order alternating (cached then uncached, then uncached then
    cached): on a shared host the host's speed drifts between runs, and a lone request's TTFT is
    mostly host time, so one pair of runs can land its drift on either side of the ratio."""
    requests = shared_prefix_requests(num_requests, prefix_len)
    ttfts: dict[str, list[list[float]]] = {"cached": [], "uncached": []}
    figures: dict[str, Any] = {}
    order = (("cached", "pages"), ("uncached", "off"))
    if engine.name == "torch":
        # One uncounted run of each first: a process's first runs pay its one-time costs (on the CPU,
        # with a 256-token prefix, the first round's uncached TTFTs 16-25 ms against 5-11 ms later,
        # its round ratio 7x against 3x).
        for name, state in order:
            note(f"the prefix scenario, {name} (warm-up, not counted)")
            stated = with_prefix_cache(plan, state)
            _one_after_another(stated, _engine(stated, engine), requests)
    for index in range(rounds):
        for name, state in order if index % 2 == 0 else order[::-1]:
            note(f"the prefix scenario, round {index + 1} of {rounds}, {name}")
            stated = with_prefix_cache(plan, state)
            driver = _one_after_another(stated, _engine(stated, engine), requests)
            ttfts[name].append([_ttft(driver, r.id) * 1e3 for r in requests[1:]])
            figures.setdefault(f"first_ttft_{name}_ms", _ttft(driver, requests[0].id) * 1e3)
            if state == "pages" and "cached_tokens" not in figures:
                figures["cached_tokens"] = [r.num_cached_tokens for r in driver.conductor.records.values()]
    for name, runs in ttfts.items():
        every = [ttft for run in runs for ttft in run]
        figures[f"ttft_{name}_ms"] = float(np.mean(every))
        # The spread beside the mean: on a shared host one slow request moves a mean of seven.
        figures[f"ttft_{name}_range_ms"] = _spread(every)
    figures["ttft_ratio"] = figures["ttft_uncached_ms"] / figures["ttft_cached_ms"]
    figures["round_ratios"] = [round(float(np.mean(u) / np.mean(c)), 3)
                               for c, u in zip(ttfts["cached"], ttfts["uncached"])]
    if engine.name == "torch":
        figures.update(_cached_first_steps(plan, engine, requests))
    return figures


def _cached_first_steps(plan: Plan, engine: EngineChoice, requests: list[Request]) -> dict[str, Any]:
    """Where a cached TTFT goes, from a third run with the cache (a run of its own: its instruments
    cost the host a little on each step, so the measured runs go without). The host's path of each
    cached request, from a few timestamps (`host_timeline.py`): per point the median ms after its
    arrival. On a GPU also CUDA events on every step: each cached request's first step as
    `StepEvents` spans it, from its first event (recorded as the executor begins the step: on an
    idle device it passes at once) to the copy of its sampled ids, so the executor's host work
    before the replay plus the device's step; and the rest of its TTFT: the Python above the
    executor, before (admission, scheduling, the runner) and after (collecting, post-processing)."""
    from mstar.runtime.engine.gpu.step_events import attach

    note("the prefix scenario, cached, with the host's timeline (not counted in the ratio)")
    cached = with_prefix_cache(plan, "pages")
    built = _engine(cached, engine)
    timed = list(attach(built).values())
    driver, points = one_after_another_timed(cached, built, requests)
    figures: dict[str, Any] = {"cached_host_timeline_ms": points}
    if timed:
        figures.update(cached_first_steps(timed, [_ttft(driver, r.id) * 1e3 for r in requests[1:]]))
    return figures


def _one_after_another(plan: Plan, built: Any, requests: list[Request]) -> Driver:
    """The prefix scenario's run: each request arrives as the one before it ends."""
    driver = Driver(plan, built)
    _run_closed(driver, requests)
    return driver


def one_after_another_timed(plan: Plan, built: Any, requests: list[Request]) -> tuple[Driver, list[tuple[str, float]]]:
    """`_one_after_another` with the host's path of the 2nd and later requests timed
    (`host_timeline.py`): the driver, and per point of the path the median ms after arrival."""
    from mstar.runtime.serve.host_timeline import watch_lone_path

    driver = Driver(plan, built)
    timeline = watch_lone_path(driver, built)
    _run_closed(driver, requests)
    records = [driver.conductor.records[r.id] for r in requests[1:]]
    return driver, timeline.offsets_ms([(r.arrival_s, r.first_token_s) for r in records if r.first_token_s is not None])


def _run_closed(driver: Driver, requests: list[Request]) -> None:
    refreeze()
    driver.run(Workload(requests, closed_concurrency=1))


def cached_first_steps(timed: list, ttfts_ms: list[float]) -> dict[str, Any]:
    """The cached requests' first steps among a prefix run's device steps: the last steps feeding
    more than one token, one per cached request (each request after the first feeds its tail in one
    step, then decodes one token a step; the first request's chunks come before them all), beside
    those requests' TTFTs: spans and the TTFT left to the host, min / median / max each."""
    steps = [step for events in timed for step in events.steps() if step["tokens"] > 1][-len(ttfts_ms):]
    if len(steps) != len(ttfts_ms):
        return {}
    spans = [step["span_ms"] for step in steps]
    rest = [ttft - span for ttft, span in zip(ttfts_ms, spans)]
    return {"cached_first_step_span_ms": _spread(spans), "cached_ttft_beside_step_ms": _spread(rest),
            "cached_first_step_paths": sorted({step["path"] for step in steps})}


def _spread(values: list[float]) -> list[float]:
    return [round(min(values), 3), round(float(np.median(values)), 3), round(max(values), 3)]


def _print_prefix(results: dict) -> None:
    row = results["prefix"]
    print(f"prefix cache: {results['prefix_requests']} requests one after another, a shared "
          f"{results['prefix_len']}-token prefix + 16 tokens each")
    print(f"TTFT of the 2nd and later, mean: {row['ttft_cached_ms']:.2f} ms cached, {row['ttft_uncached_ms']:.2f} ms "
          f"uncached = {row['ttft_ratio']:.2f}x lower with the cache (target >= 5x); the 1st: "
          f"{row['first_ttft_cached_ms']:.2f} / {row['first_ttft_uncached_ms']:.2f} ms; cached tokens per request "
          f"{row['cached_tokens']}")
    print(f"each round's ratio (runs alternating: cached first, then uncached first): "
          f"{', '.join(f'{r:.2f}x' for r in row['round_ratios'])}")
    print(f"TTFT of the 2nd and later, min / median / max: cached {_slashed(row['ttft_cached_range_ms'])} ms, "
          f"uncached {_slashed(row['ttft_uncached_range_ms'])} ms")
    if row.get("cached_host_timeline_ms"):
        print("a cached request's path on the host (a third run; ms after its arrival, medians): "
              + ", ".join(f"{point} {ms:.2f}" for point, ms in row["cached_host_timeline_ms"]))
    if "cached_first_step_span_ms" in row:
        print("a cached request's first step from the executor's launch to its ids' copy back (a third run, CUDA "
              f"events on each step), min / median / max: {_slashed(row['cached_first_step_span_ms'])} ms "
              f"({', '.join(row['cached_first_step_paths'])}); the rest of its TTFT (admission, scheduling, the "
              f"runner, post-processing): {_slashed(row['cached_ttft_beside_step_ms'])} ms")


def _slow_step(name: str, step: dict, engine: str) -> str:
    """One slow step of the prefill window; the sim's gap and run are its simulated clock's, the
    host's parts wall time either way (the line mixed them unsaid)."""
    clock = "simulated " if engine == "sim" else ""
    return (f"{name}: slow step {step['index']} of the prefill: {step['gap_ms']:.2f} {clock}ms after the one "
            f"before (ran {step['run_ms']:.2f} {clock}ms, {step['tokens']} tokens, rows {step['walk_rows']}, "
            f"{'speculated' if step['is_speculative'] else 'not speculated'}, host wall time: "
            f"scheduler {step['sched_ms']:.2f} ms, post {step['post_ms']:.2f} ms, launch and "
            f"launch-ahead {step.get('launch_ms', 0.0):.2f} ms, wait {step.get('wait_ms', 0.0):.2f} ms, "
            f"collector {step.get('gc_ms', 0.0):.2f} ms)")


def _slashed(values: list[float]) -> str:
    """min / median / max (`_spread`) as printed."""
    return " / ".join(f"{v:.2f}" for v in values)


def _before_replay(step: dict) -> str:
    """The part of a step's device span before its replay, when known: its copies, packing kernels
    and planning on the device, and the device waiting for the host inside the step."""
    before = step.get("before_replay_ms")
    return "" if before is None else f", {before:.2f} ms of it before the replay"


def _print(results: dict) -> None:
    print(f"engine {results['engine']} ({results['device']}, {results['dims']} dims), plan {results['plan']}: "
          f"{results['decode_rows']} decode rows, one "
          f"{results['prompt_len']}-token prompt arriving after {results['arrive_after']} decode steps")
    print(f"{'variant':<10} {'budget':>6} {'ITL p99 during ms':>18} {'steady ms':>10} {'ratio':>6} "
          f"{'TTFT ms':>9} {'alone ms':>9} {'ratio':>6}")
    names = [name for name in ("chunked", "flat", "whole") if name in results]
    for name in names:
        row = results[name]
        ratio = row["itl_p99_ratio"]
        print(f"{name:<10} {str(row['token_budget']):>6} {row['itl_p99_during_ms'] or 0:>18.2f} "
              f"{row['itl_p99_steady_ms'] or 0:>10.2f} {ratio or 0:>6.2f} {row['ttft_mixed_ms']:>9.1f} "
              f"{row['ttft_alone_ms']:>9.1f} {row['ttft_ratio']:>6.2f}")
    chunked, whole = results["chunked"], results.get("whole")
    for name in names:
        row = results[name]
        if row.get("itl_p50_during_ms") is not None:
            steady_p50 = row.get("itl_p50_steady_ms")
            print(f"{name}: decode inter-token gaps during the prefill: p50 {row['itl_p50_during_ms']:.2f} ms, "
                  f"largest {row['itl_max_during_ms']:.2f} ms"
                  + ("" if steady_p50 is None else f" (steady: p50 {steady_p50:.2f} ms, "
                                                   f"p99 {row['itl_p99_steady_ms'] or 0:.2f} ms)"))
        for step in row.get("slowest_steps_during", [])[:3]:
            print(_slow_step(name, step, results["engine"]))
        device = row.get("chunk_steps_on_device")
        if device and device["num_chunk_steps"]:
            slowest = "; ".join(f"chunk step {step['index']} {step['span_ms']:.2f} ms after waiting "
                                f"{step['gap_before_ms']:.2f} ms ({step['rows']} rows, {step['tokens']} tokens)"
                                for step in device["slowest"])
            print(f"{name}: on the device, {device['num_chunk_steps']} chunk steps, span p50 "
                  f"{device['span_p50_ms']:.2f} ms; the slowest: {slowest}")
            if device["beside_decode_span_max_ms"] is not None:
                slowest_beside = "; ".join(f"chunk step {step['index']} {step['span_ms']:.2f} ms ({step['tokens']} "
                                           f"tokens, {step['path'] or 'path unknown'}{_before_replay(step)})"
                                           for step in device["slowest_beside_decode"])
                before = device.get("beside_decode_before_replay_p50_ms")
                print(f"{name}: on the device, the chunk steps beside the decode rows: span p90 "
                      f"{device['beside_decode_span_p90_ms']:.2f} ms, "
                      + ("" if before is None else f"before the replay p50 {before:.2f} ms, ")
                      + f"largest {device['beside_decode_span_max_ms']:.2f} ms; the slowest: {slowest_beside}")
    for name in names:
        if results[name]["num_decode_ended_in_window"]:
            print(f"{name}: WARNING {results[name]['num_decode_ended_in_window']} decode rows ended before the "
                  f"prompt's first token: the ratio covers part of the prefill only")
    print(f"chunked: decode ITL p99 during the prefill / steady = {chunked['itl_p99_ratio'] or 0:.2f}x "
          f"(target <= 2x); TTFT beside the decode rows / alone = {chunked['ttft_ratio']:.2f}x (target <= 1.5x)")
    flat = results.get("flat")
    if flat is not None:
        print(f"flat budget (every chunk token counts one; the plan's counts 1 + context / "
              f"{chunked['chunk_context_scale']}): decode ITL p99 ratio {flat['itl_p99_ratio'] or 0:.2f}x, "
              f"TTFT ratio {flat['ttft_ratio']:.2f}x")
    if whole is not None:
        print(f"whole prompts: decode ITL p99 ratio {whole['itl_p99_ratio'] or 0:.2f}x, "
              f"TTFT ratio {whole['ttft_ratio']:.2f}x")


def _run_scenarios(plan: Plan, args: argparse.Namespace, results: dict[str, Any]) -> Optional[str]:
    """Fill `results` with the scenarios asked for; a reason when the plan cannot run one."""
    if args.scenario == "prefix" and args.budget is not None:
        plan = with_budget(plan, args.budget)  # as `--scenario all` runs it
    if args.scenario in ("all", "chunk"):
        plan = with_route(plan, args.route)
        if args.prompt_len + 1 > plan.deployment.max_seq_len:  # before the decode rows sized to outlast it
            return (f"holds at most max_seq_len {plan.deployment.max_seq_len} tokens a request: --prompt-len "
                    f"{args.prompt_len} and its token cannot run")
        if args.budget is not None:
            plan = with_budget(plan, args.budget)
        if not any(k.chunk_sizes for w in plan.workers for k in w.keys):
            return "cuts no prompt into chunks (no max_prefill_chunk_size)"
        problem = decode_rows_problem(plan, args)
        if problem is not None:
            return problem
        if args.budgets or args.chunk_rounds > 1:
            def run_at(budget: Optional[int]) -> dict[str, Any]:
                note(f"the chunked variant at budget {bench_kv_sweep.label(budget)}")
                variant = plan if budget is None else with_budget(plan, budget)
                return chunk_scenario(variant, _choice(args), args.decode_rows, args.prompt_len, args.arrive_after)

            budgets: list[Optional[int]] = list(args.budgets or [args.budget])
            results["sweep"] = bench_kv_sweep.sweep(budgets, args.chunk_rounds, run_at)
            return _run_prefix(plan, args, results)
        variants = [("chunked", plan)]
        if counts_context(plan) and not args.no_flat:
            variants.append(("flat", without_context_weight(plan)))
        if not args.no_whole:
            variants.append(("whole", with_budget(plan, None)))
        choice = _choice(args)
        if choice.name == "torch":
            # One uncounted run of each variant first, as the sweep does: a process's first runs pay
            # its one-time costs (on the CPU the chunked variant, run first, read an ITL ratio of
            # 29.9x against 12.6x and 10.5x in the same process after; on a GPU kernels compile).
            for name, variant in variants:
                note(f"{name} (warm-up, not counted)")
                chunk_scenario(variant, choice, args.decode_rows, args.prompt_len, args.arrive_after)
        for name, variant in variants:
            note(name)
            results[name] = chunk_scenario(variant, choice, args.decode_rows, args.prompt_len, args.arrive_after)
    return _run_prefix(plan, args, results)


def note(what: str) -> None:
    """A line of progress on stderr, run by run (a torch run of a scenario takes seconds to minutes
    and the figures come at the end)."""
    print(f"mstar bench kv: running {what}", file=sys.stderr, flush=True)


def decode_rows_problem(plan: Plan, args: argparse.Namespace) -> Optional[str]:
    """Why the chunk scenario's decode rows would pass the plan's max_seq_len (each sized to
    outlast the long prompt's prefill: `decode_max_tokens`; every one was refused after the
    decode-only run, "N of N requests failed"), naming the options that mend it alone, each at the
    value nearest the one given that fits; else None. `plan`: the chunked variant, at `--budget`
    (the flat and whole variants prefill in fewer steps); a sweep checks each of `--budgets`."""
    plan_budget, scale = budget_and_scale(plan)
    given = {"num_decode": args.decode_rows, "prompt_len": args.prompt_len, "arrive_after": args.arrive_after}
    for budget in args.budgets or [plan_budget]:
        fits = _RowsFit(plan.deployment.max_seq_len, scale, budget, given)
        if fits.at():
            continue
        fixes = [f"{option} {most} or fewer" for option, key in OPTIONS_OF_DECODE_ROWS
                 for most in [_largest(fits.at_value(key), given[key] - 1)] if most is not None]
        least = _least(fits.at, budget + 1, 1 << 20) if budget and not args.budgets else None
        if least is not None:
            fixes.append(f"--budget {least} or more")
        steps = prefill_steps(budget, scale, args.decode_rows, args.prompt_len)
        return (f"holds at most max_seq_len {fits.limit} tokens a request, and the decode rows would each run "
                f"{DECODE_PROMPT_LEN + decode_max_tokens(budget, scale, **given)} (a {DECODE_PROMPT_LEN}-token prompt, "
                f"then enough to outlast the long prompt: twice its arrival after --arrive-after "
                f"{args.arrive_after} steps and its {steps} prefill steps beside --decode-rows {args.decode_rows} at "
                f"budget {budget}{' of --budgets' if args.budgets else ''}, plus {TAIL_STEPS}): give "
                + (", ".join(fixes[:-1]) + ", or " + fixes[-1] if len(fixes) > 1 else "".join(fixes)
                   or "a plan of a longer max_seq_len"))
    return None


@dataclass(frozen=True)
class _RowsFit:
    """Whether the decode rows fit max_seq_len (`limit`) with one of the values given changed."""
    limit: int
    scale: int
    budget: int
    given: dict[str, int]

    def at(self, budget: Optional[int] = None, **change: int) -> bool:
        tokens = decode_max_tokens(self.budget if budget is None else budget, self.scale, **{**self.given, **change})
        return DECODE_PROMPT_LEN + tokens <= self.limit

    def at_value(self, key: str) -> Callable[[int], bool]:
        return lambda value: self.at(**{key: value})


OPTIONS_OF_DECODE_ROWS = (("--decode-rows", "num_decode"), ("--arrive-after", "arrive_after"),
                          ("--prompt-len", "prompt_len"))


def _largest(fits: Callable[[int], bool], high: int) -> Optional[int]:
    """The largest value in 1..high that `fits` (true up to a point, false past it), or None."""
    num_fitting = bisect.bisect_left(range(1, high + 1), True, key=lambda value: not fits(value))
    return num_fitting or None  # the values 1..num_fitting fit


def _least(fits: Callable[[int], bool], low: int, high: int) -> Optional[int]:
    """The least value in low..high that `fits` (false up to a point, true past it), or None."""
    values = range(low, high + 1)
    index = bisect.bisect_left(values, True, key=fits)
    return values[index] if index < len(values) else None


def _run_prefix(plan: Plan, args: argparse.Namespace, results: dict[str, Any]) -> Optional[str]:
    if args.scenario in ("all", "prefix"):
        if not any(p.prefix_walks for p in plan.deployment.kv_pools):
            return "has no prefix cache (prefix_cache: true in the deployment)"
        results["prefix"] = prefix_scenario(plan, _choice(args), args.prefix_requests, args.prefix_len,
                                            args.prefix_rounds)
    return None


def _choice(args: argparse.Namespace) -> EngineChoice:
    return EngineChoice(args.engine, args.device, args.dims, args.plan, not args.per_row, not args.no_run_ahead,
                        not args.automatic_gc)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="mstar bench kv", description=__doc__.split("\n")[0])
    parser.add_argument("--plan", type=path_arg, default="generated/llama_chunked.plan")
    parser.add_argument("--engine", choices=("sim", "torch"), default="sim")
    # the options of one scenario default to None here (`_check_scenario_options` fills them in)
    parser.add_argument("--decode-rows", type=int_range(1, 4096), help="chunk scenario: requests decoding (default 40)")
    parser.add_argument("--prompt-len", type=int_range(1, 1 << 20),
                        help="chunk scenario: the long prompt's tokens (default 8192)")
    parser.add_argument("--arrive-after", type=int_range(1, 100_000),
                        help="chunk scenario: decode steps before the long prompt arrives (default 10)")
    parser.add_argument("--budget", type=int_range(1, 1 << 20),
                        help="step token budget (and chunk size) instead of the plan's")
    parser.add_argument("--budgets", type=int_list(1, 1 << 20), metavar="N,N",
                        help="chunk scenario: the chunked variant at each of these budgets (and chunk sizes), "
                             "every round, interleaved (bench_kv_sweep.py)")
    parser.add_argument("--chunk-rounds", type=int_range(1, 100),
                        help="chunk scenario: rounds of the budget sweep, the budgets' order reversed every "
                             "other round; more than 1 runs the sweep at the plan's budget (or --budget)")
    parser.add_argument("--route", choices=("packed", "split"),
                        help="chunk scenario: attention route of the steps that mix prompt and decode rows, instead "
                             "of the plan's")
    parser.add_argument("--scenario", choices=("all", "chunk", "prefix"), default="all")
    parser.add_argument("--no-whole", action="store_true",
                        help="chunk scenario: skip the whole-prompt reference runs (half the time)")
    parser.add_argument("--no-flat", action="store_true",
                        help="chunk scenario: skip the runs whose budget counts every chunk token one, whatever "
                             "its depth (run by default when the plan's budget counts context)")
    parser.add_argument("--per-row", action="store_true",
                        help="torch engine: the GPU fast path's decode rows row by row, not in columns (a what-if)")
    parser.add_argument("--no-run-ahead", action="store_true",
                        help="torch engine: every step waits for the one before (a what-if beside the default)")
    parser.add_argument("--automatic-gc", action="store_true",
                        help="Python's collector passes where they fall, not where the run loop waits for the "
                             "device (a what-if beside the default)")
    graph_what_ifs.add_arguments(parser, scope="torch engine on a GPU: ")
    parser.add_argument("--prefix-requests", type=int_range(2, 4096),
                        help="prefix scenario: at least 2, the figure is about the 2nd request and later (default 8)")
    parser.add_argument("--prefix-len", type=int_range(1, 1 << 20),
                        help="prefix scenario: the shared prefix's tokens (default 1024)")
    parser.add_argument("--prefix-rounds", type=int_range(1, 100),
                        help="prefix scenario: rounds of a cached and an uncached run, the order alternating (each "
                             "round's ratio printed; the figure pools them; default 2)")
    parser.add_argument("--reference-weights", action="store_true",
                        help="torch engine on a GPU: random weights drawn on the host as the CPU reference's (each "
                             "engine's start takes seconds longer), not by the device's generator")
    parser.add_argument("--device", default="cpu", help="torch engine: cpu (default) or cuda[:N] (the GPU fast path)")
    parser.add_argument("--dims", choices=("tiny", "spec"), default="tiny", help="torch engine: model dims")
    parser.add_argument("--json", action="store_true")
    return parser


def _blas_edges_enabled() -> bool:
    """Whether the GPU fast path's graphs get programmatic edges into cuBLAS (needs cuda-bindings)."""
    from mstar.runtime.engine.gpu import blas_edges

    return blas_edges.is_enabled()


def _set_graph_switches(parser: argparse.ArgumentParser, args: argparse.Namespace, is_gpu_path: bool) -> None:
    """The GPU fast path's what-ifs (`graph_what_ifs`) set their modules before any graph is
    captured; off the GPU fast path they are refused."""
    for flag in graph_what_ifs.given(args):
        if not is_gpu_path:
            parser.error(f"{flag} is about the GPU fast path's graphs: use it with --engine torch --device cuda")
    if is_gpu_path:
        graph_what_ifs.apply(args)


def _set_weights_source(parser: argparse.ArgumentParser, args: argparse.Namespace, is_gpu_path: bool) -> None:
    """On the GPU fast path the runs time steps, not tokens: the device draws the random weights
    (`device_model.set_random_on_device`) unless `--reference-weights`; elsewhere that flag is refused."""
    if args.reference_weights and not is_gpu_path:
        parser.error("--reference-weights is about the GPU fast path's weights: use it with --engine torch "
                     "--device cuda")
    if is_gpu_path:
        from mstar.runtime.engine.gpu import device_model

        device_model.set_random_on_device(not args.reference_weights)


def _check_scenario_options(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Refuse the options of the scenario `--scenario` leaves out (a usage error naming the
    scenario that reads them), then fill in the defaults of those not given."""
    for scenario, options in SCENARIO_OPTIONS.items():
        given = [f"--{dest.replace('_', '-')}" for dest in options if getattr(args, dest) not in (None, False)]
        if given and args.scenario not in ("all", scenario):
            parser.error(f"{', '.join(given)}: {'options' if len(given) > 1 else 'an option'} of the {scenario} "
                         f"scenario, which --scenario {args.scenario} does not run (use --scenario {scenario} "
                         "or all)")
        for dest, default in options.items():
            if getattr(args, dest) is None:
                setattr(args, dest, default)


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    _check_scenario_options(parser, args)
    if args.engine == "sim" and (args.device != "cpu" or args.dims != "tiny"):
        parser.error("--device and --dims choose the torch engine's model: use them with --engine torch")
    if args.budgets and args.budget is not None:
        parser.error("--budgets runs each budget of its list: give it or --budget, not both")
    if args.no_run_ahead and args.engine != "torch":
        parser.error("--no-run-ahead turns off the torch engine's launch-ahead: use it with --engine torch")
    is_gpu_path = args.engine == "torch" and args.device.startswith("cuda")
    if args.per_row and not is_gpu_path:
        parser.error("--per-row turns off the GPU fast path's columns: use it with --engine torch --device cuda")
    _set_graph_switches(parser, args, is_gpu_path)
    _set_weights_source(parser, args, is_gpu_path)
    from mstar.plan.io import PlanError, load_plan

    try:
        plan = load_plan(args.plan)
    except PlanError as error:
        print(f"mstar bench kv: error: {error}", file=sys.stderr)
        return 1
    results: dict[str, Any] = {"engine": args.engine, "device": args.device, "dims": args.dims, "plan": args.plan,
                               "route": args.route, "is_columnar": not args.per_row,
                               "can_run_ahead": not args.no_run_ahead, "is_gc_deferred": not args.automatic_gc,
                               "is_blas_pdl": is_gpu_path and _blas_edges_enabled(),
                               "is_triton_packed": is_gpu_path and not args.flashinfer_packed,
                               "is_norms_folded": args.fold_norms,
                               "is_decode_merge_in_kernel": args.decode_merge_in_kernel,
                               "weights": "reference" if args.reference_weights or not is_gpu_path else "device random",
                               "decode_rows": args.decode_rows,
                               "prompt_len": args.prompt_len, "arrive_after": args.arrive_after,
                               "prefix_requests": args.prefix_requests, "prefix_len": args.prefix_len,
                               "prefix_rounds": args.prefix_rounds}
    from mstar.runtime.engine.torch_engine import EngineError

    try:
        problem = _run_scenarios(plan, args, results)
    except (BenchError, EngineError) as error:
        print(f"mstar bench kv: error: {error}", file=sys.stderr)
        return 1
    if problem:
        print(f"mstar bench kv: error: plan {shown_path(args.plan)} {problem}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(results, indent=1, sort_keys=True))
        return 0
    if "chunked" in results:
        _print(results)
    if "sweep" in results:
        print(bench_kv_sweep.render(results["sweep"]))
    if "prefix" in results:
        _print_prefix(results)
    return 0
