"""The prefix cache (kv/pages.py, kv/prefix_cache.py): properties over random request traces, and
the engines' use of it.

- a shared page is never written while shared (a write only ever lands on a private page);
- a page is never freed or evicted while a sequence holds it; every page is in exactly one place
  (never used, free, cached and free, or held) and a cached page's reference count is the number
  of sequences holding it;
- a hit is right: the pages a request starts on hold exactly its prompt's leading tokens;
- with the cache, greedy tokens are those without it (torch, CPU), and the cache is hit (sim).
Hypothesis runs a few examples by default and many more under `HYPOTHESIS_PROFILE=long`.
"""
from __future__ import annotations

import os

from hypothesis import given, settings, strategies as st

from pathlib import Path

from mstar.plan.io import load_plan
from mstar.runtime.conductor.request import Request
from mstar.runtime.engine.kv.pages import PagePool
from mstar.runtime.engine.sim import SimEngine
from mstar.runtime.engine.torch_engine import TorchEngine
from mstar.runtime.serve.driver import Driver, Workload

ROOT = Path(__file__).resolve().parents[2]
IS_LONG = os.environ.get("HYPOTHESIS_PROFILE") == "long"
PAGE = 4
BASES = [[1, 2, 3, 4, 5, 6, 7, 8, 9], [1, 2, 3, 4, 50, 60, 70, 80], [9, 9, 9, 9, 9, 9, 9, 9, 9, 9, 9, 9]]


def check_places(pool: PagePool) -> None:
    """Every page in exactly one place; reference counts match the sequences holding pages."""
    cache = pool.cache
    assert cache is not None
    held: dict[int, int] = {}
    for seq in pool._seqs.values():
        for page in seq.pages:
            held[page] = held.get(page, 0) + 1
    never_used = set(range(pool._num_fresh, pool.num_pages))
    places = [set(pool._freed), never_used, set(cache.free_order), set(held)]
    assert sum(map(len, places)) == pool.num_pages == len(set().union(*places)), "a page in two places"
    assert len(pool._freed) == len(set(pool._freed))
    for page, count in held.items():
        assert cache.refs.get(page, 1) == count, f"page {page}: {count} holders, refs {cache.refs.get(page)}"
    for page in cache.free_order:
        assert cache.refs[page] == 0


@settings(max_examples=1000 if IS_LONG else 60)
@given(st.lists(st.tuples(st.integers(0, 2), st.integers(0, 6), st.integers(1, 6), st.integers(0, 5),
                          st.booleans()), min_size=1, max_size=25),
       st.integers(6, 24))
