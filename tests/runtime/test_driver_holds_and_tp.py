"""The run loop's holds and TP followers, where the suite held nothing (a mutation audit): a held row
wakes when memory frees, and an all-or-nothing engine's failed leader step is followed by no copy."""
from mstar.runtime.conductor.request import Request
from mstar.runtime.engine.sim import SimEngine
from mstar.runtime.scheduler.scheduler import HOLD_BACKOFF_S
from mstar.runtime.serve.driver import Driver, Workload
from mstar.runtime.serve.workload import generate

from runtime_plans import generated


def test_a_held_row_runs_as_soon_as_an_ending_request_frees_memory():
    """A pool with room for one request: r1 is held out of memory; r0's end wakes the hold, so r1's
    first token comes a step after r0's end, not after the backoff (every out-of-memory retry added
    about 50 ms to a TTFT where the end did not wake the holds)."""
    plan = generated("llama")
    page_size = next(p.page_size for p in plan.deployment.kv_pools if p.node == "LLM")
    driver = Driver(plan, SimEngine(plan, num_pages=-(-16 // page_size)))
    driver.run(Workload([Request(id=f"r{i}", prompt_tokens=[i + 1] * 8, max_tokens=8) for i in range(2)]))
    first, second = driver.conductor.records["r0"], driver.conductor.records["r1"]
    assert sum(driver.log.is_oom) > 0 and second.finish_reason == "length"
    assert second.first_token_s - first.finish_s < HOLD_BACKOFF_S / 2


def test_tp_followers_copy_only_the_leader_steps_that_ran_on_an_all_or_nothing_engine():
    """An all-or-nothing engine whose leader step fails a row ran nothing: no follower copies it
    (copies consumed their rows, the retry never gathered them, and all 20 requests ended `error:
    stalled`); every request finishes and each follower's steps are the leader's that ran."""
    plan = generated("orpheus_tp2")
    calls = {"n": 0}

    def every_third_llm_step(step):
        calls["n"] += 1
        return [step.rows[0].request_id] if calls["n"] % 3 == 0 and step.node == "LLM" else []

    driver = Driver(plan, SimEngine(plan, runs_partial_steps=False, inject_oom=every_third_llm_step))
    leader = next(g.leader for w in plan.workers for g in w.tp_groups if g.node == "LLM")
    steps: dict[int, list] = {}
    add = driver.log.add

    def record(launch, *args):
        if launch.batch.node == "LLM":
            ran = launch.result is None or not launch.result.allocation_failed
            steps.setdefault(launch.worker, []).append((tuple(launch.batch.request_ids), ran))
        return add(launch, *args)

    driver.log.add = record
    driver.run(generate(20, prompt_len=(4, 40), output_len=(1, 40), arrival="poisson", concurrency=6, rate=400.0,
                        seed=0))
    assert all(r.finish_reason == "length" for r in driver.conductor.records.values())
    assert any(not ran for _, ran in steps[leader])
    leader_ran = [ids for ids, ran in steps[leader] if ran]
    for rank, found in steps.items():
        if rank != leader:
            assert [ids for ids, _ in found] == leader_ran
