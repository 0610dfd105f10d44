"""Failed steps (`Driver._isolate`, EngineCaps.rerun_nodes) beside small pools, a host pool
(kv/offload.py), the prefix cache and prompts cut into chunks, on the simulated engine, the torch
CPU engine (tiny dims) and the GPU fast path's runner on the CPU.

A random set of "bad" requests makes the engine raise in every step that holds one of their rows
(an engine or runner double keyed by request id). Whatever the pool, host pool, cap, chunk size,
clients or arrivals:

- every request ends exactly once (no row lost, nothing stalled);
- on a node of `rerun_nodes` exactly the bad requests fail; elsewhere (the fast path, or the
  rerun switched off) every failed request shared a step that raised with a bad one, and every
  bad request fails;
- every good request that did not fail ends with the reason and greedy tokens of a roomy run of
  the good requests alone (CPU fp32 is batch-invariant);
- afterwards every device page is free (cached prefix pages count as free), the host pool is
  empty and the admission policy holds nothing.
Two loads in three are drawn to move pages to the host pool (`MOVING_LOAD`), the others from every
range; `--hypothesis-show-statistics` gives the share of examples that moved pages.
Hypothesis runs a few examples by default and many more under `HYPOTHESIS_PROFILE=long`.
"""
from __future__ import annotations

import dataclasses
import os
from collections import Counter
from pathlib import Path
from typing import Any
from unittest import mock

from hypothesis import event, given, settings, strategies as st

from mstar.runtime.conductor.request import Request
from mstar.runtime.engine.gpu.runner import GpuDecoderRunner
from mstar.runtime.engine.runners.decoder import DecoderRunner
from mstar.runtime.engine.sim import SimEngine
from mstar.runtime.engine.torch_engine import TorchEngine
from mstar.runtime.serve.driver import Driver, Workload
from fast_path_cpu import fast_path_engine
from test_offload import small_pool_plan
from tick_clock import TickClock

ROOT = Path(__file__).resolve().parents[2]
IS_LONG = os.environ.get("HYPOTHESIS_PROFILE") == "long"
PAGE = 16
BOOM = "error: engine failed the step: RuntimeError: boom"
PREFIX = list(range(100, 132))  # two full pages, shared by the requests that ask for it


def plan_of(num_pages: int, host_pages: int, cap: int, prefix_cache: bool, chunk: int, budget: int):
    """llama_chunked with eager steps of at most `cap` rows, prompts cut into chunks of `chunk`
    tokens within steps of `budget` tokens, a pool of `num_pages` pages of 16 and a host pool of
    `host_pages` (its prefix cache on or off)."""
    return small_pool_plan(num_pages, host_pages, cap, prefix_cache, chunk, budget)


# ----------------------------------------------------------------------------- the doubles


class SampleRaises(DecoderRunner):
    """The CPU reference runner raising once the forward of a step holding a bad row has written
    every row's KV and moved every row's history and sampled counts (`_sample`): what
    `RequestState.rewind` must put back for a row run again to feed and sample as before."""

    bad: frozenset[str] = frozenset()

    def _sample(self, ready: list[Any], *args: Any, **kwargs: Any) -> Any:
        sampled = super()._sample(ready, *args, **kwargs)
        if any(item.row.request_id in self.bad for item in ready):
            raise RuntimeError("boom")
        return sampled


class FastPathRaises(GpuDecoderRunner):
    """The fast path's runner raising for a step holding a bad row: at its launch, before anything
    moved (`at_wait` False), or when its results are collected, after the device ran it (True)."""

    bad: frozenset[str] = frozenset()
    at_wait = False

    def start(self, rows: list[Any], *args: Any, **kwargs: Any) -> Any:
        is_bad = any(row.request_id in self.bad for row, _, _ in rows)
        if is_bad and not self.at_wait:
            raise RuntimeError("boom")
        results, failed, finish = super().start(rows, *args, **kwargs)
        if not is_bad:
            return results, failed, finish

        def raising() -> list[Any]:
            finish()
            raise RuntimeError("boom")
        return results, failed, raising


def raising_launch(engine: Any, bad: frozenset[str]) -> None:
    """The simulated engine raising in `launch` for a step holding a bad row, before its pool or
    counts move (where its own check of a step against the plan row raises)."""
    launch = engine.launch

    def launched(step: Any) -> Any:
        if any(row.request_id in bad for row in step.rows):
            raise RuntimeError("boom")
        return launch(step)
    engine.launch = launched


