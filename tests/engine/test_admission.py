"""One admission policy over the page pool (kv/admission.py) for the simulated and torch engines:
the same steps fail the same rows out of memory on both."""
from __future__ import annotations

import os
from pathlib import Path

from hypothesis import given, settings, strategies as st

from engine_plans import llm_plan, step
from mstar.runtime.conductor.request import Request
from mstar.runtime.engine.kv.admission import Admission, PageNeed
from mstar.runtime.engine.sim import SimEngine
from mstar.runtime.engine.torch_engine import TorchEngine
from mstar.runtime.step import StepRow

CHUNKED = Path(__file__).resolve().parents[2] / "generated" / "llama_chunked.plan"  # prefix cache, offload
IS_LONG = os.environ.get("HYPOTHESIS_PROFILE") == "long"


def test_a_request_starts_only_when_its_budget_fits_beside_what_others_may_claim():
    admission = Admission()
    assert admission.shortfall([PageNeed("a", 1, 3)], num_free_pages=4) == []
    admission.grant(PageNeed("a", 1, 3))  # a holds 1, may claim 2 more
    assert admission.num_outstanding == 2
    # b's budget of 3 does not fit beside a's outstanding 2 in 3 free pages; a may grow.
    assert admission.shortfall([PageNeed("b", 1, 3), PageNeed("a", 2, 0)], num_free_pages=3) == ["b"]
    admission.grant(PageNeed("a", 2, 0))
    assert admission.num_outstanding == 0 and admission.held["a"] == 3
    # a outgrows its budget: only pages nobody may claim (b has not started, so all free ones).
    assert admission.shortfall([PageNeed("a", 1, 0)], num_free_pages=1) == []
    assert admission.release("a") == 3 and admission.num_outstanding == 0
    assert admission.shortfall([PageNeed("b", 1, 3, needs_slot=True)], num_free_pages=4, num_free_slots=0) == ["b"]


def test_the_simulated_and_torch_engines_fail_the_same_rows():
    plan = llm_plan(num_pages=4, page_size=8)
    prompts = {rid: list(range(1, 11)) for rid in ("a", "b", "c")}  # 10 + 6 tokens: a budget of 2 pages
    engines = [SimEngine(plan), TorchEngine(plan)]
    for engine in engines:
        for rid, prompt in prompts.items():
            assert engine.add_request(rid, Request(id=rid, prompt_tokens=prompt, max_tokens=6)) is None

    def prefill(rid):
        return StepRow(rid, "prefill", 10, 0, {"text_inputs": prompts[rid]})

    def decode(rid):
        return StepRow(rid, "decode", 1, 10, {"text_inputs": [7]})

    steps = [[prefill("a"), prefill("b"), prefill("c")], [decode("a"), decode("b")], [prefill("c")],
             "end a", [prefill("c"), decode("b")], [decode("c"), decode("b")]]
    seen = []
    for rows in steps:
        if rows == "end a":
            for engine in engines:
                engine.end_request("a")
            continue
        failed = [engine.run_step(step(plan, "LLM", rows)).allocation_failed for engine in engines]
        assert failed[0] == failed[1], rows
        seen.append(failed[0])
    assert seen == [["c"], [], ["c"], [], []]


def _started(budgets: dict[str, int], held: dict[str, int]) -> Admission:
    admission = Admission()
    for request_id, budget in budgets.items():
        admission.grant(PageNeed(request_id, held[request_id], budget))
    return admission


def test_one_page_each_in_one_pass_ends_as_row_by_row_or_changes_nothing():
    cases = [({"a": 4, "b": 3, "c": 2}, {"a": 1, "b": 2, "c": 0}, ["a", "b", "c"], 10, True),
             ({"a": 4, "b": 3}, {"a": 1, "b": 3}, ["a", "b"], 10, False),  # b holds its whole budget
             ({"a": 4}, {"a": 1}, ["a", "z"], 10, False),  # z has not started
             ({"a": 4, "b": 3}, {"a": 1, "b": 0}, ["a"], 5, False)]  # free pages below the claims (6)
    for budgets, held, rows, num_free, is_one_pass in cases:
        one_pass, row_by_row = _started(budgets, held), _started(budgets, held)
        before = (dict(one_pass.held), one_pass.num_outstanding)
        assert one_pass.grant_one_page_each(rows, num_free) is is_one_pass
        if not is_one_pass:
            assert (one_pass.held, one_pass.num_outstanding) == before
            continue
        needs = [PageNeed(request_id, 1, 0) for request_id in rows]
        assert row_by_row.shortfall(needs, num_free) == []
        for need in needs:
            row_by_row.grant(need)
        assert (one_pass.held, one_pass.num_outstanding) == (row_by_row.held, row_by_row.num_outstanding)


