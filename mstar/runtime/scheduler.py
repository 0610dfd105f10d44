"""Per-worker scheduler: ready rows per scheduling key -> one `Batch` per step.

A row is one request's readiness at one (node, walk) on this worker. The scheduler keeps ready
rows per scheduling key (WorkerPlan.walk_to_key), composes steps with the FIFO batch builder
under the plan's caps and rows limits, chooses among keys least-recently-run first, builds
speculative steps for on-device loops, holds rows after out-of-memory failures and runs a TP
leader's batches on followers. It only looks things up in the plan's tables; it touches no
tensors. docs/runtime.md "## Scheduler" describes each behaviour.

How the conductor drives it (one worker):

    sched = WorkerScheduler(plan.workers[rank], plan.deployment, clock=time.monotonic)
    sched.add_ready(rid, "LLM", "prefill", num_tokens=len(prompt))   # a row became ready
    batch = sched.next_batch()                 # None: nothing can run now
    ... engine.run_step(step built from batch) ...
    spec = sched.speculate(batch)              # while it runs: step N+1 of an on-device loop, or None
    # after the step: rows that are ready again come back through add_ready / add_ready_many,
    # except rows already scheduled in `spec`;
    # allocation_failed ids -> sched.hold(batch, ids); a built batch that will not run -> discard.
"""
from __future__ import annotations

import time
from typing import Callable, Optional, Sequence, Union

from mstar.plan.schema import DeploymentPlan, WorkerPlan
from mstar.runtime.batch import Batch

#: Out-of-memory backoff: held rows are invisible to the builder for this long.
HOLD_BACKOFF_S = 0.05


class SchedulerError(Exception):
    """A misuse of the scheduler or a broken invariant; the message names the row or key."""


class LostRowError(SchedulerError):
    """The batch builder failed to hand back a row it was given (scheduled, backlog or returned)."""


class UnknownPlacementError(SchedulerError):
    """A row names a (node, walk) this worker does not run."""


class DuplicateRowError(SchedulerError):
    """A row was added while the same request already has a ready or held row under that key."""


class WorkerScheduler:
    """Scheduler of one worker (rank) of a plan.

    worker:     the plan's WorkerPlan for this rank (keys, mixtures, caps, buckets, speculation,
                TP groups).
    deployment: the plan's DeploymentPlan (max_consecutive_follower_batches).
    clock:      seconds, monotonic; injected so tests and the simulated engine control holds.
    """

    def __init__(
        self,
        worker: WorkerPlan,
        deployment: DeploymentPlan,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        raise NotImplementedError("scheduler under construction")

    # ------------------------------------------------------------ rows in

    def add_ready(self, request_id: str, node: str, walk: str, num_tokens: int = 1) -> None:
        """A row became ready: `request_id` can run `walk` on `node` with `num_tokens` tokens.

        Raises UnknownPlacementError when this worker does not run (node, walk), and
        DuplicateRowError when the request already has a ready or held row under that key.
        Rows of a request removed with `remove` are dropped (pending removal).
        """
        raise NotImplementedError

    def add_ready_many(
        self,
        request_ids: Sequence[str],
        node: str,
        walk: str,
        num_tokens: Union[int, Sequence[int]] = 1,
    ) -> None:
        """Many rows of one (node, walk) became ready, in this order (e.g. a decode step's
        continuing rows). `num_tokens` is one count for all or one per row. Same errors as
        `add_ready`. Costs no per-row Python work beyond C-level list and set operations."""
        raise NotImplementedError

    # ------------------------------------------------------------ steps out

    def next_batch(self) -> Optional[Batch]:
        """Compose the next step, or None when nothing can run now.

        Order: expire holds; the head TP follower batch when all its rows are ready (at most
        deployment.max_consecutive_follower_batches in a row while local work waits); else the
        least-recently-run key with ready rows, composed by the FIFO builder. The rows chosen
        leave the ready queues (they are in flight until the conductor adds them back)."""
        raise NotImplementedError

    def speculate(
        self, running: Batch, continuing: Optional[Sequence[str]] = None
    ) -> Optional[Batch]:
        """Step N+1 of an on-device loop, built while `running` (step N) runs; None = do not
        speculate (build with `next_batch` after N's results instead).

        continuing: the rows of `running` that will run the loop again (None = every row of
        running's speculating walk); rows of removed requests are dropped. Speculation applies
        when the plan's SpeculationPlan for (node, walk) says can_speculate. The chain stays on
        its own walk and merges fresh rows of that walk up to the cap. It yields (None) when any
        other locally ready work would be left waiting: a row of another walk of the same key
        (with speculation_mixes_walks on, such rows are merged instead and it yields only if
        some cannot fit), a fresh row of its own walk pushed out by the cap, a ready row of
        another key, or a TP follower batch. The continuing rows are in the returned batch;
        the conductor must not add them back after step N."""
        raise NotImplementedError

    # ------------------------------------------------------------ failures

    def hold(
        self,
        batch: Batch,
        request_ids: Optional[Sequence[str]] = None,
        seconds: float = HOLD_BACKOFF_S,
    ) -> None:
        """`batch` failed out of memory and nothing ran: every row goes back to its ready queue;
        the rows named by `request_ids` (every row when None) are held for `seconds` first."""
        raise NotImplementedError

    def discard(self, batch: Batch) -> None:
        """A built batch will not run (e.g. a speculation whose source step failed): its rows
        go back to their ready queues, except rows already ready or held under that key."""
        raise NotImplementedError

    def remove(self, request_id: str) -> None:
        """Pending removal: drop the request's ready and held rows; it is never scheduled again
        (later rows for it are dropped, and speculation leaves it out)."""
        raise NotImplementedError

    # ------------------------------------------------------------ TP

    def register_follow(self, leader_batch: Batch) -> None:
        """This worker is a TP follower of `leader_batch`'s node: queue the leader's batch. Queued
        batches run in order, each with all its rows or not at all (the follower waits until
        every row is ready here)."""
        raise NotImplementedError

    def is_follower_of(self, node: str, walk: str) -> bool:
        """True when this worker runs (node, walk) only as a TP follower (never composes it)."""
        raise NotImplementedError

    # ------------------------------------------------------------ state

    def num_ready(self) -> int:
        """Rows ready now (held rows excluded)."""
        raise NotImplementedError

    def num_held(self) -> int:
        raise NotImplementedError

    def next_hold_deadline(self) -> Optional[float]:
        """Clock time when the earliest hold expires; None when nothing is held."""
        raise NotImplementedError

    def is_idle(self) -> bool:
        """Nothing ready, held or queued to follow."""
        raise NotImplementedError
