"""Whisper's decoder keeps its KV per request, not in pages, yet is admitted by the plan's pool
(kv/reserved_pages.py): a request reserves its budget at its first row, so `--kv-pages` bounds how
many decode at once and the torch engine holds the rows the simulated engine holds; the pages come
back when a request ends, and a request that could never fit is refused at admission."""
from __future__ import annotations

from mstar.runtime.conductor.request import Request
from mstar.runtime.engine.kv.reserved_pages import ReservedPages
from mstar.runtime.engine.sim import SimEngine
from mstar.runtime.engine.torch_engine import TorchEngine
from mstar.runtime.serve.driver import Driver, Workload
from runtime_plans import generated


def test_a_request_reserves_its_budget_once_and_gives_it_back():
    pages = ReservedPages("decoder", num_pages=5, page_size=16, max_seq_len=64)
    assert pages.budget_pages(4, 20) == 2 and pages.budget_pages(4, 500) == 4 and pages.budget_pages(4, None) == 4
    assert pages.admit([("a", 2), ("b", 2), ("c", 2)], is_partial_ok=True) == ["c"]
    assert pages.num_held == 4
    assert pages.admit([("a", 2), ("c", 2)], is_partial_ok=True) == ["c"]  # a started request is never short
    assert pages.num_held == 4
    pages.release("a")
    assert pages.num_held == 2 and pages.admit([("c", 2)], is_partial_ok=True) == []
    assert pages.admit([("d", 2)], is_partial_ok=False) == ["d"] and pages.num_held == 4  # nothing reserved
    assert pages.refusal(4, 500) is None  # 64 positions at most: 4 pages
    too_small = ReservedPages("decoder", num_pages=3, page_size=16, max_seq_len=64)
    assert too_small.refusal(4, 500) == ("can never fit: node decoder: prompt (4) + max_tokens (500) need 4 KV pages "
                                         "of 16 but the pool has only 3")


def test_without_partial_steps_a_short_request_leaves_the_others_unreserved():
    """All or nothing: without `is_partial_ok` a step runs no row when one is short, so none of its
    requests may keep a reservation (it would hold pages for a row that did not run)."""
    pages = ReservedPages("decoder", num_pages=3, page_size=16, max_seq_len=64)
    assert pages.admit([("a", 2), ("b", 2)], is_partial_ok=False) == ["b"]
    assert pages.num_held == 0 and not pages.admission.is_started("a")
    assert pages.admit([("a", 2)], is_partial_ok=False) == [] and pages.num_held == 2


def _run(engine) -> tuple[int, list[str], int]:
    """Six requests on the whisper plan: (rows held, finish reasons, the most decoder pages in use
    after any step)."""
    plan = generated("whisper")
    requests = [Request(id=f"r{i}", prompt_tokens=[], max_tokens=60, seed=i) for i in range(6)]
    most = [0]
    wait = engine.wait

    def watched(handle):
        result = wait(handle)
        most[0] = max(most[0], engine.kv_pages()["decoder"][0])
        return result

    engine.wait = watched
    driver = Driver(plan, engine)
    driver.run(Workload(requests))
    reasons = [driver.conductor.records[r.id].finish_reason or "" for r in requests]
    return sum(driver.log.num_held_rows), reasons, most[0]


def test_the_torch_engine_bounds_whisper_by_the_pool_as_the_sim_does():
    """4 pages of 128 tokens: one request's budget each (its 60 tokens within a page), so four
    decode at once and two wait, on both engines (how many times a held row is retried depends on
    the wall clock on the torch engine, the modelled one on the sim: not compared). The engine
    once ran all six whatever --kv-pages said."""
    plan = generated("whisper")
    for engine in (TorchEngine(plan, num_pages=4), SimEngine(plan, num_pages=4),
                   TorchEngine(plan, num_pages=4, runs_partial_steps=False)):
        held, reasons, most = _run(engine)
        assert held > 0 and most == 4, (type(engine).__name__, held, most)
        assert len(reasons) == 6 and not any(r.startswith("error") for r in reasons), reasons
        assert engine.kv_pages()["decoder"] == (0, 4)  # every reservation given back
    engine = TorchEngine(plan, num_pages=4)
    assert engine.add_request("big", Request(id="big", prompt_tokens=[], max_tokens=600)) is None  # 448 positions
    too_small = TorchEngine(plan, num_pages=3)
    assert "the pool has only 3" in too_small.add_request("big", Request(id="big", prompt_tokens=[], max_tokens=600))
