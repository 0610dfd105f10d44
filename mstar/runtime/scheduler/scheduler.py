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
    # allocation_failed ids -> sched.hold(batch, ids); a built batch that will not run -> discard;
    # an ended request -> sched.remove(rid), after the round's add_ready calls.

One step at a time: a batch comes back (hold, discard, speculate's running step) only while it
is one of the last two built on this worker (step N and its speculative N+1); `remove` relies
on it to keep its memory bounded.
"""
from __future__ import annotations

import math
import time
from itertools import compress
from typing import Callable, Hashable, Optional, Sequence, Union

from mstar.plan.schema import DeploymentPlan, SpeculationPlan, WorkerPlan
from mstar.runtime.scheduler.batch import Batch
from mstar.runtime.scheduler.batch_builder import compose, make_batch
from mstar.runtime.scheduler.batch_rules import pick_rule_rows
from mstar.runtime.scheduler.holds import Holds
from mstar.runtime.scheduler.key_tables import KeyTables
from mstar.runtime.scheduler.ready_queues import KeyQueue
from mstar.runtime.scheduler.errors import (
    DuplicateRowError,
    LostRowError,
    SchedulerError,
    UnknownPlacementError,
)
from mstar.runtime.scheduler.speculation import ChainStep, plan_chain_step
from mstar.runtime.scheduler.token_budget import fit_if_limited, with_chunks
from mstar.runtime.scheduler.tp_follow import FollowQueue, rows_by_walk

__all__ = [
    "HOLD_BACKOFF_S",
    "DuplicateRowError",
    "LostRowError",
    "SchedulerError",
    "UnknownPlacementError",
    "WorkerScheduler",
]

#: Out-of-memory backoff: held rows are invisible to the builder for this long.
HOLD_BACKOFF_S = 0.05


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
        self.rank = worker.rank
        self._clock = clock
        followed = {
            (group.node, walk)
            for group in worker.tp_groups
            if group.leader != worker.rank
            for walk in group.walks
        }
        self._tables: list[KeyTables] = []
        self._queues: list[KeyQueue] = []
        self._specs: list[list[Optional[SpeculationPlan]]] = []
        self._key_index: dict[str, int] = {}
        spec_by_pair = {(spec.node, spec.walk): spec for spec in worker.speculation}
        for index, key in enumerate(worker.keys):
            is_followed = any((key.node, walk) in followed for walk in key.walks)
            tables = KeyTables.from_plan(index, key, is_followed)
            self._tables.append(tables)
            self._queues.append(KeyQueue(key.name, tables.walks))
            self._specs.append([spec_by_pair.get((key.node, walk)) for walk in key.walks])
            self._key_index[key.name] = index
        # (node, walk) -> (key index, walk index), only for pairs this worker runs.
        self._placement: dict[tuple[str, str], tuple[int, int]] = {}
        for pair in worker.placements:
            key_name = worker.walk_to_key.get(pair)
            if key_name is None or key_name not in self._key_index:
                raise UnknownPlacementError(f"worker {worker.rank}: placement {pair} has no scheduling key")
            key_at = self._key_index[key_name]
            node, walk = pair.split("/", 1)
            if walk not in self._tables[key_at].walk_index:
                raise UnknownPlacementError(f"worker {worker.rank}: walk {walk} of {pair} is not in key {key_name}")
            self._placement[(node, walk)] = (key_at, self._tables[key_at].walk_index[walk])
        self._led = [i for i, tables in enumerate(self._tables) if not tables.is_followed]
        self._last_run = [0] * len(self._tables)  # step number of each key's last step (0 = never)
        self._num_steps = 0
        self._next_seq = 0
        self._holds = Holds()
        self._follow = FollowQueue(deployment.max_consecutive_follower_batches)
        # Removal tombstones, kept only as long as a batch the caller may still hand back names
        # the request (see `remove`): the caller runs one step at a time per worker, so only the
        # last two batches built (step N and the speculative N+1) can come back through `hold`,
        # `discard` or `speculate`. `_removed` holds the tombstones in force; `_removed_newer`
        # those named by the newest batch, which outlive the next build. The window keeps the
        # two batches' request id lists, not the batches: holding a batch's other lists alive
        # for two more steps measured 1-2% slower per decode step (mstar bench scheduler).
        self._removed: set[str] = set()
        self._removed_newer: set[str] = set()
        self._older_ids: Optional[list[str]] = None
        self._newer_ids: Optional[list[str]] = None
        # per key: request id -> batch class of its ready row of a walk with batching rules (one
        # row per request and key; the entry is replaced when its next row arrives)
        self._classes: list[dict[str, Hashable]] = [{} for _ in self._tables]
        # per key whose captures are keyed by guidance mode: the requests with a ready row there that
        # require guidance on the node (a request's need does not change while it lives)
        self._guided: list[set[str]] = [set() for _ in self._tables]

    # ------------------------------------------------------------ rows in

    def add_ready(self, request_id: str, node: str, walk: str, num_tokens: int = 1) -> None:
        """A row became ready: `request_id` can run `walk` on `node` with `num_tokens` tokens.

        Raises UnknownPlacementError when this worker does not run (node, walk), and
        DuplicateRowError when the request already has a ready or held row under that key.
        Rows of a request removed with `remove` are dropped while its tombstone lasts (see
        `remove`), unless a queued TP leader batch still names the request.
        """
        self.add_ready_many([request_id], node, walk, num_tokens)

    def add_ready_many(
        self,
        request_ids: Sequence[str],
        node: str,
        walk: str,
        num_tokens: Union[int, Sequence[int]] = 1,
        classes: Optional[Sequence[Hashable]] = None,
        guided: Optional[Sequence[bool]] = None,
        contexts: Optional[Sequence[int]] = None,
    ) -> None:
        """Many rows of one (node, walk) became ready, in this order (e.g. a decode step's
        continuing rows). `num_tokens` is one count for all or one per row. `classes`: one batch
        class per row for a walk with batching rules (rows share a step only with rows of an
        equal class; see batch_rules.py), else None. `guided`: per row, whether its request requires
        guidance on the node (plan/guidance_mode.py), for a key whose captures are keyed by guidance
        mode (a step replays a family of its own mode); None = no row does. `contexts`: per row
        of a walk whose prompts are cut, the tokens of its KV before the tokens it feeds (a step
        budget that counts context weights its chunks by them, token_budget.py); None = 0. Same
        errors as `add_ready`. Costs no per-row Python work beyond C-level list and set operations."""
        placement = self._placement.get((node, walk))
        if placement is None:
            raise UnknownPlacementError(f"worker {self.rank} does not run walk {walk} of node {node}")
        key, walk_index = placement
        count = len(request_ids)
        if isinstance(num_tokens, int):
            tokens = [num_tokens] * count
        else:
            tokens = list(num_tokens)
            if len(tokens) != count:
                raise SchedulerError(f"{count} rows of {node}/{walk} but {len(tokens)} token counts")
        if self._removed and not self._removed.isdisjoint(request_ids):
            kept = [i for i, rid in enumerate(request_ids) if rid not in self._removed or self._follow.names(rid)]
            request_ids = [request_ids[i] for i in kept]
            tokens = [tokens[i] for i in kept]
            if classes is not None:
                classes = [classes[i] for i in kept]  # stay aligned with the rows kept
            if guided is not None:
                guided = [guided[i] for i in kept]
            if contexts is not None:
                contexts = [contexts[i] for i in kept]
            count = len(request_ids)
        queue = self._queues[key]
        queue.add(walk_index, request_ids, self._next_seq, tokens, is_new=True)
        self._next_seq += count
        if contexts is not None and self._tables[key].context_scale:
            queue.contexts.update(zip(request_ids, contexts))
        if classes is not None:
            self._classes[key].update(zip(request_ids, classes))
        if guided is not None and self._tables[key].is_guidance_keyed:
            self._guided[key].update(compress(request_ids, guided))

    # ------------------------------------------------------------ steps out

    def next_batch(self) -> Optional[Batch]:
        """Compose the next step, or None when nothing can run now.

        Order: expire holds; the head TP follower batch when all its rows are ready (at most
        deployment.max_consecutive_follower_batches in a row while local work waits); else the
        least-recently-run key with ready rows, composed by the FIFO builder. The rows chosen
        leave the ready queues (they are in flight until the conductor adds them back)."""
        if self._holds:
            self._expire_holds()
        if self._follow:
            batch = self._try_follow()
            if batch is not None:
                return batch
        self._follow.num_consecutive = 0
        queues = self._queues
        candidates = [key for key in self._led if queues[key].num_ready]
        if len(candidates) > 1:
            candidates.sort(key=self._last_run.__getitem__)  # stable: ties keep the plan's key order
        for key in candidates:
            tables, queue = self._tables[key], queues[key]
            if tables.has_rules:
                picked = pick_rule_rows(tables, queue, self._classes[key])
                if picked is None:
                    continue
                walk, request_ids = picked
                parts = [(walk, request_ids, queue.take_rows(walk, request_ids))]
                return self._built(key, make_batch(self.rank, tables, 1 << walk, parts, guided=self._guided[key]))
            fit = fit_if_limited(tables, queue, compose(tables, queue))
            composition, chunks = fit.composition, fit.chunks
            if composition.num_rows == 0:
                continue
            parts = queue.take(composition.takes)
            if chunks is not None:
                parts = with_chunks(parts, chunks)
            return self._built(key, make_batch(self.rank, tables, composition.mask, parts, guided=self._guided[key]))
        return None

    def speculate(
        self,
        running: Batch,
        continuing: Optional[Sequence[str]] = None,
        num_tokens: Union[int, Sequence[int]] = 1,
        cut: Sequence[tuple[str, int]] = (),
    ) -> Optional[Batch]:
        """Step N+1 of an on-device loop, built while `running` (step N) runs; None = do not
        speculate (build with `next_batch` after N's results instead).

        continuing: the rows of `running` that will run the loop again (None = every row of
        running's speculating walk); rows of removed requests are dropped. num_tokens: tokens
        each continuing row feeds (one count or one per continuing row). Speculation applies
        when the plan's SpeculationPlan for (node, walk) says can_speculate. The chain stays on
        its own walk and merges fresh rows of that walk up to the cap. It yields (None) when any
        other locally ready work would be left waiting: a row of another walk of the same key
        (with speculation_mixes_walks on, such rows are merged instead and it yields only if
        some cannot fit), a fresh row of its own walk pushed out by the cap, a ready row of
        another key, or a TP follower batch. A key with batching rules never speculates (its
        steps group rows by class when built). The continuing rows are in the returned batch;
        the conductor must not add them back after step N. cut: (request id, tokens left after
        N) of running's prompt rows cut in N with chunks left (StepRow.is_partial): past a chunk
        step the chain goes on only when every prompt row of N is one of them, and they continue
        with their next chunks (speculation.py); like continuing rows they are in the batch and
        must not be added back after N."""
        key = self._key_index.get(running.key)
        if key is None:
            raise UnknownPlacementError(f"worker {self.rank} has no key {running.key}")
        if self._holds:
            self._expire_holds()
        if not isinstance(num_tokens, int) and continuing is not None and len(num_tokens) != len(continuing):
            raise SchedulerError(f"{len(continuing)} continuing rows but {len(num_tokens)} token counts")
        queues = self._queues
        is_other_work_waiting = bool(self._follow) or any(
            queues[other].num_ready for other in self._led if other != key
        )
        tables, queue = self._tables[key], queues[key]
        if tables.has_rules:
            return None  # rows of a walk with batching rules are grouped by class when built
        chain = plan_chain_step(
            tables, queue, self._specs[key], running, continuing, num_tokens,
            self._removed, is_other_work_waiting, cut,
        )
        if chain is None:
            return None
        parts = _chain_parts(queue, chain)
        queue.contexts.update(chain.cut_contexts)  # past N's chunks: what N+1's rows attend over
        self._follow.num_consecutive = 0
        return self._built(key, make_batch(self.rank, tables, chain.composition.mask, parts, is_speculative=True,
                                           guided=self._guided[key]))

    # ------------------------------------------------------------ failures

    def hold(
        self,
        batch: Batch,
        request_ids: Optional[Sequence[str]] = None,
        seconds: float = HOLD_BACKOFF_S,
    ) -> None:
        """`batch` failed out of memory and nothing ran: every row goes back to its ready queue;
        the rows named by `request_ids` (every row when None) are held for `seconds` first.
        Rows of removed requests are dropped. Held rows keep their place in the key (a second
        row for the same request is a DuplicateRowError) but are not considered until the hold
        expires; then they rejoin the end of their ready queue."""
        key = self._batch_key(batch)
        named = set(batch.request_ids) if request_ids is None else set(request_ids)
        deadline = self._clock() + seconds
        queue = self._queues[key]
        for walk, rows, tokens in self._walk_runs(key, batch):
            kept = [i for i, rid in enumerate(rows) if rid not in self._removed or self._follow.names(rid)]
            held = [i for i in kept if rows[i] in named]
            back = [i for i in kept if rows[i] not in named]
            if back:
                queue.add(walk, [rows[i] for i in back], self._next_seq, [tokens[i] for i in back], is_new=True)
                self._next_seq += len(back)
            if held:
                held_ids = [rows[i] for i in held]
                if not queue.present.isdisjoint(held_ids):
                    dup = next(rid for rid in held_ids if rid in queue.present)
                    raise DuplicateRowError(f"request {dup!r} already has a ready or held row under key {queue.name}")
                queue.present.update(held_ids)
                queue.held.update(held_ids)
                self._holds.add(deadline, key, walk, held_ids, [tokens[i] for i in held])

    def discard(self, batch: Batch) -> None:
        """A built batch will not run (e.g. a speculation whose source step failed): its rows
        go back to their ready queues, except rows already ready or held under that key and
        rows of removed requests."""
        key = self._batch_key(batch)
        queue = self._queues[key]
        for walk, rows, tokens in self._walk_runs(key, batch):
            back = [
                i for i, rid in enumerate(rows)
                if rid not in queue.present and (rid not in self._removed or self._follow.names(rid))
            ]
            if back:
                queue.add(walk, [rows[i] for i in back], self._next_seq, [tokens[i] for i in back], is_new=True)
                self._next_seq += len(back)

    def remove(self, request_id: str) -> None:
        """Pending removal: drop the request's ready and held rows; it is never scheduled again.
        On a TP follower, rows that a queued leader batch names stay: the leader has already run
        or committed them.

        Rows of the request may still come back inside a batch built before the removal (`hold`
        after its step failed, `discard`, `speculate` on it as the running step): those are
        dropped. The caller runs one step at a time per worker (the driver's loop), so only the
        last two batches built - step N and the speculative N+1 - can come back; the request is
        remembered (a tombstone) only when one of them names it, and forgotten once both have
        left that window, so memory stays bounded by the rows of two steps however many
        requests come and go. Rows the caller adds for the request after its removal
        (`add_ready`) are dropped while the tombstone lasts; the conductor emits none (an ended
        request has no rows to give, and the driver adds a round's ready rows before removing
        its ended requests)."""
        newer, older = self._newer_ids, self._older_ids
        if newer is not None and request_id in newer:
            self._removed.add(request_id)
            self._removed_newer.add(request_id)
        elif older is not None and request_id in older:
            self._removed.add(request_id)
        for classes in self._classes:
            classes.pop(request_id, None)
        for guided in self._guided:
            guided.discard(request_id)
        is_named = self._follow.names(request_id)
        for key, queue in enumerate(self._queues):
            queue.contexts.pop(request_id, None)
            if request_id in queue.present and not (is_named and self._tables[key].is_followed):
                queue.drop_request(request_id)
        for key in self._holds.drop_request(request_id):
            queue = self._queues[key]
            queue.held.discard(request_id)
            queue.present.discard(request_id)

    # ------------------------------------------------------------ TP

    def register_follow(self, leader_batch: Batch) -> None:
        """This worker is a TP follower of `leader_batch`'s node: queue the leader's batch. Queued
        batches run in order, each with all its rows or not at all (the follower waits until
        every row is ready here)."""
        key = self._batch_key(leader_batch)
        if not self._tables[key].is_followed:
            raise SchedulerError(f"worker {self.rank} leads key {leader_batch.key}; it cannot follow it")
        self._follow.push(leader_batch)

    def is_follower_of(self, node: str, walk: str) -> bool:
        """True when this worker runs (node, walk) only as a TP follower (never composes it)."""
        placement = self._placement.get((node, walk))
        return placement is not None and self._tables[placement[0]].is_followed

    # ------------------------------------------------------------ state

    def num_ready(self) -> int:
        """Rows ready now (held rows excluded)."""
        return sum(queue.num_ready for queue in self._queues)

    def num_held(self) -> int:
        return self._holds.num_rows

    def num_follow_queued(self) -> int:
        """Leader batches waiting to run on this follower."""
        return len(self._follow)

    def next_hold_deadline(self) -> Optional[float]:
        """Clock time when the earliest hold expires; None when nothing is held."""
        return self._holds.next_deadline()

    def is_idle(self) -> bool:
        """Nothing ready, held or queued to follow."""
        return not self._follow and not self._holds and self.num_ready() == 0

    def holds_tombstone(self, request_id: str) -> bool:
        """Whether a removal tombstone of `request_id` is in force: a new request under that id
        would have its rows dropped as the ended one's (it stalled)."""
        return request_id in self._removed

    def num_tracked(self) -> dict[str, int]:
        """How many request ids each per-request structure holds: `present` (requests with a
        ready or held row, summed over keys), `classes` (batch classes of rows of walks with
        batching rules), `guided` (requests that require guidance, on keys whose captures are keyed
        by it), `removed` (removal tombstones), `follow` (requests named by queued
        leader batches), `contexts` (KV depths of requests whose prompts were cut, on keys whose
        budget counts context; kept until the request is removed). Each is bounded by the
        requests with rows ready, held, queued to follow or in the last two steps, or (contexts)
        active; none grows with the requests that came and went."""
        return {
            "present": sum(len(queue.present) for queue in self._queues),
            "classes": sum(map(len, self._classes)),
            "guided": sum(map(len, self._guided)),
            "removed": len(self._removed),
            "follow": self._follow.num_named(),
            "contexts": sum(len(queue.contexts) for queue in self._queues),
        }

    # ------------------------------------------------------------ internals

    def _built(self, key: int, batch: Batch) -> Batch:
        """Every batch handed out passes here: the key's least-recently-run record, and the window
        of batches that may still come back (`remove`), in which the removal tombstones of the
        batch leaving it expire."""
        self._num_steps += 1
        self._last_run[key] = self._num_steps
        self._older_ids = self._newer_ids
        self._newer_ids = batch.request_ids
        if self._removed:
            self._removed = self._removed_newer
            self._removed_newer = set()
        return batch

    def _batch_key(self, batch: Batch) -> int:
        key = self._key_index.get(batch.key)
        if key is None:
            raise UnknownPlacementError(f"worker {self.rank} has no key {batch.key}")
        return key

    def _walk_runs(self, key: int, batch: Batch):
        """Yield (walk index, request ids, tokens) per run of consecutive same-walk rows."""
        walk_index = self._tables[key].walk_index
        start = 0
        walks = batch.walks
        for end in range(1, len(walks) + 1):
            if end == len(walks) or walks[end] != walks[start]:
                if walks[start] not in walk_index:
                    raise UnknownPlacementError(f"walk {walks[start]} is not in key {batch.key}")
                yield walk_index[walks[start]], batch.request_ids[start:end], batch.num_tokens[start:end]
                start = end

    def wake_holds(self) -> None:
        """Memory came back (a request ended and freed its pages): every held row rejoins the end of
        its ready queue now, as at its hold's deadline, rather than waiting out the backoff."""
        if self._holds:
            self._expire_holds(math.inf)

    def _expire_holds(self, now: Optional[float] = None) -> None:
        for hold in self._holds.pop_expired(self._clock() if now is None else now):
            queue = self._queues[hold.key]
            queue.held.difference_update(hold.request_ids)
            queue.add(hold.walk, hold.request_ids, self._next_seq, hold.tokens, is_new=False)
            self._next_seq += len(hold.request_ids)

    def _has_local_work(self) -> bool:
        queues = self._queues
        return any(queues[key].num_ready for key in self._led)

    def _try_follow(self) -> Optional[Batch]:
        """The head leader batch with all its rows taken, or None (waiting or deferred)."""
        head = self._follow.head()
        if head is None or self._follow.is_deferred(self._has_local_work()):
            return None
        key = self._batch_key(head)
        tables, queue = self._tables[key], self._queues[key]
        groups = [(tables.walk_index[walk], rows) for walk, rows in rows_by_walk(head).items()]
        if not all(queue.has_rows(walk, rows) for walk, rows in groups):
            return None
        for walk, rows in groups:
            queue.take_rows(walk, rows)
        self._follow.pop()
        self._follow.num_consecutive += 1
        return self._built(key, Batch(
            worker=self.rank,
            key=head.key,
            node=head.node,
            mask=head.mask,
            label=head.label,
            request_ids=list(head.request_ids),
            walks=list(head.walks),
            num_tokens=list(head.num_tokens),  # the leader's (a cut row's chunk, not its tokens left)
            capture=head.capture,
            padded_batch=head.padded_batch,
            token_bucket=head.token_bucket,
            attention=head.attention,
            is_follower=True,
            is_guided=head.is_guided,
        ))


def _chain_parts(queue: KeyQueue, chain: ChainStep) -> list[tuple[int, list[str], list[int]]]:
    """The (walk, ids, tokens) parts of a chain step, its fresh rows taken from the queue: the
    continuing rows lead their walk's part, the cut rows' next chunks are their walks' parts (those
    walks have no fresh rows: speculation.py); walks in key order."""
    parts = queue.take(chain.composition.takes)
    if chain.chunks is not None:
        parts = with_chunks(parts, chain.chunks)
    if chain.walk is not None:  # None: a chain of prompt chunks alone, no continuing rows
        fresh = next((part for part in parts if part[0] == chain.walk), None)
        if fresh is None:
            parts.append((chain.walk, chain.continuing, chain.continuing_tokens))
            parts.sort(key=lambda part: part[0])
        else:
            at = parts.index(fresh)
            parts[at] = (chain.walk, chain.continuing + fresh[1], chain.continuing_tokens + fresh[2])
    if chain.cut_parts:
        parts.extend(chain.cut_parts)
        parts.sort(key=lambda part: part[0])
    return parts