def record_raised(engine: Any) -> list[set[str]]:
    """The request ids of each step whose `launch` or `wait` raised, in order."""
    raised: list[set[str]] = []
    launch, wait = engine.launch, engine.wait

    def launched(step: Any) -> Any:
        try:
            return launch(step)
        except Exception:
            raised.append({row.request_id for row in step.rows})
            raise

    def waited(handle: Any) -> Any:
        try:
            return wait(handle)
        except Exception:
            raised.append({row.request_id for row in handle.step.rows})
            raise
    engine.launch, engine.wait = launched, waited
    return raised


def build(kind: str, plan: Any, num_pages: int, host_pages: int, bad: frozenset[str], rerun: bool,
          run_ahead: bool = False, at_wait: bool = False) -> tuple[Any, Any]:
    """(engine, the LLM node's pool holder: the sim's `_KvPool` or the runner) of `kind`, its
    bad requests' steps raising; `rerun` False takes LLM out of the engine's rerun_nodes."""
    if kind == "sim":
        engine = SimEngine(plan)
        holder = engine.pools["LLM"]
        if bad:
            raising_launch(engine, bad)
    elif kind == "torch":
        engine = TorchEngine(plan, dims="tiny")
        holder = engine.runners["LLM"]
        holder.__class__, holder.bad = SampleRaises, bad
    else:
        prefix_cache = plan.deployment.kv_pools[0].prefix_cache == "pages"
        engine, holder = fast_path_engine(plan, num_pages, max_seq_len=4096, can_run_ahead=run_ahead,
                                          host_pages=host_pages, prefix_cache=prefix_cache)
        holder.__class__, holder.bad, holder.at_wait = FastPathRaises, bad, at_wait
    if not rerun:
        engine.caps = dataclasses.replace(engine.caps, rerun_nodes=frozenset())
    return engine, holder


def run(engine: Any, plan: Any, reqs: list[Request], clients: int) -> tuple[dict, Counter]:
    """Every request's (finish reason, output tokens) and how many times each was said to end.
    The torch engines read a clock that ticks a call (the steps that find rows short, and so what
    moves to the host pool, do not depend on the machine's speed), and whose idle waits (rows held
    for pages, backing off) jump it: they slept the host's time while it stood still, a load's run
    4 s of sleep for 0.2 s of steps."""
    clock = TickClock(1e-4)
    ended: Counter = Counter()
    driver = Driver(plan, engine, clock=None if engine.caps.is_simulated else clock.now, on_finish=ended.update)
    with mock.patch("time.sleep", clock.sleep):
        driver.run(Workload(reqs, closed_concurrency=clients or None))
    records = driver.conductor.records
    return {r.id: (str(records[r.id].finish_reason), list(records[r.id].output_tokens)) for r in reqs}, ended


def assert_all_home(kind: str, holder: Any, num_pages: int, host_pages: int) -> None:
    """Every device page free (cached pages count), the host pool empty, admission holding nothing."""
    pool = holder.pages if kind == "sim" else holder.pool
    assert pool.num_free_pages == num_pages, (pool.num_free_pages, num_pages)
    offload = holder.offload
    if host_pages:
        assert not offload.offloaded and offload.num_free_host_pages == host_pages
        assert not offload.parked and not offload.last_run
    admission = holder.admission
    assert not admission.budgets and not admission.held and not admission.waiting and not admission.claims
    assert admission.num_outstanding == 0
    assert not getattr(holder, "_row_slots", None)  # the fast path's device token table rows


# ----------------------------------------------------------------------------- the loads


def make_requests(shapes: list[tuple[int, int, bool, int, bool]]) -> list[Request]:
    """(own prompt tokens, max_tokens, on the shared prefix, arrival gap in ms, penalised) each."""
    reqs, arrival = [], 0.0
    for i, (length, max_tokens, is_shared, gap, is_penalised) in enumerate(shapes):
        arrival += gap * 1e-3
        own = [(31 * i + 7 * j) % 500 + 1 for j in range(length)]
        reqs.append(Request(id=f"q{i}", prompt_tokens=(PREFIX if is_shared else []) + own, max_tokens=max_tokens,
                            arrival_s=arrival, repetition_penalty=1.3 if is_penalised else None))
    return reqs


