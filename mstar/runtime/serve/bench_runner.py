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
compares both; `--compare` runs each variant both ways in one run, interleaved, and prints the
ratio (columns over per-row); `--cpu-time` times with the thread's CPU time (`time.thread_time`),
which other jobs on a shared machine do not add to (they still share its caches).

Chunk steps (`--long-prompt N`): one more request, of N prompt tokens and one output token,
arrives once the clients have run `ARRIVE_AFTER` full decode steps (the run clock counts those
steps, so it arrives at the same step in every run); the plan's step token budget (or `--budget`,
which sets the budget and the chunk size of a plan that cuts prompts, as `mstar bench kv --budget`
does) cuts it into chunks that run beside the clients' decode rows. A step counts as a chunk step
when it holds a chunk of that prompt beside `--clients` one-token rows; its figures are printed
apart from the full decode steps', bytecodes per row over all the step's rows (the chunk's
included).

`--sampling JSON` gives every client sampling settings (log-probabilities, penalties, a
temperature, ...): the host's work for such requests (the per-row path where the columns carry
none of it; the stand-in answers log-probabilities of the right shape, so the runner and the
conductor place them; it samples nothing: the device sampler is `mstar bench sampler`'s).

Usage: mstar bench runner [--plan P] [--clients N] [--prompt-len N] [--output-len N] [--rounds N]
                          [--long-prompt N] [--budget N] [--json] [--no-bytecodes] [--per-row]
                          [--compare] [--cpu-time] [--sampling JSON]
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from statistics import median
from typing import Any, Callable, Optional

import numpy as np
import torch

from mstar.arg_types import int_range, path_arg, shown
from mstar.plan.io import PlanError, load_plan
from mstar.plan.schema import Plan
from mstar.runtime.conductor.request import Request
from mstar.runtime.engine.gpu.device_model import build_decoder
from mstar.runtime.engine.gpu.packing import RowSpec
from mstar.runtime.engine.gpu.penalties import PenaltyTable
from mstar.runtime.engine.gpu.runner import GpuDecoderRunner, decode_family, fast_path_reason
from mstar.runtime.engine.kv.cache import KvCacheError
from mstar.runtime.engine.models.kinds import call_table
from mstar.runtime.engine.placement import CPU
from mstar.runtime.engine.runners.decoder import DecoderRunner
from mstar.runtime.engine.torch_engine import EngineError, TorchEngine
from mstar.runtime.serve.bench_errors import BenchError, check_every_request_ran
from mstar.runtime.serve.bench_kv import with_budget
from mstar.runtime.serve.driver import Driver, Workload

PARTS = ("launch", "wait", "launch_ahead")
VARIANTS = ("ahead", "no-ahead")
KINDS = ("decode", "chunk")  # full decode steps; steps of the long prompt's chunk beside the decode rows
ARRIVE_AFTER = 4  # full decode steps before the long prompt arrives
LONG = "long"  # the long prompt's request id


@dataclasses.dataclass
class _Answered:
    """A stand-in step: its tokens (and the log-probabilities its rows ask for) are known at launch."""

    tokens: np.ndarray
    logprobs: dict[int, Any] = dataclasses.field(default_factory=dict)


class StubExecutor:
    """Stands in for `StepExecutor` with the device work taken out: `launch` answers each row with
    `token` at once, `collect` returns those tokens. Keeps the device token table (`loop_tokens`),
    which the runner writes when it drops rows launched ahead."""

    is_cuda = False
    graphs = None
    packer = None  # no packing at all (neither the generated glue nor numpy)

    def __init__(self, max_rows: int, token: int):
        self.loop_tokens = torch.zeros(max_rows, dtype=torch.int32)
        # the penalised rows' table: the runner's record of what it holds, kept as the executor
        # keeps it, so a step's update is what it would be (the device rows are never written)
        self.penalty_table = PenaltyTable(torch.device("cpu"))
        self.token = token
        self.num_steps = 0

    def launch(self, rows: list[RowSpec], sampling: Any = None, family: Optional[str] = None,
               token_bucket: int = 0, route: str = "packed", glue: Any = None, scoring: Any = ()) -> _Answered:
        self.num_steps += 1
        if getattr(sampling, "penalties", None) is not None:
            self.penalty_table.commit(sampling.penalties.update)
        counts = getattr(sampling, "logprobs", None)  # (SamplingRows.logprobs: -1 where a row asks none)
        logprobs = {} if counts is None else {row: (-0.5, ((self.token, -0.5),) * int(count))
                                              for row, count in enumerate(counts.tolist()) if count >= 0}
        return _Answered(np.full(len(rows), self.token, dtype=np.int64), logprobs)

    def collect_logprobs(self, pending: _Answered) -> dict:
        return pending.logprobs  # what the executor answers: TokenLogprobs by row, of the rows that asked

    def restore_loop_tokens(self, slots: list[int], tokens: list[int]) -> None:
        self.loop_tokens[torch.tensor(slots)] = torch.tensor(tokens, dtype=self.loop_tokens.dtype)

    def collect(self, pending: _Answered) -> np.ndarray:
        return pending.tokens


