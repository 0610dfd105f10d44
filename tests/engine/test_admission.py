"""One admission policy over the page pool (kv/admission.py) for the simulated and torch engines:
the same steps fail the same rows out of memory on both."""
from __future__ import annotations

from engine_plans import llm_plan, step
from mstar.runtime.conductor.request import Request
from mstar.runtime.engine.kv.admission import Admission, PageNeed
from mstar.runtime.engine.sim import SimEngine
from mstar.runtime.engine.torch_engine import TorchEngine
from mstar.runtime.step import StepRow


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
