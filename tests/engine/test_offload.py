"""KV offload (kv/offload.py, kv/host_cache.py): pages of started requests with no row in a step
move to the host pool when the step is short of device pages, and back before they run.

- offloaded pages come back bit-identical, whatever pages they leave from and return to;
- with a pool too small for every started request, greedy tokens are those of a pool that holds
  them all (torch, CPU), and pages really moved (both ways);
- the simulated engine moves pages by the same bookkeeping and every request finishes.
Hypothesis runs a few examples by default and many more under `HYPOTHESIS_PROFILE=long`.
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Optional
from unittest import mock

import pytest
import torch
from hypothesis import event, given, settings, strategies as st

from mstar.plan.io import load_plan
from mstar.runtime.conductor.request import Request
from mstar.runtime.engine.kv.cache import KvCache
from mstar.runtime.engine.kv.host_cache import HostKv, page_tensors
from mstar.runtime.engine.kv.pages import PagePool
from mstar.runtime.engine.sim import SimEngine
from mstar.runtime.engine.torch_engine import TorchEngine
from mstar.runtime.serve.driver import Driver, Workload
from fast_path_cpu import fast_path_engine
from tick_clock import TickClock

ROOT = Path(__file__).resolve().parents[2]
IS_LONG = os.environ.get("HYPOTHESIS_PROFILE") == "long"


@settings(max_examples=300 if IS_LONG else 30)
@given(st.integers(1, 40), st.integers(0, 20), st.integers(1, 8), st.integers(0, 2**31 - 1))
def test_offloaded_pages_come_back_bit_identical(num_tokens, num_other, page_size, seed):
    pool = PagePool(64, page_size)
    cache = KvCache(pool, num_layers=2, num_kv_heads=2, head_dim=4)
    host = HostKv(64, page_tensors(cache))  # room for every page of the sequence (at most 40)
    generator = torch.Generator().manual_seed(seed)
    for layer in range(2):
        cache.k[layer].copy_(torch.randn(cache.k[layer].shape, generator=generator))
        cache.v[layer].copy_(torch.randn(cache.v[layer].shape, generator=generator))
    assert pool.reserve(("other", "main"), num_other)  # someone else's pages, so ours are not the first
    key = ("r", "main")
    assert pool.reserve(key, num_tokens)
    pool.commit(key, num_tokens)
    flat = cache.flat_positions(pool.page_table(key), num_tokens)
    before = [(cache.k[i][flat].clone(), cache.v[i][flat].clone()) for i in range(2)]
    table = pool.page_table(key)
    host_pages = list(range(63, 63 - len(table), -1))
    host.copy_out(table, host_pages)
    pool.free_request("r")
    assert pool.reserve(("third", "main"), 3 * page_size)  # the freed pages go to another request
    assert pool.restore(key, num_tokens)
    host.copy_in(host_pages, pool.page_table(key))
    flat = cache.flat_positions(pool.page_table(key), num_tokens)
    for layer, (k, v) in enumerate(before):
        assert torch.equal(cache.k[layer][flat], k) and torch.equal(cache.v[layer][flat], v)



def test_victims_fit_the_host_pool_and_free_enough_or_none_move():
    """`Offload.victims`: least recently run first, never a request of the step, only one whose
    pages all fit what is left of the host pool, and nobody at all when the victims together would
    not free the pages asked for (a move that frees too little only costs copies)."""
    from mstar.runtime.engine.kv.admission import Admission, PageNeed
    from mstar.runtime.engine.kv.offload import Offload

    pool, admission = PagePool(16, 4), Admission(16)
    for request_id, num_pages in (("a", 3), ("b", 2), ("c", 4)):
        assert pool.reserve((request_id, "main"), 4 * num_pages)
        admission.grant(PageNeed(request_id, num_pages, num_pages))
    offload = Offload(num_host_pages=3)
    for request_id in ("c", "a", "b"):  # c ran longest ago, b last
        offload.note_step([request_id])
    assert offload.victims(pool, admission, {"b"}, 3, 9) == ["a"]  # c's 4 pages do not fit the host's 3
    assert offload.victims(pool, admission, set(), 2, 9) == ["a"]
    assert offload.victims(pool, admission, {"a"}, 2, 9) == ["b"]  # a is in the step, c too large
    assert offload.victims(pool, admission, {"b"}, 5, 9) == []  # a's 3 pages alone are not enough
    moved = offload.take("a", [("main", 12, 3)])
    assert offload.num_free_host_pages == 0 and len(set(moved[0].host_pages)) == 3
    assert offload.victims(pool, admission, {"a"}, 1, 9) == []  # no host page left for anyone
    assert offload.restore("a") == moved and offload.num_free_host_pages == 3
    roomier = Offload(num_host_pages=5)
    for request_id in ("c", "a", "b"):
        roomier.note_step([request_id])
    assert roomier.victims(pool, admission, {"c"}, 5, 9) == ["a", "b"]  # together within the 5
    assert roomier.victims(pool, admission, set(), 9, 9) == []  # c's 4 leave room for neither a nor b
    # Fewer victims than the requests their pages start, or none: two moved out to start two only
    # swaps who runs and pays the copies both ways.
    assert roomier.victims(pool, admission, {"c"}, 5, 3) == ["a", "b"]
    assert roomier.victims(pool, admission, {"c"}, 5, 2) == []
    assert roomier.victims(pool, admission, {"c"}, 3, 2) == ["a"]
    assert roomier.victims(pool, admission, {"c"}, 3, 1) == []
    # A parked request (its KV went to another rank; it runs no more here) goes first and does not
    # count: moving it out for one start stops nobody.
    roomier.park("b")
    assert roomier.victims(pool, admission, {"c"}, 2, 1) == ["b"]
    assert roomier.victims(pool, admission, {"c"}, 5, 1) == []  # a, which runs, would be moved for one start
    assert roomier.victims(pool, admission, {"c"}, 5, 2) == ["b", "a"]
    roomier.forget("b")
    assert roomier.victims(pool, admission, {"c"}, 2, 1) == []


def small_pool_plan(num_pages: int, host_pages: int, cap: int = 2, prefix_cache: bool = False,
                    chunk: Optional[int] = None, budget: Optional[int] = None):
    """llama_chunked with every step capped at `cap` rows and a pool of `num_pages` pages of 16
    (its prefix cache off unless asked for); with `chunk` and `budget`, prompts cut into chunks of
    `chunk` tokens within steps of `budget` tokens (else the plan's)."""
    plan = load_plan(ROOT / "generated" / "llama_chunked.plan", verify=False)
    workers = []
    for worker in plan.workers:
        # steps of at most `cap` rows, eager (no capture family holds them)
        keys = [key.model_copy(update={"captures": [], "mixtures": [
            m.model_copy(update={"cap": min(m.cap, cap), "capture": None, "also_captures": []})
            for m in key.mixtures], **_chunking(key, chunk, budget)})
            for key in worker.keys]
        workers.append(worker.model_copy(update={"keys": keys}))
    pools = [p.model_copy(update={"num_pages": num_pages, "host_pages": host_pages,
                                  "prefix_cache": "pages" if prefix_cache else "off"})
             for p in plan.deployment.kv_pools]
    deployment = plan.deployment.model_copy(update={"kv_pools": pools})
    return plan.model_copy(update={"workers": workers, "deployment": deployment})


def _chunking(key, chunk: Optional[int], budget: Optional[int]) -> dict:
    if chunk is None or budget is None:
        return {}
    return {"token_budget": budget, "chunk_sizes": {walk: chunk for walk in key.chunk_sizes}}


def requests(num: int) -> list[Request]:
    """Every third request long (a 5-page budget of 16-token pages), the others 2 pages: a long one
    started holds 2 pages and reserves 3 more, so moving it out can start two short ones (a move
    must start more requests than it moves out, kv/offload.py)."""
    return [Request(id=f"q{i}", prompt_tokens=[(13 * i + j) % 500 for j in range(20)],
                    max_tokens=60 if i % 3 == 0 else 12) for i in range(num)]


def run(plan, engine, reqs, concurrency) -> Driver:
    """concurrency: closed-loop clients; 0: every request arrives at once. The torch engine's runs
    read a clock that ticks a call, so which steps find rows short (and move pages) does not depend
    on the machine's speed: a move must start more requests than it moves out (kv/offload.py),
    which the requests' budgets allow only at some steps. An idle wait (rows held for pages, backing
    off) jumps that clock: it slept the host's time while the clock stood still."""
    clock = TickClock(1e-4)
    driver = Driver(plan, engine, clock=None if engine.caps.is_simulated else clock.now)
    with mock.patch("time.sleep", clock.sleep):
        driver.run(Workload(reqs, closed_concurrency=concurrency or None))
    return driver


def test_offload_keeps_the_greedy_tokens_torch():
    roomy = small_pool_plan(64, 0)
    tight = small_pool_plan(9, 64)  # 2-row steps; a long request and two short ones fill the pool; 6 clients
    reqs = requests(12)
    want = {r: list(x.output_tokens) for r, x in run(roomy, TorchEngine(roomy, dims="tiny"), reqs, 6)
            .conductor.records.items()}
    engine = TorchEngine(tight, dims="tiny")
    driver = run(tight, engine, reqs, 6)
    got = {r: list(x.output_tokens) for r, x in driver.conductor.records.items()}
    assert got == want
    offload = engine.runners["LLM"].offload
    assert offload.num_offloaded_pages > 0 and offload.num_restored_pages > 0
    assert not offload.offloaded and offload.num_free_host_pages == 64


def _fast_path_engine(plan, num_pages: int, host_pages: int, can_run_ahead: bool = False) -> TorchEngine:
    """The torch engine with the GPU fast path's runner for LLM, built on the CPU (fp32, torch
    attention), its host pool `host_pages` and, where the plan's pool asks for it, its prefix cache
    (as gpu/setup.py builds it); with `can_run_ahead`, steps launched ahead as on a GPU."""
    engine, _ = fast_path_engine(plan, num_pages, max_seq_len=4096, can_run_ahead=can_run_ahead, host_pages=host_pages,
                                 prefix_cache=plan.deployment.kv_pools[0].prefix_cache == "pages")
    return engine


@pytest.mark.parametrize("can_run_ahead", [False, True], ids=["serial", "run_ahead"])
@pytest.mark.parametrize("num_pages, cap, clients", [(9, 2, 6), (12, 3, 8)])
def test_offload_on_the_fast_path_keeps_the_greedy_tokens(can_run_ahead, num_pages, cap, clients):
    """The GPU fast path's runner (gpu/runner.py, here on the CPU) offloads through its own page
    layout (`PagedKv`: `_page_tensors`) and gives the tokens of a pool that holds every request,
    with steps launched ahead and decode rows in columns as on a GPU (no step launched ahead moves
    pages out, and no step's own request is moved out: `step_rows`)."""
    roomy, tight = small_pool_plan(64, 0, cap), small_pool_plan(num_pages, 64, cap)
    reqs = requests(12)
    want = {r: list(x.output_tokens) for r, x in run(roomy, _fast_path_engine(roomy, 64, 0), reqs, clients)
            .conductor.records.items()}
    engine = _fast_path_engine(tight, num_pages, 64, can_run_ahead)
    runner = engine.runners["LLM"]
    got = {r: list(x.output_tokens) for r, x in run(tight, engine, reqs, clients).conductor.records.items()}
    assert got == want
    offload = runner.offload
    assert offload.num_offloaded_pages > 0 and offload.num_restored_pages > 0
    assert not offload.offloaded and offload.num_free_host_pages == 64
    assert (runner.num_ahead_rows > 0) == can_run_ahead


# Random prompts and outputs, every third output 20 tokens longer: a longer request started beside
# shorter ones holds pages it has not filled yet, which moved out start two of them (a move must
# start more requests than it moves out, kv/offload.py). Steps of 2-3 rows, more live requests than
# a step holds (0 clients: all at once, or 5 or 14) and a pool 4-8 pages past the longest request:
# one-row steps, 2 clients and a pool of 6-7 pages moved none, and of those loads with outputs of
# 4-14 tokens alone about one example in ten moved pages.
RANDOM_SHAPES = st.lists(st.tuples(st.integers(5, 60), st.integers(4, 14)), min_size=6, max_size=12).map(
    lambda shapes: [(n, m + 20 if i % 3 == 0 else m) for i, (n, m) in enumerate(shapes)])


@settings(max_examples=60 if IS_LONG else 6, deadline=None)
@given(RANDOM_SHAPES, st.integers(4, 8), st.sampled_from([2, 3]), st.sampled_from([0, 5, 14]), st.booleans(),
       st.booleans())
def test_offload_on_the_fast_path_under_random_loads(shapes, extra_pages, cap, clients, can_run_ahead, is_shared):
    """Random prompts and output lengths, pool sizes, caps and clients (0: all arrive at once, so
    more requests live than the pool has pages), with or without a shared 32-token prefix and the
    prefix cache: the fast path's runner with a host pool (run ahead or not) gives a roomy pool's
    greedy tokens and ends with every page home (cached pages count as free); the share of examples
    that moved pages is in hypothesis's statistics (`--hypothesis-show-statistics`)."""
    prefix = list(range(100, 132)) if is_shared else []
    reqs = [Request(id=f"q{i}", prompt_tokens=prefix + [(31 * i + 7 * j) % 500 for j in range(n)], max_tokens=m)
            for i, (n, m) in enumerate(shapes)]
    # past the longest request's pages of 16 tokens, and the shared prefix's two
    num_pages = max(-(-(n + m) // 16) for n, m in shapes) + extra_pages + 2 * is_shared
    roomy, tight = small_pool_plan(64, 0, cap, is_shared), small_pool_plan(num_pages, 64, cap, is_shared)
    want = {r: list(x.output_tokens) for r, x in run(roomy, _fast_path_engine(roomy, 64, 0), reqs, clients)
            .conductor.records.items()}
    engine = _fast_path_engine(tight, num_pages, 64, can_run_ahead)
    got = {r: (x.finish_reason, list(x.output_tokens)) for r, x in run(tight, engine, reqs, clients)
           .conductor.records.items()}
    assert got == {r: ("length", tokens) for r, tokens in want.items()}
    runner = engine.runners["LLM"]
    assert not runner.offload.offloaded and runner.offload.num_free_host_pages == 64
    assert runner.pool.num_free_pages == num_pages
    event("moved pages to the host pool" if runner.offload.num_offloaded_pages else "moved no page")


def test_fast_path_pages_come_back_bit_identical():
    """`PagedKv`'s pages through the host pool and back to other pages, every layer, keys and values."""
    from mstar.runtime.engine.gpu.forward import PagedKv

    kv = PagedKv(3, 10, 4, 2, 8, torch.float32, torch.device("cpu"))
    kv.data.copy_(torch.randn(kv.data.shape, generator=torch.Generator().manual_seed(1)))
    views = [kv.data[layer, part] for part in (0, 1) for layer in range(3)]
    host = HostKv(5, views)
    before = kv.data[:, :, [7, 2, 5]].clone()
    host.copy_out([7, 2, 5], [4, 0, 1])
    kv.data[:, :, [7, 2, 5]] = 0
    host.copy_in([4, 0, 1], [1, 8, 3])
    assert torch.equal(kv.data[:, :, [1, 8, 3]], before)


def test_sim_offloads_and_finishes_every_request():
    plan = small_pool_plan(6, 64)
    engine = SimEngine(plan)
    driver = run(plan, engine, requests(12), 5)
    assert all(r.finish_reason == "length" for r in driver.conductor.records.values())
    offload = engine.pools["LLM"].offload
    assert offload.num_offloaded_pages > 0 and offload.num_restored_pages == offload.num_offloaded_pages
    assert engine.num_pages_held() == 0


def test_the_device_never_waits_with_the_pool_free_while_requests_do():
    """Poisson arrivals on 64 pages with a host pool (the sim): moving requests out never leaves every
    request held with the pool free. The rows short behind older reservations asked too few pages
    (kv/admission.py `pages_short`), every request ended up held, and the device waited out the holds'
    backoff: 0.41 s idle of a 1.82 s run, slower than the same run with no host pool at all."""
    import random

    rng = random.Random(1)
    arrival, reqs = 0.0, []
    for index in range(300):
        arrival += rng.expovariate(800)
        reqs.append(Request(id=f"r{index}", prompt_tokens=[rng.randrange(1, 500) for _ in range(rng.randint(8, 40))],
                            max_tokens=rng.randint(8, 60), arrival_s=arrival))
    plan = load_plan(ROOT / "generated" / "llama_chunked.plan", verify=False)
    pool = plan.deployment.kv_pools[0].model_copy(update={"host_pages": 4096})
    plan = plan.model_copy(update={"deployment": plan.deployment.model_copy(update={"kv_pools": [pool]})})
    driver = run(plan, SimEngine(plan, num_pages=64), reqs, 0)
    assert {r.finish_reason for r in driver.conductor.records.values()} == {"length"}
    spans = sorted(zip(driver.log.start_s, driver.log.end_s))
    idle, reached = 0.0, spans[0][1]
    for start, end in spans[1:]:
        idle += max(0.0, start - reached)
        reached = max(reached, end)
    assert idle < 0.005, idle


def test_a_host_pool_that_cannot_be_allocated_is_a_clear_error(monkeypatch):
    """A host pool too large for the machine: `KvCacheError` (a start-up refusal with its size and
    the key to lower), not torch's RuntimeError."""
    from mstar.runtime.engine.kv.cache import KvCacheError

    def refuse(*args, **kwargs):
        raise RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to allocate 1 bytes")

    pages = [torch.zeros(4, 16, 2, 8)]
    monkeypatch.setattr(torch, "empty", refuse)
    with pytest.raises(KvCacheError, match=r"host pool of 1000 pages \(.*GiB\).*cpu_offload_pages"):
        HostKv(1000, pages)


def test_a_host_pool_with_fewer_state_slots_than_requests_does_not_stall(tmp_path):
    """Qwen3.5 with a host pool and 70 recurrent state slots for 120 requests: rows refused for a
    slot moved other requests' pages out (which frees no slot), the moved requests then queued
    behind waiters that could never start, and every request ended `stalled`. Only rows that pages
    can start move anything now."""
    import yaml

    from mstar.cli.mstar import main
    from plan_variants import compiled

    config = yaml.safe_load((ROOT / "configs" / "qwen3_5.yaml").read_text())
    config.update(max_seq_len=64, recurrent_state_slots=70, kv_cache={"cpu_offload_pages": 400})
    config["kv_pool"]["num_pages"] = 80
    deployment = tmp_path / "qwen3_5_offload.yaml"
    deployment.write_text(yaml.safe_dump(config))
    plan = compiled(ROOT / "specs" / "qwen3_5.mw", deployment, tmp_path)
    report = tmp_path / "report.json"
    assert main(["run", "--plan", str(plan), "--requests", "120", "--arrival", "staggered", "--rate", "1000000",
                 "--prompt-len", "6..26", "--output-len", "12..12", "--no-progress", "--report", str(report)]) == 0
    summary = json.loads(report.read_text())
    assert summary["num_completed"] == 120 and not summary["failed_requests"]


def test_the_simulator_holds_rows_for_state_slots_as_the_torch_engine_does(tmp_path):
    """Qwen3.5 with 2 recurrent state slots for 8 requests at once: the torch engine runs two at a
    time; the simulator, which had no slots, started all 8 together (10 steps against 40), so its
    what-ifs of a hybrid's steps, throughput and offload choices were not the real ones."""
    import yaml

    from plan_variants import compiled

    config = yaml.safe_load((ROOT / "configs" / "qwen3_5.yaml").read_text())
    config["recurrent_state_slots"] = 2
    deployment = tmp_path / "qwen3_5_two_slots.yaml"
    deployment.write_text(yaml.safe_dump(config))
    plan = load_plan(str(compiled(ROOT / "specs" / "qwen3_5.mw", deployment, tmp_path)))

    def steps(engine) -> list[tuple[str, int, int]]:
        # The torch run reads a clock that ticks a call (as `run` above): on the wall clock, when a
        # held row is retried depended on the machine's load, and so did which step it joined.
        reqs = [Request(id=f"q{i}", prompt_tokens=[(13 * i + 7 * j) % 500 + 1 for j in range(6 + 3 * i)],
                        max_tokens=10) for i in range(8)]
        driver = run(plan, engine, reqs, 0)
        assert all(r.finish_reason == "length" for r in driver.conductor.records.values())
        return list(zip(driver.log.key, driver.log.num_rows, driver.log.num_held_rows))

    assert steps(SimEngine(plan)) == steps(TorchEngine(plan, dims="tiny"))
