"""A long run keeps no per-request state of ended requests in the schedulers (`mstar serve`
runs one driver for its whole life). Sizes are asserted, never times."""
import pytest

from mstar.runtime.engine.sim import SimEngine
from mstar.runtime.serve.driver import Driver
from mstar.runtime.serve.workload import generate

from runtime_plans import generated

NUM_REQUESTS = 200
CONCURRENCY = 8


@pytest.mark.parametrize("name, engine_kw, num_cancelled", [
    ("llama", {}, 0),  # speculation chains
    ("orpheus", {"num_pages": 12}, 20),  # out-of-memory holds, cancellations while rows run
    ("orpheus_tp2", {}, 0),  # TP followers
])
def test_ended_requests_leave_no_state_in_the_schedulers(name, engine_kw, num_cancelled):
    plan = generated(name)
    workload = generate(NUM_REQUESTS, prompt_len=(4, 40), output_len=(1, 24), arrival="closed",
                        concurrency=CONCURRENCY, seed=5)
    # cancel every tenth request shortly after the run starts: some wait, some run
    workload.cancellations = [(0.002 * i, workload.requests[10 * i].id) for i in range(num_cancelled)]
    driver = Driver(plan, SimEngine(plan, **engine_kw))
    driver.run(workload)
    records = driver.conductor.records.values()
    assert len(records) == NUM_REQUESTS and all(r.is_finished for r in records)
    if num_cancelled:
        assert any(r.finish_reason == "cancelled" for r in records)
    for rank, sched in driver.schedulers.items():
        tracked = sched.num_tracked()
        assert sched.is_idle()
        assert tracked["present"] == tracked["classes"] == tracked["guided"] == tracked["follow"] == 0, (rank, tracked)
        # Tombstones only for requests of the last two steps, each of at most CONCURRENCY rows.
        assert tracked["removed"] <= 2 * CONCURRENCY, (rank, tracked)