def fast_node(plan: Plan) -> str:
    """The first decoder node the fast path takes, read from the plan (the engine's call table is
    `call_table(plan)`), so a bad --clients is refused before an engine is built. A decoder the
    engine runs otherwise (Whisper's) reads cross-attention pools, which `fast_path_reason` refuses."""
    calls = call_table(plan)
    for node in plan.nodes:
        if node.model_kind == "decoder" and not node.submodels and fast_path_reason(node, calls) is None:
            return node.name
    raise BenchError("the plan has no decoder node the GPU fast path takes (gpu/runner.py fast_path_reason)")


def build_engine(plan: Plan, can_run_ahead: bool, num_pages: int, is_columnar: bool = True
                 ) -> tuple[TorchEngine, GpuDecoderRunner]:
    """A tiny-dims CPU engine whose fast-path node runs a `GpuDecoderRunner` on a `StubExecutor`
    (is_columnar False: its steady decode steps row by row too, `gpu/decode_columns.py`)."""
    name = fast_node(plan)
    # Both pools are sized by the bench from its requests' tokens: one too large for the machine was
    # an internal error, and the engine's way out (the deployment's pages, --kv-pages) is not this
    # command's.
    sized = "the bench sizes the pool for every request's tokens: ask for fewer or shorter requests"
    try:
        engine = TorchEngine(plan, num_pages=num_pages)
    except KvCacheError as error:
        raise BenchError(f"{error.problem}; {sized}") from None
    reference = engine.runners[name]
    assert isinstance(reference, DecoderRunner)
    node = next(n for n in plan.nodes if n.name == name)
    position = engine.positions[name]
    model = build_decoder(reference.dims, torch.device("cpu"), torch.float32, position=position, seed=0)
    try:
        runner = GpuDecoderRunner(node, reference.dims, model, reference.pool.page_size, num_pages,
                                  reference.max_seq_len, 0, CPU, decode_family(plan, name), is_flashinfer=False,
                                  position=position, can_run_ahead=can_run_ahead, slots=reference.slots,
                                  prefix_cache=reference.pool.cache is not None)
    except RuntimeError as error:  # torch's word for an allocation it cannot make (its KV pages: one tensor)
        raise BenchError(f"cannot build the fast-path runner of {name} with {num_pages} KV pages: "
                         f"{' '.join(str(error).split())[:300]}; {sized}") from None
    token = next(t for t in range(1, 1 << 20) if t not in runner.stop_tokens)
    runner.executor = StubExecutor(runner.executor.max_rows, token)  # type: ignore[assignment]
    runner.is_columnar = is_columnar
    engine.replace_runner(name, runner)
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
        self.kinds: list[Optional[str]] = []  # per launched step: one of KINDS, or None (another step)
        self.num_rows_of: list[int] = []
        self.num_full = 0  # full decode steps launched: the run clock of a run with a long prompt
        for part in PARTS:
            setattr(engine, part, self._wrap(part, getattr(engine, part)))

    def _kind(self, rows: list) -> Optional[str]:
        decode = [row for row in rows if row.num_tokens == 1 and row.request_id != LONG]
        if len(decode) != self.num_rows:
            return None
        if len(rows) == self.num_rows:
            self.num_full += 1
            return "decode"
        is_chunk = len(rows) == self.num_rows + 1 and any(row.request_id == LONG for row in rows)
        return "chunk" if is_chunk else None

    def _wrap(self, part: str, fn: Callable) -> Callable:
        def timed(*args, **kwargs):
            if part == "launch":
                rows = args[0].rows
                self.steps.append(dict.fromkeys(PARTS, 0.0))
                self.kinds.append(self._kind(rows))
                self.num_rows_of.append(len(rows))
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
    clients = [Request(id=f"r{i}", prompt_tokens=[(7 * i + j) % 1000 + 1 for j in range(args.prompt_len)],
                       max_tokens=args.output_len, **args.sampling) for i in range(args.clients)]
    if not args.long_prompt:
        return clients
    # due once the clients' ARRIVE_AFTER-th full decode step launched (the run clock counts them)
    return clients + [Request(id=LONG, prompt_tokens=[(11 * j) % 1000 + 1 for j in range(args.long_prompt)],
                              max_tokens=1, arrival_s=(ARRIVE_AFTER - 0.5) * 1e-3)]