def pages_needed(request: Request) -> int:
    return -(-(len(request.prompt_tokens) + request.max_tokens) // PAGE)


# Any mix of prompts (1..60 tokens of their own, maybe after the shared prefix) and outputs (short
# or long); or 8-10 requests, every third long (a 5-page budget of 16-token pages beside 2-page
# ones), so that moving a long one out starts two short ones (a move must start more requests than
# it moves out, kv/offload.py).
ANY_SHAPES = st.lists(st.tuples(st.integers(1, 60), st.one_of(st.integers(1, 12), st.integers(40, 64)), st.booleans(),
                                st.sampled_from([0, 0, 1, 3]), st.booleans()), min_size=2, max_size=12)
MOVING_SHAPES = st.lists(st.tuples(st.integers(15, 20), st.booleans(), st.sampled_from([0, 0, 1]), st.booleans()),
                         min_size=8, max_size=10).map(
    lambda shapes: [(n, 60 if i % 3 == 0 else 6, shared, gap, pen) for i, (n, shared, gap, pen) in enumerate(shapes)])
# Pages move only when a step of several rows short of pages leaves out a started request whose
# pages would start more rows than it: steps of 2-3 rows, more live requests than a step holds (all
# at once, or 6-8 clients), a host pool, and a pool 4-6 pages past the longest request (2-3 past
# it, steps of 3 rows moved none). Each of those ranges drawn on its own (hypothesis favouring the
# first of each: one-row steps, no host pool, a pool just the longest request's) met all of them
# in 3-13% of examples; a moving load draws them together, an any load keeps every range.
MOVING_LOAD = st.fixed_dictionaries(dict(
    shapes=MOVING_SHAPES, extra_pages=st.integers(4, 6), host_pages=st.sampled_from([64, 6]),
    cap=st.sampled_from([2, 3]), clients=st.sampled_from([0, 6, 8])))
ANY_LOAD = st.fixed_dictionaries(dict(
    shapes=st.one_of(ANY_SHAPES, MOVING_SHAPES), extra_pages=st.integers(0, 6),
    host_pages=st.sampled_from([0, 6, 64, 64]), cap=st.integers(1, 4), clients=st.sampled_from([0, 0, 3, 6])))
LOADS = dict(
    # a moving load two times in three (one_of(MOVING_LOAD, ANY_LOAD) drew it in a third of a short run)
    load=st.sampled_from([MOVING_LOAD, MOVING_LOAD, ANY_LOAD]).flatmap(lambda load: load),
    bad=st.sets(st.integers(0, 11), max_size=3),
    prefix_cache=st.booleans(), chunk=st.sampled_from([16, 24, 512]),
)


def check_run(kind: str, shapes, bad, extra_pages, host_pages, cap, prefix_cache, chunk, clients,
              rerun: bool = True, **options: Any) -> int:
    """The properties of the module docstring for one load; the pages it moved to the host pool."""
    reqs = make_requests(shapes)
    bad_ids = frozenset(f"q{i}" for i in bad if i < len(reqs))
    good = [r for r in reqs if r.id not in bad_ids]
    num_pages = max(map(pages_needed, reqs)) + extra_pages
    budget = max(chunk, 2 * PAGE)
    roomy_plan = plan_of(256, 0, 4, prefix_cache, chunk, budget)
    want, _ = run(build(kind, roomy_plan, 256, 0, frozenset(), True)[0], roomy_plan, good, 0)
    plan = plan_of(num_pages, host_pages, cap, prefix_cache, chunk, budget)
    engine, holder = build(kind, plan, num_pages, host_pages, bad_ids, rerun, **options)
    raised = record_raised(engine)
    got, ended = run(engine, plan, reqs, clients)
    assert ended == Counter(r.id for r in reqs)  # each request ended exactly once
    failed = {request_id for request_id, (reason, _) in got.items() if reason.startswith("error")}
    assert all(got[request_id][0] == BOOM for request_id in failed), got
    is_rerun = rerun and kind != "fast"  # the fast path's runner rewinds nothing: never run again
    assert ("LLM" in engine.caps.rerun_nodes) == is_rerun
    if is_rerun:
        assert failed == bad_ids, (failed, bad_ids)
    else:
        assert bad_ids <= failed and failed <= set().union(*raised), (failed, bad_ids, raised)
    assert {r.id: got[r.id] for r in good if r.id not in failed} == {
        request_id: value for request_id, value in want.items() if request_id not in failed}
    assert_all_home(kind, holder, num_pages, host_pages)
    assert not engine.requests  # every request ended in the engine too
    return holder.offload.num_offloaded_pages if host_pages else 0


def count_moves(num_moved: int) -> None:
    """Hypothesis's statistics (`--hypothesis-show-statistics`) give the share of the examples that
    moved pages to the host pool."""
    event("moved pages to the host pool" if num_moved else "moved no page")


# ----------------------------------------------------------------------------- the properties


@settings(max_examples=1000 if IS_LONG else 50, deadline=None)
@given(rerun=st.booleans(), **LOADS)
def test_sim_faults_with_small_pools_and_a_host_pool(load, bad, prefix_cache, chunk, rerun):
    count_moves(check_run("sim", bad=bad, prefix_cache=prefix_cache, chunk=chunk, rerun=rerun, **load))


@settings(max_examples=300 if IS_LONG else 15, deadline=None)
@given(rerun=st.booleans(), **LOADS)
def test_torch_faults_with_small_pools_and_a_host_pool(load, bad, prefix_cache, chunk, rerun):
    count_moves(check_run("torch", bad=bad, prefix_cache=prefix_cache, chunk=chunk, rerun=rerun, **load))


@settings(max_examples=300 if IS_LONG else 15, deadline=None)
@given(run_ahead=st.booleans(), at_wait=st.booleans(), **LOADS)
def test_fast_path_faults_with_small_pools_and_a_host_pool(load, bad, prefix_cache, chunk, run_ahead, at_wait):
    count_moves(check_run("fast", bad=bad, prefix_cache=prefix_cache, chunk=chunk, run_ahead=run_ahead,
                          at_wait=at_wait, **load))


def test_the_moving_loads_move_pages():
    """The properties above are about faults beside a host pool, and a load that moves no page tests
    none of that: the moving loads must move pages. On a fixed draw of them (derandomized, on the
    simulated engine, which moves pages by the torch engines' rules: kv/offload.py) at least three
    in four do, so a change of the strategies or of the offload rules that stops pages moving fails
    here rather than leaving the properties blind. (With the any loads beside them about 40% of each
    property's examples moved pages, averaged over runs; 3-9% before the moving loads.)"""
    moved: list[bool] = []

    @settings(max_examples=12, derandomize=True, database=None, deadline=None)
    @given(**{**LOADS, "load": MOVING_LOAD})
    def one(load, bad, prefix_cache, chunk):
        moved.append(check_run("sim", bad=bad, prefix_cache=prefix_cache, chunk=chunk, **load) > 0)

    one()
    assert len(moved) == 12 and 4 * sum(moved) >= 3 * len(moved), moved


def test_a_runner_swapped_in_takes_its_node_out_of_rerun_nodes():
    """The fast path's runner put in place of the reference one (`TorchEngine.replace_runner`, as
    tests and `mstar bench runner` build it on the CPU) takes its node out of `rerun_nodes`: the
    caps made with the reference runner kept it there, so a failed step of the fast path's rows
    ran again alone, its rows one token on (it rewinds nothing: `rewinds_failed_steps`), and a
    request that shared no step with the bad one ended with other tokens (q2 below)."""
    from mstar.runtime.serve.bench_runner import build_engine

    plan = plan_of(64, 0, 3, False, 16, 32)
    for can_run_ahead in (False, True):
        engine, _ = fast_path_engine(plan, 64, can_run_ahead=can_run_ahead)
        assert "LLM" not in engine.caps.rerun_nodes and engine.caps.can_launch_ahead == can_run_ahead
        engine, _ = build_engine(plan, can_run_ahead, 64)
        assert "LLM" not in engine.caps.rerun_nodes and engine.caps.can_launch_ahead == can_run_ahead
    assert "LLM" in TorchEngine(plan, dims="tiny").caps.rerun_nodes
    check_run("fast", [(1, 1, False, 0, False), (1, 1, False, 0, False), (1, 2, False, 0, False),
                       (5, 12, False, 0, False), (1, 1, False, 0, False)], {0}, 1, 0, 3, False, 16, 0, at_wait=True)
