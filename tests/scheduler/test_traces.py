"""Property tests over random plans and random traces (arrivals, lengths, out-of-memory
injections, cancellations): the harness checks caps, rows limits, one key per step, mixing only
walks of one combined walk, rows really ready, the starvation bound, and that the drain finishes
every request (no row lost or duplicated)."""
from hypothesis import given, settings
from plan_factory import worker_cases
from trace_harness import Runner, ops_strategy, run_ops

from mstar.runtime.scheduler.baseline import BaselineScheduler
from mstar.runtime.scheduler.scheduler import WorkerScheduler


# More examples than the project's short `ci` default (still seconds); `long` raises it further.
MORE = settings(settings.default, max_examples=max(300, settings.default.max_examples))


def run(make, case, ops):
    runner = Runner(make, case.leader, case.deployment)
    run_ops(runner, ops)
    runner.drain()
    return runner


@MORE
@given(worker_cases(), ops_strategy())
def test_invariants_hold_on_random_traces(case, ops):
    run(WorkerScheduler, case, ops)


@MORE
@given(worker_cases(), ops_strategy())
def test_same_plan_trace_and_seed_give_same_schedule(case, ops):
    assert run(WorkerScheduler, case, ops).log == run(WorkerScheduler, case, ops).log


@MORE
@given(worker_cases(), ops_strategy())
def test_fast_and_baseline_schedulers_decide_alike(case, ops):
    assert run(WorkerScheduler, case, ops).log == run(BaselineScheduler, case, ops).log
