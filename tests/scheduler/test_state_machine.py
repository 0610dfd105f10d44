"""A RuleBasedStateMachine drives the scheduler through arrivals, steps, speculation,
out-of-memory failures (holds), clock advances and removals; after every rule the scheduler's
counts agree with the harness's view of each row, and teardown drains every request."""
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule
from plan_factory import worker_cases
from trace_harness import Runner

from mstar.runtime.scheduler.scheduler import WorkerScheduler


class SchedulerMachine(RuleBasedStateMachine):
    @initialize(case=worker_cases(with_tp=False))
    def start(self, case):
        self.runner = Runner(WorkerScheduler, case.leader, case.deployment)

    @rule(key=st.integers(0, 5), first=st.integers(0, 2), loop=st.integers(0, 2),
          length=st.integers(0, 5), tokens=st.integers(1, 40))
    def arrive(self, key, first, loop, length, tokens):
        self.runner.arrive(key, [first] + [loop] * length, [tokens] + [1] * length)

    @rule()
    def build(self):
        self.runner.build()

    @rule()
    def speculate(self):
        self.runner.speculate()

    @rule()
    def finish_step(self):
        self.runner.complete(0)

    @rule(bits=st.sampled_from([0b1, 0b10, 0b101, 0xFFFF]))
    def fail_out_of_memory(self, bits):
        self.runner.complete(bits)

    @rule(pick=st.integers(0, 100))
    def remove(self, pick):
        self.runner.remove(pick)

    @rule(dt=st.sampled_from([0.01, 0.05, 0.2]))
    def advance_clock(self, dt):
        self.runner.advance(dt)

    @invariant()
    def counts_agree(self):
        if not hasattr(self, "runner"):
            return
        states = [req.state for req in self.runner.reqs.values()]
        sched = self.runner.sched
        assert sched.num_ready() + sched.num_held() == states.count("ready") + states.count("held")

    def teardown(self):
        if hasattr(self, "runner"):
            self.runner.drain()


# Examples come from the loaded hypothesis profile (ci by default, `long` for long runs).
SchedulerMachine.TestCase.settings = settings(
    settings.default, stateful_step_count=50, suppress_health_check=[HealthCheck.too_slow]
)
test_scheduler_state_machine = SchedulerMachine.TestCase