def test_a_request_refused_a_start_keeps_its_place_before_later_ones():
    """First come, first started: a request refused a start for memory reserves its budget, so a
    later request that would fit beside the started ones' claims waits behind it; when pages come
    back the first one starts, then the later one."""
    admission = _started({"s": 4}, {"s": 4})  # s holds 4 pages of an 8-page pool
    assert admission.shortfall([PageNeed("big", 1, 5)], num_free_pages=4) == ["big"]
    assert admission.waiting == {"big": 5} and admission.num_reserved == 5
    # "small" fits in the 4 free pages, but not beside the 5 reserved for big
    assert admission.shortfall([PageNeed("small", 1, 2)], num_free_pages=4) == ["small"]
    assert admission.room_to_start("small", 4) == -1 and admission.room_to_start("big", 4) == 4
    assert admission.release("s") == 4
    # in one step, in either order: big starts first, small only beside it
    assert admission.shortfall([PageNeed("small", 1, 2), PageNeed("big", 1, 5)], num_free_pages=8) == []
    assert admission.shortfall([PageNeed("small", 1, 4), PageNeed("big", 1, 5)], num_free_pages=8) == ["small"]
    admission.grant(PageNeed("big", 1, 5))
    assert list(admission.waiting) == ["small"] and admission.num_reserved == 4
    admission.grant(PageNeed("small", 1, 2))
    assert not admission.waiting and admission.num_reserved == 0



def test_a_request_moved_to_a_host_pool_waits_again_where_it_first_came():
    """A request whose pages moved to a host pool (kv/offload.py releases it with `keep_place`)
    starts again in the order of its first contact: before the requests that came after it, not
    behind every one that arrived while it ran (under a steady overload it then waited for the
    queue to drain: `mstar bench offload`'s latency p99 1.28-1.32x the run without a host pool)."""
    admission = Admission(num_pages=8)
    assert admission.shortfall([PageNeed("a", 2, 4)], num_free_pages=8) == []  # a's first contact; it starts
    admission.grant(PageNeed("a", 2, 4))
    assert admission.shortfall([PageNeed("b", 1, 6)], num_free_pages=6) == ["b"]  # b waits
    assert admission.release("a", keep_place=True) == 2  # a's pages go to the host
    assert admission.shortfall([PageNeed("c", 1, 3)], num_free_pages=8) == ["c"]  # came after both; 3 > 8 - 6
    assert list(admission.waiting) == ["b", "c"]
    assert admission.shortfall([PageNeed("a", 2, 4)], num_free_pages=8) == ["a"]  # back, behind b's 6
    assert list(admission.waiting) == ["a", "b", "c"]
    assert admission.reserved_before("a") == 0 and admission.reserved_before("c") == 4 + 6
    # ended rather than moved, a request keeps no place: the same id later is a new request
    admission.grant(PageNeed("c", 1, 3))
    admission.release("c")
    admission.join("c", 3)
    assert list(admission.waiting) == ["a", "b", "c"]

def test_rows_passed_in_a_step_that_ran_nothing_keep_their_place():
    """A step run all or nothing grants no row when one is short: the rows that passed joined the
    waiting ones before the short one (step order), so they are not behind it next time."""
    admission = Admission()
    assert admission.shortfall([PageNeed("a", 1, 2), PageNeed("b", 1, 2)], num_free_pages=3) == ["b"]
    assert list(admission.waiting) == ["a", "b"]
    assert admission.shortfall([PageNeed("a", 1, 2)], num_free_pages=3) == []
    assert admission.release("b") == 0 and list(admission.waiting) == ["a"]  # b ended before it started


def test_a_large_request_is_not_starved_by_small_ones_on_a_tight_pool():
    """A 63-page request among many 2-page ones in a 64-page pool, 32 clients: it used to start
    only after every small request (the small ones took each page a finished request freed)."""
    from mstar.runtime.serve.driver import Driver, Workload

    plan = llm_plan(num_pages=64, page_size=16)
    requests = [Request(id=f"s{i}", prompt_tokens=[1 + i % 50] * (5 + i % 10), max_tokens=5 + i % 15)
                for i in range(300)]
    requests.insert(5, Request(id="big", prompt_tokens=[3] * 900, max_tokens=100))
    driver = Driver(plan, SimEngine(plan))
    driver.run(Workload(requests, closed_concurrency=32))
    records = driver.conductor.records
    assert all(r.finish_reason in ("stop", "length") for r in records.values())
    first_tokens = sorted(records, key=lambda rid: records[rid].first_token_s)
    # it waits for the requests started before it to end, not for the ones after it
    assert first_tokens.index("big") < 32


