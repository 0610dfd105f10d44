"""The admission policy's counts for started requests and refused starts (kv/admission.py), each
checked against the rule it serves rather than a figure:

- a started request's growth within its budget is never refused, however full the pool (the
  promise that lets every started request finish), also when several such rows share a step;
- a started request past its budget takes only pages no other started request may still claim;
- `num_outstanding` is always the started requests' remaining budgets, whatever they grant;
- a waiting request's row that outgrows its room, by a single page, is refused for good and does
  not wait with the larger figure (which could never start);
- `pages_short` is the fewest pages whose freeing lets the oldest refused start pass (what KV
  offload moves: more costs copies, fewer moves pages and still refuses the row).
Hypothesis runs a few examples by default and many more under `HYPOTHESIS_PROFILE=long`.
"""

from __future__ import annotations

import os

from hypothesis import example, given, settings, strategies as st

from mstar.runtime.engine.kv.admission import Admission, PageNeed

IS_LONG = os.environ.get("HYPOTHESIS_PROFILE") == "long"


def remaining(admission: Admission) -> int:
    return sum(max(0, budget - admission.held[rid]) for rid, budget in admission.budgets.items())


@settings(max_examples=500 if IS_LONG else 60)
@given(
    st.lists(st.integers(1, 6), min_size=1, max_size=5), st.lists(st.lists(st.integers(0, 4), max_size=5), max_size=8)
)
@example([2, 2], [[1, 1]])  # two rows of one step, each taking a page of its own budget
def test_started_requests_growing_within_their_budgets_are_never_refused(budgets, steps):
    """The pool holds exactly the started requests' budgets; each step every request asks for some
    of what its budget has left, in one step together. Counting a row's growth against the
    outstanding claims twice (once as a page taken, once still outstanding) refused the second row
    of such a step."""
    admission = Admission(num_pages=sum(budgets))
    ids = [f"r{i}" for i in range(len(budgets))]
    for rid, budget in zip(ids, budgets):
        assert admission.shortfall([PageNeed(rid, 0, budget)], sum(budgets) - sum(admission.held.values())) == []
        admission.grant(PageNeed(rid, 0, budget))
    for asks in steps:
        needs = [
            PageNeed(rid, min(ask, admission.budgets[rid] - admission.held[rid]), 0) for rid, ask in zip(ids, asks)
        ]
        num_free = sum(budgets) - sum(admission.held.values())
        assert admission.shortfall(needs, num_free) == [], "a started request was refused within its budget"
        for need in needs:
            admission.grant(need)
        assert admission.num_outstanding == remaining(admission)


def test_a_row_past_its_budget_takes_no_page_another_started_request_may_claim():
    admission = Admission(num_pages=5)
    admission.grant(PageNeed("a", 2, 2))  # a's budget all held
    admission.grant(PageNeed("b", 1, 3))  # b may still claim 2
    assert admission.num_outstanding == 2
    # two free pages are b's to claim: a's extra page would leave b unable to finish
    assert admission.shortfall([PageNeed("a", 1, 0)], num_free_pages=2) == ["a"]
    assert admission.shortfall([PageNeed("a", 1, 0)], num_free_pages=3) == []
    # b's own growth within its budget still passes on those two pages
    assert admission.shortfall([PageNeed("b", 2, 0)], num_free_pages=2) == []


@settings(max_examples=500 if IS_LONG else 60)
@given(st.lists(st.tuples(st.integers(0, 3), st.integers(0, 5), st.integers(0, 6), st.booleans()), max_size=30))
def test_outstanding_is_always_the_started_requests_remaining_budgets(events):
    """Grants within and past budgets, and releases, in any order: the running count the policy
    keeps (so a step costs O(rows)) equals the sum it stands for."""
    admission = Admission()
    for index, num_pages, budget, is_release in events:
        rid = f"r{index}"
        if is_release:
            admission.release(rid)
        else:
            admission.grant(PageNeed(rid, num_pages, budget))
        assert admission.num_outstanding == remaining(admission)


def test_a_waiting_row_one_page_past_its_room_is_refused_for_good():
    """A request waits with its budget (4 pages of a 4-page pool: room 0); a row of it adding 5
    pages could never start. It is refused without waiting with 5, which no pool of 4 holds."""
    admission = Admission(num_pages=4)
    assert admission.shortfall([PageNeed("a", 4, 4)], num_free_pages=0) == ["a"]
    assert admission.waiting == {"a": 4}
    grown = PageNeed("a", 5, 4)
    assert admission.outgrows_room(grown)
    assert admission.shortfall([grown], num_free_pages=4) == ["a"]
    assert admission.waiting == {"a": 4} and admission.is_reachable("a")


def test_pages_short_is_the_fewest_pages_that_let_the_refused_start_pass():
    """A started request may still claim 2 pages and an older waiting request reserves 3: a start
    of 5 pages on 6 free ones is short of exactly 4 (the waiter's reservation counts, the free
    pages beyond the claims and the reservation do not)."""
    admission = Admission(num_pages=12)
    admission.grant(PageNeed("s", 2, 4))
    admission.join("older", 3)
    start = PageNeed("r", 5, 5)
    assert admission.shortfall([start], num_free_pages=6) == ["r"]
    short = admission.pages_short([start], {"r"}, num_free_pages=6)
    assert admission.shortfall([start], num_free_pages=6 + short) == []
    assert admission.shortfall([start], num_free_pages=6 + short - 1) == ["r"]
