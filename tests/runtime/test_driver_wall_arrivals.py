"""On a wall clock, requests that arrive while a step runs are admitted before that step's results
are applied, as on the simulated clock: an online server then schedules the same steps as
`mstar run` on the same arrivals (docs/serve.md, "Against `mstar run` on the same workload")."""
import threading
import time
from typing import Optional

import pytest

from mstar.runtime.conductor.conductor import Conductor
from mstar.runtime.engine.sim import SimEngine
from mstar.runtime.serve.driver import Driver, Workload
from mstar.runtime.serve.online import Observer, OnlineLoop
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


class _FirstStepSlow(PacedEngine):
    """The first step takes `FIRST_STEP_S` of wall time; the others none."""

    def __init__(self, plan):
        super().__init__(SimEngine(plan), pace=0.0)
        self.num_waits = 0

    def wait(self, handle):
        self.num_waits += 1
        if self.num_waits == 1:
            time.sleep(FIRST_STEP_S)
        return super().wait(handle)


FIRST_STEP_S = 1.5
# after the first step's launch, even on a slow start: 40 ms seen after other tests, and past 100 ms
# on a loaded 2-core machine (the second then shared the first step, and waited 36 ms)
SECOND_ARRIVES_S = 0.5


def _two_requests():
    first, second = generate(2, prompt_len=(8, 8), output_len=(4, 4), seed=0).requests
    first.arrival_s, second.arrival_s = 0.0, SECOND_ARRIVES_S  # the second while the first's step runs
    return first, second


def test_a_request_that_arrived_during_a_step_counts_its_wait_in_its_ttft():
    """On a wall clock the driver hands an arrival to the conductor only after the step then running:
    the request's record keeps when it arrived (its TTFT counted from the hand-over said a few ms
    where its client waited for the whole step)."""
    plan = generated("llama")
    driver = Driver(plan, _FirstStepSlow(plan))
    first, second = _two_requests()
    driver.run(Workload([first, second]))
    record = driver.conductor.records[second.id]
    assert record.arrival_s == pytest.approx(driver.origin_s + SECOND_ARRIVES_S)
    assert record.admit_s - record.arrival_s > FIRST_STEP_S / 2
    assert record.first_token_s - record.arrival_s > FIRST_STEP_S / 2


def test_the_servers_ttft_counts_the_wait_in_its_inbox():
    """A request queued while the driver thread is inside a step: the server's TTFT (its
    observer's, `mstar_time_to_first_token_seconds`) counts from `submit`, not from when the
    driver thread took it after the step."""
    plan = generated("llama")
    first_outputs: dict[str, float] = {}
    ended = threading.Event()

    class Recorder(Observer):
        def on_first_output(self, seconds: float) -> None:
            first_outputs[f"r{len(first_outputs)}"] = seconds

    loop = OnlineLoop(plan, _FirstStepSlow(plan), observer=Recorder())
    loop.start()
    first, second = _two_requests()
    try:
        loop.submit(first, lambda delta: None)
        time.sleep(SECOND_ARRIVES_S)  # the driver thread is inside the first step now
        submitted = time.monotonic()
        loop.submit(second, lambda delta: ended.set() if delta.finish_reason else None)
        assert ended.wait(10)
        waited = time.monotonic() - submitted
    finally:
        loop.close(5)
    assert FIRST_STEP_S / 2 < first_outputs["r1"] <= waited