@settings(max_examples=200 if IS_LONG else 15, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 3), st.integers(1, 300), st.integers(1, 120)), min_size=2, max_size=40),
       st.integers(12, 48), st.integers(1, 16), st.booleans())
def test_every_request_starts_on_a_tight_pool_with_shared_prefixes(shapes, num_pages, clients, is_offloaded):
    """Random requests (one of four shared prefixes of 32 to 96 tokens, then their own, any size up to
    most of the pool) on llama_chunked's plan (prefix cache, chunked prompts, KV offload on or off),
    closed loop: none stalls or is lost, whatever prefix claims younger requests hold while older
    ones wait to start, and the policy ends with nobody waiting or reserved."""
    from mstar.plan.io import load_plan
    from mstar.runtime.serve.driver import Driver, Workload

    plan = load_plan(CHUNKED, verify=False)
    if not is_offloaded:
        pools = [p.model_copy(update={"host_pages": 0}) for p in plan.deployment.kv_pools]
        plan = plan.model_copy(update={"deployment": plan.deployment.model_copy(update={"kv_pools": pools})})
    # two prefixes of one text (a claim of the longer holds the shorter's pages) and two of others
    texts = [[(11 * j + 5 * k) % 400 + 1 for j in range(96)] for k in range(3)]
    prefixes = [texts[0][:48], texts[0], texts[1][:32], texts[2][:80]]
    requests = [Request(id=f"r{i}", prompt_tokens=prefixes[k] + [(i + j) % 400 + 1 for j in range(own)],
                        max_tokens=out) for i, (k, own, out) in enumerate(shapes)]
    engine = SimEngine(plan, num_pages=num_pages)
    driver = Driver(plan, engine)
    driver.run(Workload(requests, closed_concurrency=clients))
    records = driver.conductor.records
    assert len(records) == len(requests)
    for record in records.values():
        reason = record.finish_reason
        assert reason in ("stop", "length") or (reason or "").startswith("error: can never fit"), reason
    admission = engine.pools["LLM"].admission
    assert not admission.waiting and admission.num_reserved == 0 and not admission.budgets


def test_a_claim_keeps_every_reachable_waiting_request_reachable():
    """Pages a waiting request's claim holds no started request frees: a new claim takes no more
    pages than the least room a waiting request has (`claim_cap`); pages the claims of a waiting
    request and of the ones after it hold cost that request nothing."""
    admission = Admission(num_pages=12)
    admission.join("x", 7, claimed_pages=[0, 1, 2])  # reachable: 7 <= 12 - 3
    assert admission.is_reachable("x")
    assert admission.claim_cap("w", lambda: [0, 1, 2, 5, 6, 7]) == 5  # 0-2 are x's; 5 and 6 fit, 7 would not
    admission.join("y", 1, claimed_pages=[0, 1, 2, 5, 6])
    assert admission.is_reachable("x") and admission.claim_cap("w", lambda: [9]) == 0
    # a request made unreachable by others' claims reserves nothing until they end, and meanwhile
    # a new claim takes only pages that keep every waiting request's room
    admission.join("z", 8)
    assert not admission.is_reachable("z") and admission.reserved_before("w") == 7 + 1
    assert admission.claim_cap("w", lambda: [5, 6, 9]) == 2  # y's pages cost z 2 of its 4; 9 costs x
    admission.release("y")  # its claim's pages 5 and 6 no longer count
    assert admission.is_reachable("z") and admission.reserved_before("w") == 7 + 8
    # x's claim ends when x starts, so z's room is 12 - 8 and x's 12 - 7 - 3: two new pages fit both
    assert admission.claim_cap("w", lambda: [9]) is None and admission.claim_cap("w", lambda: [9, 10]) is None
    assert admission.claim_cap("w", lambda: [9, 10, 11]) == 2
    assert Admission().claim_cap("w", lambda: [1]) is None  # the pool's size not known: no cap


