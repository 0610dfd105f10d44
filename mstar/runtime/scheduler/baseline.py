"""A straightforward scheduler for the benchmark: the same decisions as WorkerScheduler, made
row by row without the plan's lookup tables.

It keeps one list of ready row objects, groups them by key on every step, recomputes a step's cap
by searching the key's mixtures for the set of walks present, pads by scanning bucket lists, and
decides each row in a Python loop. `mstar bench scheduler` measures it next to WorkerScheduler,
and tests/scheduler check that both produce identical batches on random traces. It is not used
to serve.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Optional, Sequence, Union

from mstar.plan.schema import DeploymentPlan, KeyPlan, WorkerPlan
from mstar.runtime.scheduler.batch import Batch
from mstar.runtime.scheduler.scheduler import HOLD_BACKOFF_S
from mstar.runtime.scheduler.token_budget import chunk_within
from mstar.runtime.scheduler.errors import DuplicateRowError, SchedulerError, UnknownPlacementError


@dataclass
class _Row:
    request_id: str
    key: str
    walk: str
    num_tokens: int
    seq: int
    context: int = 0  # KV tokens before the row's tokens (a cut row's depth, token_budget.py)


class BaselineScheduler:
    """Same API and decisions as mstar.runtime.scheduler.scheduler.WorkerScheduler, per-row Python."""

    def __init__(
        self, worker: WorkerPlan, deployment: DeploymentPlan, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.worker = worker
        self.rank = worker.rank
        self.max_follow = max(1, deployment.max_consecutive_follower_batches)
        self._clock = clock
        self.ready: list[_Row] = []
        self.placed: dict[tuple[str, str], _Row] = {}  # (request, key) -> its ready or held row
        self.holds: list[tuple[float, int, list[_Row]]] = []
        self.num_holds_made = 0
        self.removed: set[str] = set()
        self.guided_ids: set[str] = set()  # requests that require guidance (a step holding one is guided)
        self.follow: list[Batch] = []
        self.num_consecutive = 0
        self.last_run: dict[str, int] = {key.name: 0 for key in worker.keys}
        self.num_steps = 0
        self.next_seq = 0

    # ---------------------------------------------------------- plan questions, recomputed

    def _key(self, name: str) -> KeyPlan:
        for key in self.worker.keys:
            if key.name == name:
                return key
        raise UnknownPlacementError(f"worker {self.rank} has no key {name}")

    def _is_followed(self, key: KeyPlan) -> bool:
        return any(
            group.node == key.node and group.leader != self.rank and walk in group.walks
            for group in self.worker.tp_groups for walk in key.walks
        )

    def _entry(self, key: KeyPlan, walks: set[str]):
        for entry in key.mixtures:
            if set(entry.walks) == walks:
                return entry
        raise SchedulerError(f"key {key.name} has no mixture for {sorted(walks)}")

    def _spec(self, node: str, walk: str):
        for spec in self.worker.speculation:
            if spec.node == node and spec.walk == walk:
                return spec
        return None

    def _names_in_follow(self, request_id: str) -> bool:
        return any(request_id in batch.request_ids for batch in self.follow)

    # ---------------------------------------------------------- rows in

    def add_ready(self, request_id: str, node: str, walk: str, num_tokens: int = 1, context: int = 0) -> None:
        pair = f"{node}/{walk}"
        if pair not in self.worker.placements:
            raise UnknownPlacementError(f"worker {self.rank} does not run walk {walk} of node {node}")
        key = self.worker.walk_to_key[pair]
        if request_id in self.removed and not self._names_in_follow(request_id):
            return
        self._push(_Row(request_id, key, walk, num_tokens, 0, context))

    def add_ready_many(
        self, request_ids: Sequence[str], node: str, walk: str, num_tokens: Union[int, Sequence[int]] = 1,
        guided: Optional[Sequence[bool]] = None, contexts: Optional[Sequence[int]] = None,
    ) -> None:
        tokens = [num_tokens] * len(request_ids) if isinstance(num_tokens, int) else list(num_tokens)
        for i, (rid, count) in enumerate(zip(request_ids, tokens)):
            if guided is not None and guided[i]:
                self.guided_ids.add(rid)
            self.add_ready(rid, node, walk, count, contexts[i] if contexts is not None else 0)

    def _push(self, row: _Row) -> None:
        if (row.request_id, row.key) in self.placed:
            raise DuplicateRowError(f"request {row.request_id!r} already has a row under key {row.key}")
        self.placed[(row.request_id, row.key)] = row
        row.seq = self.next_seq
        self.next_seq += 1
        self.ready.append(row)

    # ---------------------------------------------------------- steps out

    def next_batch(self) -> Optional[Batch]:
        self._expire_holds()
        if self.follow:
            batch = self._try_follow()
            if batch is not None:
                return batch
        self.num_consecutive = 0
        order = [key.name for key in self.worker.keys]
        candidates = []
        for row in self.ready:
            key = self._key(row.key)
            if row.key not in candidates and not self._is_followed(key):
                candidates.append(row.key)
        candidates.sort(key=lambda name: (self.last_run[name], order.index(name)))
        for name in candidates:
            key = self._key(name)
            chosen, chunks = self._fit_budget(key, self._compose(key, [r for r in self.ready if r.key == name], []), [])
            if chosen:
                return self._finish(key, chosen, [], None, is_speculative=False, chunks=chunks)
        return None

    def _fit_budget(self, key: KeyPlan, chosen: list[_Row], already: list[_Row]) -> tuple[list[_Row], dict[str, int]]:
        """The step token budget, row by row: whole rows of walks never cut first (oldest first
        across those walks, a walk closed at its first row that does not fit; one too large for any
        step runs alone), then a chunk of each row of a cut walk while the budget lasts; a one-walk
        step keeps that walk's cap. Returns the rows kept and the chunk of each cut row."""
        if key.token_budget is None and not key.chunk_sizes:
            return chosen, {}
        left = (key.token_budget if key.token_budget is not None else 1 << 62) - sum(r.num_tokens for r in already)
        kept: list[_Row] = []
        chunks: dict[str, int] = {}
        closed: set[str] = set()
        for row in sorted((r for r in chosen if r.walk not in key.chunk_sizes), key=lambda r: r.seq):
            if row.walk in closed or left <= 0:
                continue
            if row.num_tokens <= left or (not already and not kept):
                kept.append(row)
                left -= row.num_tokens
            else:
                closed.add(row.walk)
        for walk in key.walks:
            size = key.chunk_sizes.get(walk)
            if size is None:
                continue
            for row in (row for row in chosen if row.walk == walk):
                if (cut := chunk_within(left, row.num_tokens, size, row.context, key.chunk_context_scale or 0))[0] > 0:
                    chunks[row.request_id] = cut[0]
                    kept.append(row)
                    left -= cut[1]
                else:
                    break
        walks = {row.walk for row in kept + already}
        if len(walks) == 1:
            kept = kept[:max(0, self._entry(key, walks).cap - len(already))]
        order = {id(row): i for i, row in enumerate(chosen)}
        return sorted(kept, key=lambda row: order[id(row)]), chunks

    def _compose(self, key: KeyPlan, rows: list[_Row], already: list[_Row]) -> list[_Row]:
        """Rows of `rows` (FIFO) that join a step already holding `already`."""
        present = {row.walk for row in already}
        counts = {walk: 0 for walk in key.walks}
        for row in already:
            counts[row.walk] += 1
        num_rows = len(already)
        closed: set[str] = set()
        chosen: list[_Row] = []
        for row in sorted(rows, key=lambda r: r.seq):
            if row.walk in closed:
                continue
            walks = present | {row.walk}
            cap = self._entry(key, walks).cap
            counts[row.walk] += 1
            fits = cap > num_rows
            if fits and len(walks) > 1:
                for walk in walks:
                    if walk in key.rows_limits and counts[walk] > key.rows_limits[walk]:
                        fits = False
            if fits:
                chosen.append(row)
                present = walks
                num_rows += 1
            else:
                counts[row.walk] -= 1
                closed.add(row.walk)
        return chosen

    def _finish(
        self, key: KeyPlan, chosen: list[_Row], first: list[_Row], first_walk: Optional[str], is_speculative: bool,
        chunks: Optional[dict[str, int]] = None,
    ) -> Batch:
        chunks = chunks or {}
        self._unready(chosen)
        self.num_steps += 1
        self.last_run[key.name] = self.num_steps
        rows: list[_Row] = []
        for walk in key.walks:
            if walk == first_walk:
                rows += first
            rows += [row for row in chosen if row.walk == walk]
        walks = {row.walk for row in rows}
        entry = self._entry(key, walks)
        capture, padded, bucket = None, 0, 0
        names = ([entry.capture] if entry.capture is not None else []) + entry.also_captures
        tokens = [chunks.get(row.request_id, row.num_tokens) for row in rows]
        is_keyed = any(f.guidance != "any" for f in key.captures)
        is_guided = is_keyed and any(row.request_id in self.guided_ids for row in rows)
        best: Optional[tuple[int, int]] = None
        for name in names:  # several: the smallest (tokens, padded batch) that holds the step
            family = next(f for f in key.captures if f.name == name)
            if family.guidance != "any" and family.guidance != ("guided" if is_guided else "unguided"):
                continue  # a family of the other guidance mode
            sizes = [s for s in family.batch_sizes if s >= len(rows)]
            buckets = [t for t in family.token_buckets if t >= sum(tokens)]
            if not sizes or (family.kind == "packed" and not buckets):
                continue
            if family.kind == "batched" and max(tokens) > family.tokens_per_row:
                continue  # a row past its tokens a row fits no graph of it (one family or several)
            size = min(buckets) if family.kind == "packed" else min(sizes) * family.tokens_per_row
            if best is None or (size, min(sizes)) < best:
                best = (size, min(sizes))
                capture, padded = family.name, min(sizes)
                bucket = min(buckets) if family.kind == "packed" else 0
        mask = sum(1 << key.walks.index(walk) for walk in walks)
        return Batch(
            worker=self.rank, key=key.name, node=key.node, mask=mask,
            label=rows[0].walk if len(walks) == 1 else None,
            request_ids=[row.request_id for row in rows], walks=[row.walk for row in rows],
            num_tokens=[chunks.get(row.request_id, row.num_tokens) for row in rows], capture=capture,
            padded_batch=padded,
            token_bucket=bucket, attention=entry.attention, is_speculative=is_speculative, is_guided=is_guided,
        )

    def speculate(
        self, running: Batch, continuing: Optional[Sequence[str]] = None,
        num_tokens: Union[int, Sequence[int]] = 1,
    ) -> Optional[Batch]:
        key = self._key(running.key)
        self._expire_holds()
        if running.is_follower or self._is_followed(key) or self.follow:
            return None
        if any(w in key.chunk_sizes for w in running.walks):
            return None  # the prompt's next chunk joins the step after this one
        for row in self.ready:
            if row.key != key.name and not self._is_followed(self._key(row.key)):
                return None
        walk = None
        for i, name in enumerate(key.walks):
            spec = self._spec(key.node, name)
            in_step = running.label == name if running.label is not None else running.mask >> i & 1
            if in_step and spec is not None and spec.can_speculate:
                walk = name
                break
        if walk is None:
            return None
        if continuing is None:
            ids = [rid for rid, w in zip(running.request_ids, running.walks) if w == walk]
        else:
            ids = list(continuing)
        tokens = [num_tokens] * len(ids) if isinstance(num_tokens, int) else list(num_tokens)
        walk_of = dict(zip(running.request_ids, running.walks))
        first = [
            _Row(rid, key.name, walk, t, -1) for rid, t in zip(ids, tokens)
            if rid not in self.removed and (running.label is not None or walk_of.get(rid) == walk)
        ]
        if not first or len(first) > self._entry(key, {walk}).cap:
            return None
        mine = [row for row in self.ready if row.key == key.name]
        if any(row.walk != walk for row in mine) and not self._spec(key.node, walk).mixes_walks:
            return None
        chosen, chunks = self._fit_budget(key, self._compose(key, mine, first), first)
        if len(chosen) < len(mine):
            return None
        self.num_consecutive = 0
        return self._finish(key, chosen, first, walk, is_speculative=True, chunks=chunks)

    # ---------------------------------------------------------- failures

    def hold(self, batch: Batch, request_ids: Optional[Sequence[str]] = None, seconds: float = HOLD_BACKOFF_S) -> None:
        named = set(batch.request_ids) if request_ids is None else set(request_ids)
        deadline = self._clock() + seconds
        by_walk: dict[str, list[_Row]] = {}
        for rid, walk, count in zip(batch.request_ids, batch.walks, batch.num_tokens):
            if rid in self.removed and not self._names_in_follow(rid):
                continue
            row = _Row(rid, batch.key, walk, count, 0)
            if rid in named:
                by_walk.setdefault(walk, []).append(row)
            else:
                self._push(row)
        for walk in [w for w in dict.fromkeys(batch.walks) if w in by_walk]:
            for row in by_walk[walk]:
                if (row.request_id, row.key) in self.placed:
                    raise DuplicateRowError(f"request {row.request_id!r} already has a row under key {row.key}")
                self.placed[(row.request_id, row.key)] = row
            self.holds.append((deadline, self.num_holds_made, by_walk[walk]))
            self.num_holds_made += 1

    def discard(self, batch: Batch) -> None:
        for rid, walk, count in zip(batch.request_ids, batch.walks, batch.num_tokens):
            if (rid, batch.key) not in self.placed and (rid not in self.removed or self._names_in_follow(rid)):
                self._push(_Row(rid, batch.key, walk, count, 0))

    def remove(self, request_id: str) -> None:
        self.removed.add(request_id)
        self.guided_ids.discard(request_id)
        named = self._names_in_follow(request_id)
        dropped = [
            row for row in self.ready
            if row.request_id == request_id and not (named and self._is_followed(self._key(row.key)))
        ]
        self._unready(dropped)
        for _, _, rows in self.holds:
            for row in rows:
                if row.request_id == request_id:
                    del self.placed[(row.request_id, row.key)]
            rows[:] = [row for row in rows if row.request_id != request_id]
        self.holds = [hold for hold in self.holds if hold[2]]

    def _unready(self, rows: list[_Row]) -> None:
        """Take rows out of the ready list (scheduled or dropped)."""
        gone = {id(row) for row in rows}
        self.ready = [row for row in self.ready if id(row) not in gone]
        for row in rows:
            del self.placed[(row.request_id, row.key)]

    def _expire_holds(self) -> None:
        now = self._clock()
        for hold in sorted(self.holds):
            if hold[0] <= now:
                self.holds.remove(hold)
                for row in hold[2]:
                    row.seq = self.next_seq
                    self.next_seq += 1
                    self.ready.append(row)

    # ---------------------------------------------------------- TP

    def register_follow(self, leader_batch: Batch) -> None:
        if not self._is_followed(self._key(leader_batch.key)):
            raise SchedulerError(f"worker {self.rank} leads key {leader_batch.key}; it cannot follow it")
        self.follow.append(leader_batch)

    def _try_follow(self) -> Optional[Batch]:
        head = self.follow[0]
        has_local = any(not self._is_followed(self._key(row.key)) for row in self.ready)
        if has_local and self.num_consecutive >= self.max_follow:
            return None
        found: list[_Row] = []
        for rid, walk in zip(head.request_ids, head.walks):
            match = [r for r in self.ready if r.request_id == rid and r.key == head.key and r.walk == walk]
            if not match:
                return None
            found.append(match[0])
        self._unready(found)
        self.follow.pop(0)
        self.num_consecutive += 1
        self.num_steps += 1
        self.last_run[head.key] = self.num_steps
        return Batch(
            worker=self.rank, key=head.key, node=head.node, mask=head.mask, label=head.label,
            request_ids=list(head.request_ids), walks=list(head.walks),
            num_tokens=list(head.num_tokens), capture=head.capture,
            padded_batch=head.padded_batch, token_bucket=head.token_bucket,
            attention=head.attention, is_follower=True, is_guided=head.is_guided,
        )

    # ---------------------------------------------------------- state

    def num_ready(self) -> int:
        return len(self.ready)

    def num_held(self) -> int:
        return sum(len(rows) for _, _, rows in self.holds)

    def next_hold_deadline(self) -> Optional[float]:
        return min(hold[0] for hold in self.holds) if self.holds else None

    def is_idle(self) -> bool:
        return not self.ready and not self.follow and self.num_held() == 0
