"""What ran of a step whose rows could not all get memory, and what goes back to the scheduler.

In: the batch, its step, the engine's `StepResult` and whether the engine runs partial steps
(`EngineCaps.runs_partial_steps`). Two modes:
- partial (the torch and simulated engines' default): the rows that got memory ran and are
  post-processed as usual; only the `allocation_failed` rows are held (50 ms backoff) and retried;
- all or nothing: nothing of the step ran; the whole batch goes back, the failed rows held, and
  rows the engine failed alone still fail.
Either way nothing is lost or run twice, and failed rows are neither speculated on nor followed.

    ran_part(batch, step, result, runs_partial) -> (rows that ran, batch the TP followers run or None)
    settle(scheduler, conductor, launch, runs_partial)   hand the step's outcome back
"""
from __future__ import annotations

from typing import Optional

from mstar.runtime.conductor.conductor import Conductor
from mstar.runtime.scheduler.batch import Batch
from mstar.runtime.scheduler.scheduler import WorkerScheduler
from mstar.runtime.serve.steps import Launch, sub_batch
from mstar.runtime.step import Step, StepResult, StepRow


def ran_part(batch: Batch, step: Step, result: StepResult,
             runs_partial: bool) -> tuple[list[StepRow], Optional[Batch]]:
    failed = result.allocation_failed
    if not failed:
        return step.rows, batch
    if not runs_partial:
        return [], None
    failed_set = set(failed)
    ran_rows = [row for row in step.rows if row.request_id not in failed_set]
    if not ran_rows:
        return [], None
    return ran_rows, sub_batch(batch, [rid not in failed_set for rid in batch.request_ids])


def settle(scheduler: WorkerScheduler, conductor: Conductor, launch: Launch, runs_partial: bool) -> None:
    batch, step, result = launch.batch, launch.step, launch.result
    assert step is not None  # a follower's copy has no outcome of its own
    failed = result.allocation_failed
    if not failed:
        conductor.on_step(step.node, step.rows, result.rows, result.token_ids, result.stop_rows, launch.lane_rows)
    elif runs_partial:
        failed_set = set(failed)
        scheduler.hold(sub_batch(batch, [rid in failed_set for rid in batch.request_ids]))
        conductor.on_step(step.node, launch.ran_rows, result.rows)
    else:
        scheduler.hold(batch, failed)  # nothing ran: every row goes back, the failed ones held
        for row_result in result.rows:  # rows that failed alone still fail (nothing else ran)
            if row_result.error is not None:
                conductor.fail(row_result.request_id, f"error: {row_result.error}")