def test_a_claim_of_an_older_waiters_pages_leaves_room_for_the_requests_between():
    """A newcomer's claim of pages an older waiting request's claim holds keeps them once that one
    has started and ended: they count against the rooms of the requests waiting between the two.
    Counted free, two waiting requests came to want each other's claimed pages with nothing
    started, and waited forever."""
    admission = Admission(num_pages=10)
    admission.join("a", 2, claimed_pages=[0, 1, 2, 3])  # a's prefix is cached on pages 0-3
    assert admission.claim_cap("b", lambda: [4, 5]) is None  # a keeps 10 - 2 - 6 = 2
    admission.join("b", 5, claimed_pages=[4, 5])  # 7 pages in all
    # c's prefix is a's: each of a's pages c keeps costs b one of its 10 - 5 - 2 = 3
    assert admission.claim_cap("c", lambda: [0, 1, 2, 3]) == 3
    admission.join("c", 6, claimed_pages=[0, 1, 2])
    _drain(admission)


def _drain(admission: Admission, is_oldest_first: bool = True) -> None:
    """Once the started requests end, the waiting ones start one by one as the policy starts them
    (the oldest that fits beside the claims waiting requests hold) and end: some request can always
    start. With `is_oldest_first`, also that this is always the oldest (module docstring)."""
    for request_id in list(admission.budgets):
        admission.release(request_id)
    while admission.waiting:
        startable = [r for r in admission.waiting if admission.is_reachable(r)]
        assert startable, ("every waiting request waits on another's claim", dict(admission.waiting), admission.claims)
        if is_oldest_first:
            assert startable[0] == next(iter(admission.waiting))
        admission.grant(PageNeed(startable[0], admission.waiting[startable[0]], admission.waiting[startable[0]]))
        admission.release(startable[0])


