"""On a wall clock, requests that arrive while a step runs are admitted before that step's results
are applied, as on the simulated clock: an online server then schedules the same steps as
`mstar run` on the same arrivals (docs/serve.md, "Against `mstar run` on the same workload")."""
from typing import Optional

from mstar.runtime.conductor.conductor import Conductor
from mstar.runtime.engine.sim import SimEngine
from mstar.runtime.serve.driver import Driver, Workload
from mstar.runtime.serve.paced import PacedEngine
from mstar.runtime.serve.workload import generate

from runtime_plans import generated

NUM_REQUESTS = 40


class _ArrivesDuringTheFirstStep:
    """The first request at once; the others on the next look, which the driver takes once the
    first step has run (on a wall clock the engine's wait returned, so they came during it)."""

    def __init__(self, requests):
        self.first, self.rest = requests[0], requests[1:]
        self.num_looks = 0

    def admit(self, conductor: Conductor, now: float) -> None:
        if self.num_looks == 0:
            conductor.submit(self.first)
        elif self.num_looks == 1:
            for request in self.rest:
                conductor.submit(request)
        self.num_looks += 1

    def wake_times(self) -> list[float]:
        return []

    def is_done(self) -> bool:
        return self.num_looks >= 2

    def is_waiting(self) -> bool:
        return False

    def idle(self, timeout: Optional[float]) -> None:
        pass


def _requests():
    return generate(NUM_REQUESTS, prompt_len=(8, 32), output_len=(8, 16), seed=0).requests


def _schedule(driver: Driver) -> list[tuple[str, tuple]]:
    return [(key, tuple(sorted(rows.items()))) for key, rows in zip(driver.log.key, driver.log.walk_rows)]


def test_requests_that_arrive_during_a_step_are_scheduled_as_on_the_simulated_clock():
    plan = generated("llama")
    simulated = Driver(plan, SimEngine(plan))
    requests = _requests()
    for request in requests[1:]:
        request.arrival_s = 1e-6  # during the first step (the cost model gives it far longer)
    simulated.run(Workload(requests))

    wall = Driver(plan, PacedEngine(SimEngine(plan), pace=0.0))
    wall.run_source(_ArrivesDuringTheFirstStep(_requests()))

    assert all(r.finish_reason == "length" for r in wall.conductor.records.values())
    assert len(wall.conductor.records) == NUM_REQUESTS
    # the second step takes the 16 prompt rows that waited, not the first request's decode row
    # beside 4 of them (its decode row became ready after they arrived)
    assert _schedule(wall)[1][1] == (("prefill", 16),)
    assert _schedule(wall) == _schedule(simulated)


def test_the_first_runs_start_up_collection_does_not_delay_the_workloads_arrivals(monkeypatch):
    """The run's origin is taken after the once-a-process `gc.freeze` of start-up: a slow first
    collection must not shift a request due at 0 later on the run clock (it made `mstar bench kv`
    send its long prompt after the decode rows had finished)."""
    from mstar.runtime.serve import driver as driver_module

    plan = generated("llama")
    engine = SimEngine(plan)
    clock = engine.caps.clock
    monkeypatch.setattr(driver_module, "_is_start_up_frozen", False)
    monkeypatch.setattr(driver_module.gc, "collect", lambda: clock.advance_to(clock() + 5.0))
    monkeypatch.setattr(driver_module.gc, "freeze", lambda: None)
    driver = Driver(plan, engine)
    driver.run(Workload(_requests()[:2]))
    for record in driver.conductor.records.values():
        assert record.arrival_s - driver.origin_s < 1.0
