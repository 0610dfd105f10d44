"""KV pool and slot pool limits: allocation failure holds rows (nothing lost), a request that can
never fit is refused by add_request, and too few recurrent slots are refused at start-up."""
import pytest

from engine_plans import generate, hybrid_plan, llm_plan, step
from mstar.runtime.engine.torch_engine import EngineError, TorchEngine
from mstar.runtime.engine.kv.pages import PagePool
from mstar.runtime.conductor.request import Request
from mstar.runtime.step import StepRow


def test_page_pool_reserve_is_all_or_nothing():
    pool = PagePool(num_pages=3, page_size=4)
    assert pool.reserve(("a", "main"), 9)  # 3 pages
    assert not pool.reserve(("b", "main"), 1)
    assert pool.page_table(("b", "main")) == [] and pool.num_free_pages == 0
    pool.free_request("a")
    assert pool.num_free_pages == 3 and pool.reserve(("b", "main"), 1)


def test_full_pool_fails_rows_and_every_request_still_finishes():
    prompts = {f"r{i}": [i + 1] * 10 for i in range(6)}
    # 4 pages of 8 positions: each request needs 2 pages (10 prompt + 6 new), so two run at a time.
    small = TorchEngine(llm_plan(num_pages=4, page_size=8))
    big = TorchEngine(llm_plan(num_pages=64, page_size=8))
    failed_rows = []
    original = small.run_step

    def spy(s):
        result = original(s)
        failed_rows.extend(result.allocation_failed)
        return result

    small.run_step = spy
    assert generate(small, prompts, 6) == generate(big, prompts, 6)
    assert failed_rows, "the small pool should have failed some rows"
    assert small.runners["LLM"].pool.num_free_pages == 4  # every page came back


def test_all_or_nothing_allocation_failure_runs_nothing_in_the_step():
    engine = TorchEngine(llm_plan(num_pages=2, page_size=8), runs_partial_steps=False)
    for rid in ("a", "b"):
        assert engine.add_request(rid, Request(id=rid, prompt_tokens=[1] * 8, max_tokens=8)) is None
    prefill = {rid: StepRow(rid, "prefill", 8, 0, {"text_inputs": [1] * 8}) for rid in "ab"}
    result = engine.run_step(step(engine.plan, "LLM", list(prefill.values())))
    # b cannot start beside a (each may need 2 pages); the step runs nothing and names b.
    assert result.rows == [] and result.allocation_failed == ["b"]
    assert engine.runners["LLM"].pool.num_free_pages == 2
    first = engine.run_step(step(engine.plan, "LLM", [prefill["a"]]))
    again = TorchEngine(llm_plan(num_pages=2, page_size=8))
    again.add_request("a", Request(id="a", prompt_tokens=[1] * 8, max_tokens=8))
    assert first.rows[0].outputs == again.run_step(step(again.plan, "LLM", [prefill["a"]])).rows[0].outputs
    engine.end_request("a")
    result = engine.run_step(step(engine.plan, "LLM", [prefill["b"]]))
    assert [r.request_id for r in result.rows] == ["b"] and not result.allocation_failed


def test_request_that_can_never_fit_is_refused():
    engine = TorchEngine(llm_plan(num_pages=4, page_size=8))
    reason = engine.add_request("big", Request(id="big", prompt_tokens=[1] * 30, max_tokens=10))
    assert reason is not None and "need 5 KV pages" in reason and "only 4" in reason
    assert engine.add_request("ok", Request(id="ok", prompt_tokens=[1] * 20, max_tokens=10)) is None


def test_bad_sampling_settings_are_refused():
    engine = TorchEngine(llm_plan())
    reason = engine.add_request("t", Request(id="t", prompt_tokens=[1], max_tokens=2, top_p=1.5))
    assert reason is not None and "top_p" in reason


def test_too_few_recurrent_slots_refused_at_start():
    with pytest.raises(EngineError, match="slot 0 is the padding sink"):
        TorchEngine(hybrid_plan(num_slots=1))
    with pytest.raises(EngineError, match="max_concurrent_requests=8"):
        from engine_plans import LLM_DIMS
        from mstar.plan.schema import RecurrentState

        recurrent = RecurrentState(num_layers=3, num_heads=2, key_dim=16, value_dim=16, num_slots=4)
        TorchEngine(llm_plan(dict(LLM_DIMS, layers=4, layer_pattern=[0, 0, 0, 1]), recurrent=recurrent,
                             max_concurrent=8))


def test_slot_pool_full_holds_rows_until_a_request_ends():
    prompts = {f"r{i}": [i + 2] * 5 for i in range(4)}
    # 3 slots = sink + 2 requests at a time.
    engine = TorchEngine(hybrid_plan(num_slots=3))
    assert generate(engine, prompts, 4) == generate(TorchEngine(hybrid_plan()), prompts, 4)
    assert engine.runners["LLM"].slots.num_free_slots == 2  # every slot came back


def test_partial_steps_run_the_rows_that_got_memory():
    engine = TorchEngine(llm_plan(num_pages=2, page_size=8))  # partial steps are the default
    for rid in ("a", "b"):
        assert engine.add_request(rid, Request(id=rid, prompt_tokens=[1] * 8, max_tokens=8)) is None
    rows = [StepRow(rid, "prefill", 8, 0, {"text_inputs": [1] * 8}) for rid in "ab"]
    result = engine.run_step(step(engine.plan, "LLM", rows))
    assert [r.request_id for r in result.rows] == ["a"] and result.allocation_failed == ["b"]
    prompts = {f"r{i}": [i + 1] * 10 for i in range(6)}
    partial = TorchEngine(llm_plan(num_pages=4, page_size=8), runs_partial_steps=True)
    assert generate(partial, prompts, 6) == generate(TorchEngine(llm_plan()), prompts, 6)


@pytest.mark.parametrize("prefix_cache", [False, True])
def test_page_pool_columns_answer_as_the_per_key_methods(prefix_cache):
    """A `SequenceColumn` (a decode step's sequences: lengths, page tables, `commit_one_each`)
    leaves the pool as `extent`, `page_table` and `commit(key, 1)` one key at a time do."""
    pools = [PagePool(num_pages=12, page_size=4, prefix_cache=prefix_cache) for _ in range(2)]
    keys = [(f"r{i}", "main") for i in range(3)]
    for pool in pools:
        for i, key in enumerate(keys):
            assert pool.reserve(key, 4 * i + 3)
            pool.commit(key, 4 * i + 3, list(range(1, 4 * i + 4)))  # keyed pages (prefix cache)
    columns, rows = pools
    assert columns.column(keys + [("nobody", "main")]) is None
    for turn in range(6):  # past page boundaries: grow the rows that need a page, then commit
        column = columns.column(keys)
        assert column is not None
        assert list(zip(column.num_tokens.tolist(), column.num_held.tolist())) == [rows.extent(key) for key in keys]
        for key in keys:
            assert columns.reserve(key, 1) and rows.reserve(key, 1)
        assert column.page_tables() == [rows.page_table(key) for key in keys]
        assert column.page_tables([2, 0]) == [rows.page_table(keys[2]), rows.page_table(keys[0])]
        kept = [True, turn % 2 == 0, True]
        column.take(kept).commit_one_each()
        for key, is_kept in zip(keys, kept):
            if is_kept:
                rows.commit(key, 1)
        assert [vars(columns._seqs[key]) for key in keys] == [vars(rows._seqs[key]) for key in keys]
    assert columns.num_free_pages == rows.num_free_pages
