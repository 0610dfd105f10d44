"""A RuleBasedStateMachine drives the scheduler through arrivals, steps, speculation,
out-of-memory failures (holds), clock advances and removals; after every rule the scheduler's
counts agree with the harness's view of each row, and teardown drains every request."""
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule
from plan_factory import WorkerCase, assemble_worker, build_key, worker_cases
from trace_harness import Runner

from mstar.plan.schema import DeploymentPlan, SpeculationPlan
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



def one_key_cap_one_case(can_speculate: bool) -> WorkerCase:
    """The plan of the example hypothesis found: one key, one walk of cap 1, F = 1."""
    key = build_key("N0", ["decode"], {"decode": 1})
    specs = [SpeculationPlan(node="N0", walk="decode", can_speculate=can_speculate, mixes_walks=False)]
    deployment = DeploymentPlan(max_seq_len=4096, kv_pools=[], max_consecutive_follower_batches=1)
    return WorkerCase(assemble_worker(0, [key], specs, []), None, deployment, None)


def replay(state: SchedulerMachine, steps: list) -> None:
    """Run rules in order, checking the invariant after each, as hypothesis does."""
    for times, rule_name, kwargs in steps:
        for _ in range(times):
            getattr(state, rule_name)(**kwargs)
            state.counts_agree()


def test_rows_back_from_a_hold_are_older_than_a_row_that_returns_after_them():
    """Regression: hypothesis found "r0 waited 3 batches (bound 2)" (this trace, as it printed
    it). r0, r1 and r2 each fail out of memory and are held until 0.05; the drain moves the clock
    there and `next_batch` returns the three holds to the queue, r0 first. r0 runs, comes back
    from its step behind r1 and r2, and runs third. The scheduler was right: r0 had two older
    ready rows (bound (2+1)*1*(1+1) = 6). The harness's model was wrong: a row back from a hold
    counted as ready only when scheduled, so it saw q = 0 ahead of r0 (bound 2), and the bound
    of rows back from a hold was never checked. The harness now returns expired holds when the
    scheduler does (in next_batch and speculate) and checks every row."""
    state = SchedulerMachine()
    state.start(case=one_key_cap_one_case(can_speculate=False))
    state.counts_agree()
    replay(state, [
        (17, "build", {}),
        (1, "arrive", dict(first=0, key=0, length=5, loop=0, tokens=1)),  # r0
        (3, "build", {}),
        (1, "fail_out_of_memory", dict(bits=1)),  # r0 held
        (2, "build", {}),
        (1, "arrive", dict(first=0, key=0, length=0, loop=0, tokens=1)),  # r1
        (6, "build", {}),
        (1, "arrive", dict(first=0, key=0, length=0, loop=0, tokens=1)),  # r2
        (1, "build", {}),
        (1, "fail_out_of_memory", dict(bits=1)),  # r1 held
        (3, "build", {}),
        (1, "fail_out_of_memory", dict(bits=1)),  # r2 held
        (7, "build", {}),
    ])
    num_logged = len(state.runner.log)
    state.teardown()  # the drain, where the bound was broken
    drained = [entry[1].request_ids for entry in state.runner.log[num_logged:] if entry[0] == "build" and entry[1]]
    assert drained[:4] == [["r0"], ["r1"], ["r2"], ["r0"]]


def test_holds_returned_inside_speculate_count_ahead_of_the_chains_rows():
    """The same model error through `speculate`, which also returns expired holds: r1 and r2,
    held, go back to the queue when r0's chain asks to speculate (the chain yields to them);
    r0 comes back from its step behind them and runs third, within its bound."""
    state = SchedulerMachine()
    state.start(case=one_key_cap_one_case(can_speculate=True))
    replay(state, [
        (1, "arrive", dict(key=0, first=0, loop=0, length=2, tokens=1)),  # r0: three steps
        (2, "arrive", dict(key=0, first=0, loop=0, length=0, tokens=1)),  # r1, r2
        (1, "build", {}),
        (1, "finish_step", {}),  # r0 comes back behind r1 and r2
        (1, "build", {}),
        (1, "fail_out_of_memory", dict(bits=0xFFFF)),  # r1 held
        (1, "build", {}),
        (1, "fail_out_of_memory", dict(bits=0xFFFF)),  # r2 held
        (1, "build", {}),  # r0
        (1, "advance_clock", dict(dt=0.2)),
        (1, "speculate", {}),  # both holds expire here; the chain yields
        (1, "finish_step", {}),  # r0 ready, two rows ahead of it
    ])
    replay(state, [(1, "build", {}), (1, "finish_step", {})] * 3)
    order = [entry[1].request_ids for entry in state.runner.log if entry[0] == "build" and entry[1]]
    assert order[-3:] == [["r1"], ["r2"], ["r0"]]
    state.teardown()
