"""A step's life on the host: a scheduler's batch becomes a `Step`, and a launch record follows it.

In: a `Batch`, the conductor (each row's inputs), the plan's keys. Out:

    to_step(conductor, keys, rank, batch) -> (Step or None, continuing rows, laned rows)
        stale rows are left out (None when none is left); when that removes a walk, the step
        takes the mixture entry of the walks left and runs eagerly (`recompose`)
    follower_step(rank, batch)  the row-less copy of a leader's step a TP follower runs
    sub_batch(batch, is_kept)   the flagged rows of a batch, as a batch of the same step
    Launch                      what the run loop keeps of a launched step until post-process
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Callable, Optional

from mstar.plan.schema import KeyPlan
from mstar.runtime.conductor.conductor import Conductor
from mstar.runtime.conductor.lanes import LaneRows
from mstar.runtime.scheduler.batch import Batch
from mstar.runtime.step import Step, StepResult, StepRow


@dataclass
class Launch:
    worker: int
    batch: Batch
    step: Optional[Step]  # None for a TP follower's copy of its leader's step
    result: StepResult
    start_s: float
    sched_s: float
    continuing: set[str] = field(default_factory=set)  # rows a speculation already covers
    ran_rows: list[StepRow] = field(default_factory=list)  # rows of the step the engine ran
    lane_rows: Optional[LaneRows] = None  # the step's laned rows (Conductor.build_step), for its post-process
    # host seconds of the run loop around the engine: its launch call with what follows it before
    # the wait (the speculation and the launch of step N+1 ahead), and the wait for the step
    launch_s: float = 0.0
    wait_s: float = 0.0


def to_step(conductor: Conductor, keys: dict[tuple[int, str], KeyPlan], rank: int,
            batch: Batch) -> tuple[Optional[Step], list[str], Optional[LaneRows]]:
    """The batch as a Step (stale rows left out; None when none is left), the rows whose loop
    goes on after this step, and the step's laned rows (Conductor.build_step)."""
    rows, continuing, lane_rows = conductor.build_step(batch.node, batch.request_ids, batch.walks, batch.num_tokens)
    if not rows:
        return None, continuing, None
    step = Step(
        worker=rank, key=batch.key, node=batch.node, mask=batch.mask, label=batch.label, rows=rows,
        attention=batch.attention, capture=batch.capture, padded_batch=batch.padded_batch,
        token_bucket=batch.token_bucket, is_speculative=batch.is_speculative, is_guided=batch.is_guided,
    )
    if len(rows) != batch.num_rows:
        recompose(keys[(rank, step.key)], step, conductor.requires_guidance)
    return step, continuing, lane_rows


def recompose(key: KeyPlan, step: Step,
              requires_guidance: Optional[Callable[[str, str], bool]] = None) -> None:
    """Stale rows were left out: when that removed a walk from the step, take the mixture
    entry of the walks left and run eagerly (the batch's capture no longer applies); when it
    left a guided step without a row that requires guidance, the step is unguided and runs
    eagerly unless its capture serves both modes. `requires_guidance(request id, node)`: the
    plan's rule for a row (None: the step keeps its mode)."""
    if step.is_guided and requires_guidance is not None and not any(
            requires_guidance(row.request_id, step.node) for row in step.rows):
        step.is_guided = False
        family = next((f for f in key.captures if f.name == step.capture), None)
        if family is not None and family.guidance != "any":
            step.capture, step.padded_batch, step.token_bucket = None, 0, 0
    mask = 0
    for row in step.rows:
        mask |= 1 << key.walks.index(row.walk)
    if mask == step.mask:
        return  # same walks, fewer rows: the padded bucket still holds them
    entry = next(e for e in key.mixtures if e.mask == mask)
    step.mask, step.label, step.attention = mask, entry.label, entry.attention
    step.capture, step.padded_batch, step.token_bucket = None, 0, 0


def follower_step(rank: int, batch: Batch) -> Step:
    return Step(
        worker=rank, key=batch.key, node=batch.node, mask=batch.mask, label=batch.label, rows=[],
        attention=batch.attention, capture=batch.capture, padded_batch=batch.padded_batch,
        token_bucket=batch.token_bucket, is_guided=batch.is_guided,
    )


def sub_batch(batch: Batch, is_kept: list[bool]) -> Batch:
    """The rows of `batch` flagged in `is_kept` (per row, in order), as a batch of the same step."""
    return dataclasses.replace(
        batch,
        request_ids=[rid for rid, keep in zip(batch.request_ids, is_kept) if keep],
        walks=[walk for walk, keep in zip(batch.walks, is_kept) if keep],
        num_tokens=[num for num, keep in zip(batch.num_tokens, is_kept) if keep],
    )
