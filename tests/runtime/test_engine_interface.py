"""The run loop drives an engine only through `caps`, `launch` and `wait` (mstar.runtime.step)."""
from __future__ import annotations

import pytest

from mstar.runtime.conductor.request import Request
from mstar.runtime.engine.sim import SimEngine
from mstar.runtime.serve.clock import ClockError
from mstar.runtime.serve.driver import Driver, Workload
from mstar.runtime.step import EngineCaps, StepHandle

from runtime_plans import generated


class _Deferred(SimEngine):
    """A sim engine whose steps run only when waited on (like a device that runs asynchronously);
    it records the order of launch, wait and the scheduler's speculation."""

    def __init__(self, plan, events):
        super().__init__(plan)
        self.events = events

    def launch(self, step):
        self.events.append(("launch", step.is_speculative))
        return StepHandle(step, pending=step)

    def wait(self, handle):
        self.events.append(("wait", handle.step.is_speculative))
        assert handle.result is None and handle.pending is handle.step
        return self.run_step(handle.pending)


def _requests():
    return [Request(id=f"r{i}", prompt_tokens=[1, 2, 3 + i], max_tokens=12) for i in range(6)]


def _outcome(driver):
    return {rid: (r.finish_reason, r.num_output_tokens) for rid, r in driver.conductor.records.items()}


def test_a_deferred_engine_gives_the_same_run_and_speculation_happens_between_launch_and_wait():
    plan = generated("orpheus")
    eager = Driver(plan, SimEngine(plan))
    eager.run(Workload(_requests()))
    events: list = []
    deferred = Driver(plan, _Deferred(plan, events))
    original = deferred.schedulers[0].speculate

    def speculate(*args, **kwargs):
        events.append(("speculate", None))
        return original(*args, **kwargs)

    deferred.schedulers[0].speculate = speculate
    deferred.run(Workload(_requests()))
    assert _outcome(deferred) == _outcome(eager)
    assert eager.log.key == deferred.log.key and eager.log.num_rows == deferred.log.num_rows
    # Step N+1 was composed while N ran: a speculate call sits between a launch and its wait.
    pairs = [(events[i][0], events[i + 1][0], events[i + 2][0]) for i in range(len(events) - 2)]
    assert ("launch", "speculate", "wait") in pairs
    assert any(is_spec for what, is_spec in events if what == "launch")


def test_a_simulated_engine_needs_a_clock_the_loop_can_move():
    plan = generated("orpheus")
    engine = SimEngine(plan)
    engine.caps = EngineCaps(is_simulated=True, clock=lambda: 0.0)
    with pytest.raises(ClockError, match="advance_to"):
        Driver(plan, engine)