def _join_capped(admission: Admission, request_id: str, chain: int, length: int, total: int) -> None:
    """The request claims the first `length` cached pages of one of four chains over the pool that
    share pages (as `claim_cap` caps it) and joins with `total` pages less its claim."""
    num_pages = admission.num_pages
    assert num_pages is not None
    chains = [list(range(num_pages)), list(range(num_pages // 2, num_pages)) + list(range(num_pages // 2)),
              list(range(0, num_pages, 2)), list(range(num_pages - 1, -1, -1))]
    wanted = chains[chain][:min(length, num_pages)]
    cap = admission.claim_cap(request_id, lambda: wanted)
    claimed = wanted[:cap] if cap is not None else wanted
    admission.join(request_id, max(0, min(total, num_pages) - len(claimed)), claimed or None)


@settings(max_examples=400 if IS_LONG else 60, deadline=None)
@given(st.integers(6, 24), st.lists(st.tuples(st.integers(0, 3), st.integers(0, 20), st.integers(0, 30),
                                               st.integers(0, 2)), min_size=1, max_size=30))
def test_waiting_requests_always_drain_whatever_they_claim(num_pages, events):
    """Requests claim prefixes of a few chains of cached pages that share pages (as capped), join,
    start when they fit and end in random orders: at every point, once the started requests end,
    the waiting ones start one after another, oldest first (no two wait on each other's claims)."""
    from copy import deepcopy

    admission = Admission(num_pages=num_pages)
    for index, (chain, length, total, action) in enumerate(events):
        _join_capped(admission, f"r{index}", chain, length, total)
        if action == 1 and admission.waiting:  # the oldest reachable request starts
            oldest = next(r for r in admission.waiting if admission.is_reachable(r)) \
                if any(map(admission.is_reachable, admission.waiting)) else None
            if oldest is not None:
                admission.grant(PageNeed(oldest, 0, admission.waiting[oldest]))
        elif action == 2 and admission.budgets:  # a started request ends
            admission.release(next(iter(admission.budgets)))
        _drain(deepcopy(admission))


def test_a_first_row_past_its_budget_leaves_no_two_requests_waiting_on_each_other():
    """a's prefix claim holds 4 pages of 10 and it joins with a budget of 2, so b's claim of 4 other
    pages keeps a's room (10 - 2 - 8 = 0) and b waits with 3. a's first row then adds 5 pages, 3
    past its budget, which no claim was capped for: joined with 5, neither could ever start (5 and
    3 beside the 8 claimed pages of 10), nothing started to free a page, and both waited forever.
    Now the row is refused for good (`outgrows_room`: the engines end a with an error) and a keeps
    waiting with its budget until it ends; then b starts."""
    from copy import deepcopy

    admission = Admission(num_pages=10)
    admission.join("a", 2, claimed_pages=[0, 1, 2, 3])
    assert admission.claim_cap("b", lambda: [4, 5, 6, 7]) is None  # a's room was 10 - 2 - 4 = 4
    admission.join("b", 3, claimed_pages=[4, 5, 6, 7])
    first_row = PageNeed("a", 5, 2)
    assert admission.shortfall([first_row], num_free_pages=2) == ["a"]
    _drain(deepcopy(admission))  # oldest first: a could start with its budget once nothing else ran
    assert admission.outgrows_room(first_row) and admission.waiting == {"a": 2, "b": 3}
    admission.release("a")  # the engine ended a with the error
    assert admission.shortfall([PageNeed("b", 3, 3)], num_free_pages=6) == []
    # a row past its budget within its room starts with the larger figure, as before
    grown = Admission(num_pages=10)
    grown.join("a", 2, claimed_pages=[0, 1])
    assert not grown.outgrows_room(PageNeed("a", 8, 2)) and grown.outgrows_room(PageNeed("a", 9, 2))
    assert grown.shortfall([PageNeed("a", 8, 2)], num_free_pages=8) == [] and grown.waiting == {"a": 8}
    # a first contact whose row could never fit the pool waits with no figure (its room would be below 0)
    assert grown.outgrows_room(PageNeed("c", 11, 2)) and grown.shortfall([PageNeed("c", 11, 2)], 8) == ["c"]
    assert "c" not in grown.waiting and not Admission().outgrows_room(PageNeed("c", 11, 2))


def test_the_torch_engine_ends_a_request_whose_first_row_can_never_start():
    """A first row past its budget that leaves its request no room (`outgrows_room`; here 5 pages
    of 8 tokens for a budget of 1 in a pool of 4) ends the request with an error naming the pages,
    where it was held and retried forever."""
    plan = llm_plan(num_pages=4, page_size=8)
    engine = TorchEngine(plan)
    assert engine.add_request("a", Request(id="a", prompt_tokens=[1, 2, 3, 4], max_tokens=4)) is None
    result = engine.run_step(step(plan, "LLM", [StepRow("a", "prefill", 40, 0, {"text_inputs": list(range(1, 41))})]))
    assert result.allocation_failed == [] and [r.request_id for r in result.rows] == ["a"]
    assert "first row adds 5 KV pages, past its budget of 1" in (result.rows[0].error or "")
    assert not engine.runners["LLM"].admission.waiting


@settings(max_examples=400 if IS_LONG else 60, deadline=None)
@given(st.integers(6, 24), st.lists(st.tuples(st.integers(0, 3), st.integers(0, 20), st.integers(0, 30),
                                               st.integers(0, 8)), min_size=1, max_size=30))
def test_waiting_requests_drain_whatever_their_first_rows_add(num_pages, events):
    """As `test_waiting_requests_always_drain_whatever_they_claim`, with first rows that add up to
    8 pages past their request's budget (an encoder feeding more than its declared media tokens),
    each fitting the pool beside its own request's claim, coming in random orders: such a row is
    refused for good when its figure would leave its request no room (the engine ends that
    request), else the request waits with the larger figure; at every point the waiting requests
    still drain, oldest first. Under the rule before (every such row joined with the larger figure)
    it found the oldest waiting request unable to start, and two requests each waiting on the
    other's claim."""
    from copy import deepcopy

    admission = Admission(num_pages=num_pages)
    for index, (chain, length, total, extra) in enumerate(events):
        _join_capped(admission, f"r{index}", chain, length, total)
        if extra and admission.waiting:  # a waiting request's first row adds up to `extra` pages past its budget
            grower = list(admission.waiting)[index % len(admission.waiting)]
            own = len(admission.claims.get(grower, ()))  # the row fits the pool beside its own claim
            row = PageNeed(grower, min(admission.waiting[grower] + extra, num_pages - own), admission.waiting[grower])
            admission.shortfall([row], num_free_pages=0)
            if admission.outgrows_room(row):
                admission.release(grower)
        elif admission.waiting and any(map(admission.is_reachable, admission.waiting)):
            oldest = next(r for r in admission.waiting if admission.is_reachable(r))
            admission.grant(PageNeed(oldest, 0, admission.waiting[oldest]))
        if index % 3 == 2 and admission.budgets:  # a started request ends
            admission.release(next(iter(admission.budgets)))
        _drain(deepcopy(admission))


def _cached_pool(num_pages: int, *prompts: list[int]):
    """A pool of pages of 4 with a prefix cache, each prompt's full pages cached and held by nobody."""
    from mstar.runtime.engine.kv.pages import PagePool

    pool = PagePool(num_pages, 4, prefix_cache=True)
    for prompt in prompts:
        assert pool.reserve(("writer", "main"), len(prompt))
        pool.commit(("writer", "main"), len(prompt), prompt)
        pool.free_request("writer")
    return pool


def test_a_prefix_claim_takes_no_free_page_the_started_requests_may_still_claim():
    """`claim_cached_prefix` (both engines' claim): cached pages nobody holds count as free, so a
    claim takes no more of them than the room a start has (`room_to_start`): here the 7 free pages
    less the 5 a started request may still claim."""
    from mstar.runtime.engine.kv.claims import claim_cached_prefix

    prompt = list(range(12))
    pool = _cached_pool(8, prompt)
    admission = Admission(num_pages=8)
    assert pool.reserve(("s", "main"), 1)
    admission.grant(PageNeed("s", 1, 6))  # holds 1 of its 6
    assert pool.num_free_pages == 7 and admission.room_to_start("w", 7) == 2
    assert claim_cached_prefix(admission, pool, ("w", "main"), prompt + [99], None) == 8  # 2 of the 3 pages


def test_a_prefix_claim_keeps_every_waiting_requests_room():
    """`claim_cached_prefix` caps a claim by `claim_cap`: a newcomer's claim of pages an older
    waiting request's claim holds costs the requests waiting between them (as in
    `test_a_claim_of_an_older_waiters_pages_leaves_room_for_the_requests_between`, on a real pool),
    and once the started requests end the waiting ones still start, oldest first."""
    from mstar.runtime.engine.kv.claims import claim_cached_prefix

    first, second = list(range(16)), list(range(100, 108))
    pool = _cached_pool(10, first, second)
    admission = Admission(num_pages=10)

    def claim(request_id: str, prompt: list[int], budget: int) -> int:
        num = claim_cached_prefix(admission, pool, (request_id, "main"), prompt, None)
        admission.join(request_id, budget, pool.page_table((request_id, "main")) or None)
        return num

    assert claim("a", first + [1], 2) == 16
    assert claim("b", second + [1], 5) == 8
    assert claim("c", first + [2], 6) == 12  # three of a's four pages: b keeps its room of 3
    _drain(admission)


def test_a_request_that_stops_waiting_no_longer_limits_claims():
    """A waiting request's room caps new claims (`claim_cap`) only while it waits: once it has
    started, a claim it would have capped is whole (its pages count in `room_to_start` instead)."""
    admission = Admission(num_pages=10)
    admission.join("x", 9)
    admission.join("y", 1)
    assert admission.claim_cap("w", lambda: [0, 1]) == 1  # x's room: 10 - 9
    admission.grant(PageNeed("x", 9, 9))
    assert admission.claim_cap("w", lambda: [0, 1]) is None  # y's room is 9 (x's pages: `room_to_start`)
    admission.release("x")
    assert admission.claim_cap("w", lambda: [0, 1]) is None


def test_a_first_rows_page_need_is_counted_once_per_step():
    """`_room_problem` counts a not-started request's first row's page need; admission takes that
    figure (`_Prepared.start_need`) rather than counting it again. A started request's row is
    counted once, by admission. The step runs as before: the same rows short, the same grants."""
    plan = llm_plan(num_pages=4, page_size=8)
    engine = TorchEngine(plan)
    for rid in ("a", "b", "c"):
        assert engine.add_request(rid, Request(id=rid, prompt_tokens=list(range(1, 11)), max_tokens=6)) is None
    runner = engine.runners["LLM"]
    asked: list[str] = []
    page_needs = runner._page_needs

    def counting(ready):
        asked.extend(item.row.request_id for item in ready)
        return page_needs(ready)

    runner._page_needs = counting  # type: ignore[method-assign]

    def prefill(rid):
        return StepRow(rid, "prefill", 10, 0, {"text_inputs": list(range(1, 11))})

    first = engine.run_step(step(plan, "LLM", [prefill("a"), prefill("b"), prefill("c")]))
    assert first.allocation_failed == ["c"] and sorted(asked) == ["a", "b", "c"]
    assert runner.admission.budgets == {"a": 2, "b": 2} and runner.pool.num_free_pages == 0
    asked.clear()
    engine.run_step(step(plan, "LLM", [StepRow("a", "decode", 1, 10, {"text_inputs": [7]}), prefill("c")]))
    assert sorted(asked) == ["a", "c"]