def _decode_clock(parts: "_Parts", is_idle: Callable[[], bool]) -> Callable[[], float]:
    """The run clock of a run with a long prompt: the full decode steps launched, a millisecond
    each; once nothing runs before the long prompt is due (the clients ran steps, then ended or
    failed early), its arrival at once: a clock of decode steps alone then stood still, and the run waited for ever."""
    arrived = [False]

    def clock() -> float:
        if not arrived[0] and parts.num_full < ARRIVE_AFTER and parts.steps and is_idle():
            arrived[0] = True
        return (max(parts.num_full, ARRIVE_AFTER) if arrived[0] else parts.num_full) * 1e-3
    return clock


def _one_run(plan: Plan, args, variant: str, is_traced: bool, is_columnar: bool) -> dict[str, Any]:
    """One run; per kind of step (KINDS) the parts' microseconds (or bytecodes when traced) of
    each such step, and its rows."""
    page_size = next((p.page_size for p in plan.deployment.kv_pools), 16)
    num_pages = args.clients * (-(-(args.prompt_len + args.output_len + 1) // page_size) + 1)
    num_pages += -(-(args.long_prompt + 2) // page_size) + 1 if args.long_prompt else 0
    engine, runner = build_engine(plan, variant == "ahead", num_pages, is_columnar=is_columnar)
    parts = _Parts(engine, args.clients, _Counter() if is_traced else None,
                   time.thread_time if args.cpu_time else time.perf_counter)
    requests = _requests(args)
    if args.long_prompt:  # open loop on a clock of full decode steps: the long prompt arrives mid-decode
        driver = Driver(plan, engine, clock=_decode_clock(parts, lambda: driver.conductor.is_idle()))
        driver.run(Workload(requests))
    else:
        driver = Driver(plan, engine)
        driver.run(Workload(requests, closed_concurrency=args.clients))
    check_every_request_ran(driver, len(requests))  # a fault of the bench's own stand-in or of the runner
    steps = {kind: [step for step, step_kind in zip(parts.steps, parts.kinds) if step_kind == kind] for kind in KINDS}
    rows = {kind: [num for num, step_kind in zip(parts.num_rows_of, parts.kinds) if step_kind == kind]
            for kind in KINDS}
    return {"steps": steps, "rows": rows, "num_ahead_rows": runner.num_ahead_rows,
            "num_claimed_rows": runner.num_claimed_rows, "num_finished": driver.conductor.num_finished}


def _summary(steps: list[dict[str, float]]) -> dict[str, float]:
    """p50 of each part and of the total, the total's p90 and largest step."""
    p50 = {part: float(np.percentile([s[part] for s in steps], 50)) for part in PARTS}
    totals = [sum(s.values()) for s in steps]
    p50["total"] = float(np.percentile(totals, 50))
    # The slow steps matter as much as the typical one: while the host's step is longer than the
    # device's, the device waits (a page boundary crossed by every row at once).
    p50["total_p90"], p50["total_max"] = float(np.percentile(totals, 90)), float(max(totals))
    return p50


def _check_decode_step_fits(plan: Plan, node: str, clients: int) -> None:
    """A full decode step holds every client's row: refuse a client count no step of the node's
    keys holds, by its rows (the mask of every walk: the last entry) or its token budget (a decode
    row feeds one token). Such a run ended in "no full decode step ran, raise --output-len", which
    no output length mends."""
    keys = [key for worker in plan.workers for key in worker.keys if key.node == node]
    if not keys:
        return
    for key in keys:
        cap, budget = key.mixtures[-1].cap, key.token_budget
        if clients <= cap and (budget is None or clients <= budget):
            return
    key = keys[0]
    if clients > key.mixtures[-1].cap:
        raise BenchError(f"a step of {key.name} holds at most {key.mixtures[-1].cap} rows, so no decode step of "
                         f"{clients} rows runs: give --clients {key.mixtures[-1].cap} or fewer")
    raise BenchError(f"a step of {key.name} feeds at most {key.token_budget} tokens (its token budget), so no "
                     f"decode step of {clients} rows runs: give --clients {key.token_budget} or fewer, or "
                     f"--budget {clients} or more")


def _check_chunk_step_fits(plan, clients: int) -> None:
    """A chunk step holds every client's decode row and the long prompt's chunk: refuse a client
    count the plan's step of all its key's walks cannot hold (llama_chunked's mixed cap is 64 rows,
    so the default 64 clients never shared a step with a chunk and the run ended in "no chunk step
    ran, raise --output-len", which no output length mends)."""
    for worker in plan.workers:
        for key in worker.keys:
            if key.chunk_sizes:
                cap = key.mixtures[-1].cap  # the mask of every walk: the last entry
                if clients + 1 > cap:
                    raise BenchError(f"a step of {key.name} holds at most {cap} rows, so {clients} decode rows "
                                     f"and the long prompt's chunk never share one: give --clients {cap - 1} or "
                                     "fewer")


def measure(args) -> dict[str, Any]:
    plan = load_plan(args.plan, verify=False)
    if args.budget is not None:
        plan = with_budget(plan, args.budget)
    kinds = KINDS if args.long_prompt else KINDS[:1]
    if args.long_prompt and not any(key.chunk_sizes for worker in plan.workers for key in worker.keys):
        # --budget resizes the chunks of a plan that cuts prompts; which walks may be cut is the
        # compiler's to say (its chunking checks), not this bench's
        given = ("and --budget only resizes the chunks of one that does" if args.budget is not None
                 else "so --long-prompt has no chunk steps to time")
        raise BenchError(f"the plan cuts no prompt into chunks (compiled without max_prefill_chunk_size), {given}: "
                         "use a chunked plan such as generated/llama_chunked.plan")
    if args.long_prompt:
        _check_chunk_step_fits(plan, args.clients)
    if args.long_prompt and args.output_len <= ARRIVE_AFTER + 1:
        raise BenchError(f"the long prompt arrives after {ARRIVE_AFTER} full decode steps: raise --output-len "
                         f"past {ARRIVE_AFTER + 1}")
    # before any engine is built: one sized for 100,000 clients' pages failed to allocate first
    _check_decode_step_fits(plan, fast_node(plan), args.clients)
    modes = (True, False) if args.compare else (not args.per_row,)  # is_columnar
    timed: dict[tuple[str, bool, str], list[dict[str, float]]] = {}
    claims: dict[tuple[str, bool], tuple[int, int]] = {}
    for _ in range(args.rounds):
        for variant in VARIANTS:
            for is_columnar in modes:
                run = _one_run(plan, args, variant, False, is_columnar)
                for kind in kinds:
                    if not run["steps"][kind]:
                        raise BenchError(f"no {'full decode' if kind == 'decode' else 'chunk'} step of "
                                         f"{args.clients} decode rows ran (raise --output-len)")
                    timed.setdefault((variant, is_columnar, kind), []).append(_summary(run["steps"][kind]))
                claims[variant, is_columnar] = (run["num_ahead_rows"], run["num_claimed_rows"])
    result: dict[str, Any] = {"plan": str(args.plan), "clients": args.clients, "prompt_len": args.prompt_len,
                              "output_len": args.output_len, "rounds": args.rounds, "long_prompt": args.long_prompt,
                              "budget": max((k.token_budget or 0 for w in plan.workers for k in w.keys), default=0)
                              or None,
                              "steps": "per-row" if args.per_row and not args.compare else "columns",
                              "clock": "thread cpu" if args.cpu_time else "wall"}
    for is_columnar in modes:
        entries: dict[str, Any] = {}
        for variant in VARIANTS:
            traced = _one_run(plan, args, variant, True, is_columnar) if args.bytecodes else None
            for kind in kinds:
                entry = _entry(timed[variant, is_columnar, kind], traced, kind)
                if kind == "decode":
                    entry["rows_launched_ahead"], entry["rows_claimed"] = claims[variant, is_columnar]
                    entries[variant] = entry
                else:
                    entries[variant]["chunk_steps"] = entry
        result["variants" if is_columnar or not args.compare else "per_row_variants"] = entries
    ahead, serial = (result["variants"][v]["p50_us_per_step"]["total"] for v in VARIANTS)
    # No row launched ahead (one client with two tokens, say): both variants ran the same path, and
    # their ratio would be noise read as a difference.
    ran_ahead = result["variants"]["ahead"]["rows_launched_ahead"] > 0
    result["ahead_over_no_ahead"] = ahead / serial if serial and ran_ahead else None
    if args.compare:
        result["columns_over_per_row"] = {variant: {kind: _ratios(_of_kind(result["variants"][variant], kind),
                                                                   _of_kind(result["per_row_variants"][variant], kind))
                                                    for kind in kinds} for variant in VARIANTS}
    return result


def _entry(runs: list[dict[str, float]], traced: Optional[dict[str, Any]], kind: str) -> dict[str, Any]:
    """One kind of step's figures: the medians over rounds of its steps' p50s, p90 and largest
    step, and from the traced run (when there is one) its bytecodes a row."""
    medians = {key: float(median(r[key] for r in runs)) for key in runs[0]}
    entry: dict[str, Any] = {"p50_us_per_step": {key: medians[key] for key in (*PARTS, "total")},
                             "total_us_per_step": {"p90": medians["total_p90"], "largest": medians["total_max"]}}
    if traced is not None:
        steps, rows = traced["steps"][kind], traced["rows"][kind]
        per_row = {part: sum(s[part] for s in steps) / sum(rows) for part in PARTS}
        per_row["total"] = sum(per_row.values())
        entry["bytecodes_per_row"] = per_row
        entry["rows_per_step"] = sum(rows) / len(steps)
        # the typical step's (a first chunk step also classifies the whole prompt once)
        entry["bytecodes_per_row_p50_step"] = float(np.median([sum(s.values()) / n for s, n in zip(steps, rows)]))
    return entry


def _of_kind(entry: dict[str, Any], kind: str) -> dict[str, Any]:
    return entry if kind == "decode" else entry["chunk_steps"]


def _ratios(columns: dict[str, Any], per_row: dict[str, Any]) -> dict[str, Optional[float]]:
    """Columns over per-row: the p50 host time per step, and bytecodes per row when counted."""
    def ratio(a: float, b: float) -> Optional[float]:
        return a / b if b else None
    ratios = {"us_p50": ratio(columns["p50_us_per_step"]["total"], per_row["p50_us_per_step"]["total"])}
    if "bytecodes_per_row" in columns:  # the median step's (the mean's first chunk step classifies the prompt)
        ratios["bytecodes"] = ratio(columns["bytecodes_per_row_p50_step"], per_row["bytecodes_per_row_p50_step"])
    return ratios


def _render_entry(label: str, entry: dict[str, Any]) -> list[str]:
    p50, slow = entry["p50_us_per_step"], entry["total_us_per_step"]
    lines = [f"{label:<24} {'us/step p50':<14} " + " ".join(f"{p50[p]:>12.1f}" for p in (*PARTS, "total"))
             + f"   (total p90 {slow['p90']:.1f}, largest {slow['largest']:.1f})"]
    if "bytecodes_per_row" in entry:
        codes = entry["bytecodes_per_row"]
        lines.append(f"{label:<24} {'bytecodes/row':<14} " + " ".join(f"{codes[p]:>12.1f}" for p in (*PARTS, "total"))
                     + f"   ({entry['rows_per_step']:.1f} rows a step; the median step "
                       f"{entry['bytecodes_per_row_p50_step']:.1f} a row)")
    return lines


def render(result: dict[str, Any]) -> str:
    long = (f"; one {result['long_prompt']}-token prompt arriving after {ARRIVE_AFTER} decode steps, step token "
            f"budget {result['budget']}: chunk steps = its chunk beside {result['clients']} decode rows"
            if result["long_prompt"] else "")
    lines = [f"plan {result['plan']}: {result['clients']} clients, prompt {result['prompt_len']}, output "
             f"{result['output_len']} tokens{long}; device stubbed; decode steps = full decode steps of "
             f"{result['clients']} rows; median of {result['rounds']} round(s), variants interleaved; microseconds "
             f"of {result['clock']} time",
             f"{'variant, steps':<24} {'':<14} " + " ".join(f"{p:>12}" for p in (*PARTS, "total"))]
    modes = [(result["steps"], result["variants"])]
    if "per_row_variants" in result:
        modes.append(("per-row", result["per_row_variants"]))
    for variant in VARIANTS:
        for mode, entries in modes:
            entry = entries[variant]
            lines += _render_entry(f"{variant} {mode} decode", entry)
            if "chunk_steps" in entry:
                lines += _render_entry(f"{variant} {mode} chunk", entry["chunk_steps"])
    ahead = result["variants"]["ahead"]
    ratio = result["ahead_over_no_ahead"]
    lines.append(f"run ahead: {ahead['rows_claimed']} of {ahead['rows_launched_ahead']} rows launched ahead "
                 "claimed (last round); ahead / no-ahead host time per decode step: "
                 + (f"{ratio:.2f}x" if ratio is not None else "none (no row ran ahead: both ran the same path)"))
    for variant, by_kind in result.get("columns_over_per_row", {}).items():
        lines.append(f"columns / per-row, {variant}: " + "; ".join(
            f"{kind} steps {ratios['us_p50']:.2f}x host time p50"
            + (f", {ratios['bytecodes']:.2f}x bytecodes a row (median step)" if "bytecodes" in ratios else "")
            for kind, ratios in by_kind.items()))
    return "\n".join(lines)


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="mstar bench runner", description=__doc__.split("\n")[0])
    parser.add_argument("--plan", type=path_arg, default="generated/llama.plan")
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
    parser.add_argument("--compare", action="store_true",
                        help="run each variant with the columns and --per-row, interleaved, and print the ratio")
    parser.add_argument("--long-prompt", type=int_range(0, 1_000_000), default=0, metavar="N",
                        help="one more request of N prompt tokens arriving while the clients decode; its chunk "
                             "steps are reported apart (needs a step token budget: the plan's or --budget)")
    parser.add_argument("--budget", type=count, help="step token budget (and chunk size) instead of the plan's")
    parser.add_argument("--cpu-time", action="store_true",
                        help="time with this thread's CPU time, which other jobs on the machine do not add to")
    parser.add_argument("--sampling", type=_sampling, default={}, metavar="JSON",
                        help="every client's sampling settings as a prompts line gives them, e.g. "
                             "'{\"logprobs\": 1}' or '{\"repetition_penalty\": 1.1}' (default: greedy)")
    return measure_and_print("mstar bench runner", parser.parse_args(argv), measure, render)


SAMPLING_FIELDS = ("temperature", "top_k", "top_p", "seed", "repetition_penalty", "presence_penalty",
                   "frequency_penalty", "logprobs", "logit_bias", "ignore_eos", "min_tokens")


def _sampling(text: str) -> dict[str, Any]:
    """--sampling: a JSON object of SAMPLING_FIELDS, their values checked as the engine checks a
    request's (`SamplingParams.from_request`)."""
    from mstar.runtime.engine.sampling import SamplingError, SamplingParams

    try:
        fields = json.loads(text)
    except (ValueError, RecursionError):
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {shown(text)}") from None
    if not isinstance(fields, dict) or not set(fields) <= set(SAMPLING_FIELDS):
        raise argparse.ArgumentTypeError(f"expected a JSON object of {', '.join(SAMPLING_FIELDS)}, got {shown(text)}")
    try:
        SamplingParams.from_request({**fields, "max_tokens": None})
    except SamplingError as error:
        raise argparse.ArgumentTypeError(str(error)) from None
    return fields


def measure_and_print(prog: str, args: argparse.Namespace, measure: Callable[[argparse.Namespace], dict[str, Any]],
                      render: Callable[[dict[str, Any]], str]) -> int:
    """A stubbed-device bench's main after its arguments: its figures as JSON (`--json`) or
    rendered, or its one-line error (a plan, engine or bench problem) and exit status 1."""
    try:
        result = measure(args)
    except (PlanError, EngineError, BenchError) as error:
        print(f"{prog}: {error}", file=sys.stderr)
        return 1
    print(json.dumps(result, indent=1, sort_keys=True) if args.json else render(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
