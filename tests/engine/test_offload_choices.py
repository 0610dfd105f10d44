"""Which started requests KV offload moves to the host (kv/offload.py `Offload.victims`) and what
an ended request leaves behind there, beside `test_offload.py`'s choices:

- among requests that ran equally long ago, the one holding the most pages moves first (fewest
  victims, fewest copies of a whole request's KV);
- the choice stops as soon as the pages asked for are freed, counting what a victim's budget may
  still claim (moving it out gives that claim up too): no victim more than needed;
- an ended request's host pages all come back, and the request is forgotten (the bookkeeping
  stays bounded by the live requests).
(`num_starts` 9 below: more starts than any of these moves, so the count rule does not bind.)
"""

from __future__ import annotations

from mstar.runtime.engine.kv.admission import Admission, PageNeed
from mstar.runtime.engine.kv.offload import Offload
from mstar.runtime.engine.kv.pages import PagePool

PAGE = 4


def started(pool: PagePool, admission: Admission, request_id: str, num_pages: int, budget: int) -> None:
    assert pool.reserve((request_id, "main"), PAGE * num_pages)
    admission.grant(PageNeed(request_id, num_pages, budget))


def test_of_requests_that_ran_equally_long_ago_the_largest_moves_first():
    pool, admission = PagePool(16, PAGE), Admission(16)
    started(pool, admission, "small", 2, 2)
    started(pool, admission, "large", 4, 4)
    offload = Offload(num_host_pages=8)
    assert offload.victims(pool, admission, set(), 2, 9) == ["large"]  # neither ran yet
    offload.note_step(["small", "large"])
    assert offload.victims(pool, admission, set(), 2, 9) == ["large"]  # both ran in the same step


def test_victims_stop_once_the_pages_asked_for_are_freed():
    pool, admission = PagePool(16, PAGE), Admission(16)
    for request_id in ("a", "b", "c"):
        started(pool, admission, request_id, 3, 3)
    offload = Offload(num_host_pages=9)
    for request_id in ("a", "b", "c"):  # a ran longest ago
        offload.note_step([request_id])
    assert offload.victims(pool, admission, set(), 3, 9) == ["a"]  # a's 3 pages are exactly enough
    assert offload.victims(pool, admission, set(), 4, 9) == ["a", "b"]


def test_a_victims_budget_left_counts_as_freed():
    """x holds 1 page of a 4-page budget: moving it out frees its page and the 3 it may still claim."""
    pool, admission = PagePool(16, PAGE), Admission(16)
    started(pool, admission, "x", 1, 4)
    offload = Offload(num_host_pages=4)
    assert offload.victims(pool, admission, set(), 4, 9) == ["x"]
    assert offload.victims(pool, admission, set(), 5, 9) == []


def test_an_ended_request_gives_back_its_host_pages_and_is_forgotten():
    offload = Offload(num_host_pages=6)
    offload.note_step(["a", "b"])
    offload.take("a", [("main", 10, 3), ("cfg", 5, 2)])
    assert offload.num_free_host_pages == 1
    offload.forget("a")
    offload.forget("b")  # ended without being offloaded
    assert offload.num_free_host_pages == 6 and not offload.is_offloaded("a")
    assert offload.last_run == {}


def test_both_engines_move_out_the_least_recently_run():
    """The same steps on the simulated and the torch engine (8 pages): A ran at step 1, B at steps 2
    and 3, then C and D need 5 pages with 3 free. Both move A out; the torch engine never told its
    host pool which requests ran, and moved B out (the most pages), which had just run. (Two starts:
    a move must start more requests than it moves out.)"""
    from engine_plans import step
    from mstar.plan.io import load_plan
    from mstar.runtime.conductor.request import Request
    from mstar.runtime.engine.sim import SimEngine
    from mstar.runtime.engine.torch_engine import TorchEngine
    from mstar.runtime.step import StepRow

    plan = load_plan("generated/llama_chunked.plan", verify=False)  # a host pool
    prompts = {"A": list(range(1, 21)), "B": list(range(100, 140)), "C": list(range(200, 260)),
               "D": list(range(300, 308))}
    max_tokens = {"A": 12, "B": 8, "C": 4, "D": 4}  # budgets: A 2 pages, B 3, C 4, D 1

    def prefill(request_id):
        return StepRow(request_id, "prefill", len(prompts[request_id]), 0, {"text_inputs": prompts[request_id]})

    for engine in (SimEngine(plan, num_pages=8), TorchEngine(plan, dims="tiny", num_pages=8)):
        for request_id, prompt in prompts.items():
            assert engine.add_request(request_id, Request(id=request_id, prompt_tokens=prompt,
                                                          max_tokens=max_tokens[request_id])) is None
        for rows in ([prefill("A")], [prefill("B")], [StepRow("B", "decode", 1, 40, {"text_inputs": [5]})]):
            engine.run_step(step(plan, "LLM", rows))
        offload = engine.pools["LLM"].offload if isinstance(engine, SimEngine) else engine.runners["LLM"].offload
        # C alone: moving A (or B) out would start one request for one that runs again: nobody moves
        # and C waits (under an overload such swaps made a host pool slower than none).
        result = engine.run_step(step(plan, "LLM", [prefill("C")]))
        assert result.allocation_failed == ["C"] and not offload.offloaded, type(engine).__name__
        result = engine.run_step(step(plan, "LLM", [prefill("C"), prefill("D")]))
        assert result.allocation_failed == [] and sorted(offload.offloaded) == ["A"], type(engine).__name__


def test_rows_short_behind_older_reservations_want_those_too():
    """Older waiting requests reserve more than is free (room below zero): the refused start wants
    its pages and that deficit. Clamped at zero, the pages moved out went to the reservations, the
    start was refused anyway, and a run could hold every request with the pool free."""
    admission = Admission(16)
    admission.grant(PageNeed("running", 8, 12))  # holds 8, may claim 4 more
    for request_id in ("old", "new"):
        admission.join(request_id, 6)  # both wait: "old" first
    short = admission.pages_short([PageNeed("new", 6, 6)], {"new"}, num_free_pages=8)
    assert short == 6 - (8 - 4 - 6) == 8  # the room left by "running"'s claim and "old"'s 6 is -2


def test_a_victim_with_pages_reserved_past_its_tokens_comes_back_with_matching_pages():
    """A step that reserved a request's pages and failed before writing them (its rows then run
    again alone) leaves pages past the tokens written. Moved out, only the pages holding tokens are
    copied and recorded: the move back reserves the pages of its tokens, and pairing every reserved
    page with them gave the copy back lists of two lengths."""
    pool, admission = PagePool(4, PAGE), Admission(4)
    started(pool, admission, "x", 3, 4)  # 3 of the 4 pages reserved
    pool.commit(("x", "main"), 5)  # 5 tokens written: 2 pages hold them
    offload = Offload(num_host_pages=8)
    copies: list[tuple[list[int], list[int]]] = []
    moved = offload.move_out(pool, admission, {}, set(), [PageNeed("y", 4, 4)], ["y", "z"],
                             lambda device, host: copies.append((device, host)))
    assert moved == 2 and [len(device) for device, _ in copies] == [2] == [len(host) for _, host in copies]
    assert pool.num_free_pages == 4
    (back,) = offload.restore("x")
    assert pool.restore(("x", back.label), back.num_tokens)
    assert len(pool.page_table(("x", back.label))) == len(back.host_pages) == 2