def test_shared_pages_are_never_written_or_freed_while_held(trace, num_pages):
    pool = PagePool(num_pages, PAGE, prefix_cache=True)
    content: dict[int, list[int]] = {}  # page -> the tokens written into it (shadow of the KV)
    live: list[str] = []
    for index, (base, tail, chunk, num_decode, is_end) in enumerate(trace):
        if is_end and live:
            pool.free_request(live.pop(0))
            check_places(pool)
            continue
        rid = f"r{index}"
        key = (rid, "main")
        tokens = BASES[base] + [100 + index] * tail
        cached = pool.claim_prefix(key, tokens, max_from_free=num_pages)
        assert cached % PAGE == 0 and cached < len(tokens)
        for at, page in enumerate(pool.page_table(key)):
            assert content[page] == tokens[at * PAGE:(at + 1) * PAGE], "a hit on pages of other tokens"
        fed = cached
        writes = [(tokens[i:i + chunk]) for i in range(cached, len(tokens), chunk)] + [None] * num_decode
        for piece in writes:
            num_new = len(piece) if piece is not None else 1
            if not pool.reserve(key, num_new):
                break
            table = pool.page_table(key)
            for position in range(fed, fed + num_new):
                page = table[position // PAGE]
                assert page not in pool.cache, f"page {page} is shared and would be written"
                content.setdefault(page, [])
                del content[page][position % PAGE:]
                content[page].append(piece[position - fed] if piece is not None else -1)
            pool.commit(key, num_new, piece)
            fed += num_new
        live.append(rid)
        check_places(pool)
    for rid in live:
        pool.free_request(rid)
    check_places(pool)
    assert pool.num_free_pages == num_pages


def test_a_second_request_with_the_same_prefix_starts_on_its_pages_and_counts_a_hit():
    pool = PagePool(16, PAGE, prefix_cache=True)
    prompt = list(range(10))
    assert pool.claim_prefix(("a", "main"), prompt, 16) == 0
    assert pool.reserve(("a", "main"), 10)
    pool.commit(("a", "main"), 10, prompt)
    assert pool.claim_prefix(("b", "main"), prompt, 16) == 8  # two full pages; two tokens left to feed
    assert pool.page_table(("b", "main")) == pool.page_table(("a", "main"))[:2]
    assert pool.claim_prefix(("c", "cfg"), prompt, 16) == 0  # another sequence label: another key
    assert (pool.cache.num_hits, pool.cache.num_misses) == (2, 4)
    pool.free_request("a")
    pool.free_request("b")
    assert pool.cache.num_evictable == 2 and pool.num_free_pages == 16  # cached, and free to evict
    assert pool.claim_prefix(("d", "main"), prompt + [99], 16) == 8  # still cached after both ended


def generated(name: str):
    return load_plan(ROOT / "generated" / f"{name}.plan", verify=False)


def prefix_requests(num: int, prefix_len: int, tail: int) -> list[Request]:
    prefix = [(7 * i) % 500 for i in range(prefix_len)]
    return [Request(id=f"p{i}", prompt_tokens=prefix + [(11 * i + j) % 500 for j in range(tail)], max_tokens=4)
            for i in range(num)]


def with_prefix_cache(plan, state: str):
    pools = [p.model_copy(update={"prefix_cache": state}) for p in plan.deployment.kv_pools]
    return plan.model_copy(update={"deployment": plan.deployment.model_copy(update={"kv_pools": pools})})


def run(plan, engine, requests, concurrency=1) -> Driver:
    driver = Driver(plan, engine)
    driver.run(Workload(requests, closed_concurrency=concurrency))
    return driver


def test_cached_prefix_gives_the_tokens_of_the_whole_prompt_torch():
    plan = generated("llama_chunked")
    requests = prefix_requests(3, 40, 5) + [Request(id="other", prompt_tokens=list(range(30)), max_tokens=4)]
    off = with_prefix_cache(plan, "off")
    without = run(off, TorchEngine(off, dims="tiny"), requests)
    cached = run(plan, TorchEngine(plan, dims="tiny"), requests)
    assert {r: list(x.output_tokens) for r, x in cached.conductor.records.items()} == \
        {r: list(x.output_tokens) for r, x in without.conductor.records.items()}
    records = cached.conductor.records
    assert records["p0"].num_cached_tokens == 0 and records["p1"].num_cached_tokens == 32  # 2 pages of 16
    assert records["p2"].num_cached_tokens == 32 and records["other"].num_cached_tokens == 0


def test_sim_counts_hits_and_a_cached_prefix_cuts_ttft():
    plan = generated("llama_chunked")
    requests = prefix_requests(6, 1024, 16)
    cached = run(plan, SimEngine(plan), requests)
    off = with_prefix_cache(plan, "off")
    without = run(off, SimEngine(off), requests)
    hits = [r.num_cached_tokens for r in cached.conductor.records.values()]
    assert hits == [0] + [1024] * 5
    ttft = {rid: r.first_token_s - r.arrival_s for rid, r in cached.conductor.records.items()}
    ttft_off = {rid: r.first_token_s - r.arrival_s for rid, r in without.conductor.records.items()}
    # The cached request's one step still reads every weight of the model (about 1.2 ms at this
    # Llama-3.2-1B shape in the sim's roofline), so the cut is about 4x, as on the H200 (3.77x,
    # docs/runtime.md); it was 15-19x under the earlier cost model, additive in tokens.
    assert all(ttft[f"p{i}"] * 3 < ttft_off[f"p{i}"] for i in range(1, 6))
    assert cached.engine.num_pages_held() == 0


def _cached(pool: PagePool, tokens: list[int]) -> None:
    """A request that wrote `tokens` (keyed) and ended: their full pages stay cached, nobody holding them."""
    key = ("writer", "main")
    assert pool.reserve(key, len(tokens))
    pool.commit(key, len(tokens), tokens)
    pool.free_request("writer")


def test_a_claim_takes_at_most_max_from_free_unheld_pages_and_at_most_max_pages():
    """Cached pages nobody holds count as free: a claim takes no more of them than `max_from_free`
    (pages another sequence holds cost nothing), and no more pages in all than `max_pages`."""
    pool = PagePool(8, PAGE, prefix_cache=True)
    prompt = list(range(13))  # three full pages and one token
    _cached(pool, prompt)
    assert pool.claim_prefix(("b", "main"), prompt[:8] + [99], max_from_free=8) == 8  # b holds the first two
    assert pool.claim_prefix(("c", "main"), prompt, max_from_free=0) == 8  # b's two, not the third (unheld)
    assert pool.claim_prefix(("d", "main"), prompt, max_from_free=1) == 12  # the third is free to take now
    assert pool.claim_prefix(("e", "main"), prompt, max_from_free=8, max_pages=1) == 4
    assert pool.page_table(("e", "main")) == pool.page_table(("d", "main"))[:1]
    check_places(pool)


def test_a_sequence_moved_back_from_the_host_keys_no_page():
    """Restored pages hold tokens the pool does not know (`restore`): what the sequence writes
    after them keys nothing, so no request starts on a page whose tokens differ from its own."""
    pool = PagePool(8, PAGE, prefix_cache=True)
    key = ("moved", "main")
    assert pool.restore(key, PAGE)  # its first page came back from the host
    assert pool.reserve(key, PAGE)
    pool.commit(key, PAGE, [5, 6, 7, 8])  # its second page, written from token ids
    assert pool.claim_prefix(("new", "main"), [5, 6, 7, 8, 9], max_from_free=8) == 0
    assert pool.claim_prefix(("other", "main"), [1, 2, 3, 4, 5, 6, 7, 8, 9], max_from_free=8) == 0
    check_places(pool)


def test_cached_pages_nobody_holds_go_least_recently_freed_first_a_prefix_from_its_end():
    """Eviction order: the cached page freed longest ago goes first, and a freed prefix's later
    pages before its earlier ones (so what stays cached is still a prefix that hits)."""
    pool = PagePool(4, PAGE, prefix_cache=True)
    old, new = list(range(9)), list(range(100, 105))  # two full pages, then one
    _cached(pool, old)
    _cached(pool, new)
    assert pool.cache.num_evictable == 3 and pool.num_free_pages == 4
    assert pool.reserve(("a", "main"), 2 * PAGE)  # the one free page, then one eviction
    assert pool.claim_prefix(("b", "main"), old, max_from_free=4) == PAGE  # old's second page went
    assert pool.claim_prefix(("c", "main"), new, max_from_free=4) == PAGE  # new's page is still cached
    check_places(pool)
