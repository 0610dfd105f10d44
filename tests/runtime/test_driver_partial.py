"""Partial steps through the driver with the torch engine: when a small KV pool fails some rows of
a step, the other rows of that step run and are post-processed in it; only the failed rows are
held and retried; every request finishes with the greedy tokens of a roomy-pool run."""
import pytest

from mstar.runtime.serve.driver import Driver, Workload
from mstar.runtime.conductor.request import Request

from runtime_plans import generated

torch_engine = pytest.importorskip("mstar.runtime.engine.torch_engine")


def _tokens(record):
    return [list(e.value) for e in record.emissions if e.modality == "text"], list(record.output_tokens)


def test_rows_that_got_memory_advance_in_the_failing_step():
    plan = generated("llama")
    page_size = next(p.page_size for p in plan.deployment.kv_pools if p.node == "LLM")
    num_pages = 2 * -(-(4 + 12) // page_size)  # room for about two requests at a time
    engine = torch_engine.TorchEngine(plan, num_pages=num_pages)
    partial_steps = []
    original = engine.wait

    def spy(handle):
        step = handle.step
        result = original(handle)
        if result.allocation_failed:
            failed = set(result.allocation_failed)
            ran = {r.request_id for r in result.rows if r.error is None}
            assert ran == {row.request_id for row in step.rows} - failed  # the others ran
            if ran:
                partial_steps.append((ran, failed))
        return result

    engine.wait = spy
    requests = [Request(id=f"r{i}", prompt_tokens=[i + 1] * 4, max_tokens=12) for i in range(8)]
    driver = Driver(plan, engine)
    driver.run(Workload(requests))
    assert partial_steps, "no step both failed rows and ran others"
    roomy = Driver(plan, torch_engine.TorchEngine(plan))
    roomy.run(Workload([Request(id=r.id, prompt_tokens=r.prompt_tokens, max_tokens=r.max_tokens) for r in requests]))
    for request in requests:
        record = driver.conductor.records[request.id]
        assert record.finish_reason == "length" and record.num_output_tokens == 12
        assert _tokens(record) == _tokens(roomy.conductor.records[request.id])
    assert engine.runners["LLM"].pool.num_free_pages == num_pages  # every page came back
    # Every held row was retried and the log counts rows that ran, not held ones.
    assert sum(driver.log.num_held_rows) >= len(partial_steps)
    assert all(s.is_idle() for s in driver.schedulers.values())


def test_all_or_nothing_engine_still_runs_every_request():
    plan = generated("llama")
    page_size = next(p.page_size for p in plan.deployment.kv_pools if p.node == "LLM")
    num_pages = 2 * -(-(4 + 12) // page_size)
    engine = torch_engine.TorchEngine(plan, num_pages=num_pages, runs_partial_steps=False)
    requests = [Request(id=f"r{i}", prompt_tokens=[i + 1] * 4, max_tokens=12) for i in range(6)]
    driver = Driver(plan, engine)
    driver.run(Workload(requests))
    roomy = Driver(plan, torch_engine.TorchEngine(plan))
    roomy.run(Workload([Request(id=r.id, prompt_tokens=r.prompt_tokens, max_tokens=r.max_tokens) for r in requests]))
    assert any(driver.log.is_oom)
    for request in requests:
        record = driver.conductor.records[request.id]
        assert record.finish_reason == "length"
        assert _tokens(record) == _tokens(roomy.conductor.records[request.id])


def test_a_request_whose_rows_outgrow_the_pool_ends_alone_at_once():
    """BAGEL's LLM budgets a request its prompt + max_tokens plus the media tokens its encoders
    declare (8 each at tiny dims), cut to the pool: an estimate, so a request whose text fits is
    accepted (docs/runtime.md "Admission": the text-only request here runs though text + media do
    not fit). The image route's request feeds 8 image tokens + 10 + its decode, past the 2 pages of
    16 tokens: its row that would take its sequence to a 3rd page now ends it alone with an error
    naming the pages (`DecoderRunner._past_pool`), where it was held until the run loop called it
    stalled 30 s later, the pool held all the while; the other request finishes."""
    plan = generated("bagel")
    engine = torch_engine.TorchEngine(plan, num_pages=2)
    route = {"LLM": ["prefill_vit", "prefill_text", "decode"]}
    requests = [Request(id="image", prompt_tokens=list(range(1, 11)), max_tokens=20, route=route),
                Request(id="text", prompt_tokens=list(range(1, 11)), max_tokens=20)]
    driver = Driver(plan, engine)
    driver.run(Workload(requests))
    image, text = (driver.conductor.records[r.id] for r in requests)
    assert image.finish_reason.startswith("error: node LLM: the request's KV sequences would grow to 3 pages of 16 "
                                          "tokens, past the pool's 2: its rows fed more tokens than its start budget "
                                          "of 2 pages"), image.finish_reason
    assert text.finish_reason == "length" and text.num_output_tokens == 20
    assert engine.runners["LLM"].pool.num_free_pages == 2  # every page came back
