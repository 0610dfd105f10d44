"""The scheduler runs every worker of every checked-in plan (real compiler output) through a
fixed trace with speculation, out-of-memory holds and a removal, and drains it."""
from pathlib import Path

import pytest
from trace_harness import Runner, run_ops

from mstar.plan.io import PlanError, load_plan
from mstar.runtime.scheduler.baseline import BaselineScheduler
from mstar.runtime.scheduler.scheduler import WorkerScheduler

PLANS = sorted((Path(__file__).resolve().parents[2] / "generated").glob("*.plan"))

TRACE = [
    ("arrive", 0, 5, (1, 0, 4), 30), ("arrive", 1, 3, (0, 0, 3), 12), ("tick", True, 0),
    ("arrive", 2, 2, (2, 1, 2), 7), ("tick", True, 0), ("tick", False, 0b101), ("advance", 0.06),
    ("tick", True, 0), ("remove", 3), ("arrive", 0, 4, (0, 1, 5), 64), ("tick", True, 0xFFFF),
    ("tick", True, 0), ("advance", 0.06), ("tick", True, 0),
]


@pytest.mark.parametrize("path", PLANS, ids=[p.stem for p in PLANS])
def test_every_worker_of_a_generated_plan_schedules_a_trace(path):
    try:
        plan = load_plan(path, verify=False)
    except PlanError as error:
        pytest.skip(f"plan does not load: {error}")
    for worker in plan.workers:
        probe = WorkerScheduler(worker, plan.deployment, lambda: 0.0)
        # Keys this worker follows under TP are never composed here: arrivals go to led keys.
        led = [key.name for key in worker.keys if not probe.is_follower_of(key.node, key.walks[0])]
        if not led:
            continue
        logs = []
        for make in (WorkerScheduler, BaselineScheduler):
            runner = Runner(make, worker, plan.deployment, arrival_keys=led)
            run_ops(runner, TRACE)
            runner.drain()
            logs.append(runner.log)
        assert logs[0] == logs[1]
