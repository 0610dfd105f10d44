"""A tiny conductor for scheduler tests: drives a scheduler through a trace and checks every batch.

A request lives on one key and runs a fixed sequence of (walk, tokens) steps. The harness keeps
its own view of each request (ready, held, in flight, done, removed), one step in flight at a
time plus at most one speculative step built while it runs, and checks each batch against the
plan: cap, rows limits, one key, mask/label consistency, rows that were really ready, and the
starvation bound (see `starvation_bound`) on every scheduled row, including rows back from a
hold, which count from the scheduler call that returned them (`_return_holds`). `log` records
every decision, so two runs of the same trace can be compared (determinism, fast vs baseline
scheduler).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from hypothesis import strategies as st

from mstar.plan.schema import DeploymentPlan, KeyPlan, WorkerPlan
from mstar.runtime.scheduler.batch import Batch


@dataclass
class Req:
    rid: str
    key: str
    steps: list[tuple[str, int]]  # (walk, tokens) per run
    pos: int = 0
    state: str = "ready"  # ready | held | flight | spec | done | removed
    ready_at: int = 0  # batches built when it became ready
    num_ahead: int = 0  # ready rows of its key older than it, when it became ready
    hold_until: float = 0.0
    hold_order: tuple[int, int] = (0, 0)  # (hold call, position in the failed batch)


def starvation_bound(num_ahead: int, num_keys: int, max_follow: int) -> int:
    """Batches within which a ready row of a led key runs (derived in docs/runtime.md): each step
    of its key takes the key's oldest ready row, and between two steps of one key every other led
    key runs at most once (least-recently-run) and follower batches at most max_follow times
    before each local step."""
    return (num_ahead + 1) * num_keys * (max_follow + 1)


class Runner:
    """Runs one scheduler (`make(worker, deployment, clock)`) under a trace."""

    def __init__(
        self, make, worker: WorkerPlan, deployment: DeploymentPlan, arrival_keys: Optional[list[str]] = None,
        remove_finished: bool = False,
    ) -> None:
        """arrival_keys: keys requests arrive on (default: all; a TP follower's followed keys
        cannot take part in a one-worker trace). remove_finished: a request that finishes is
        removed from the scheduler after the step's rows came back, as the driver removes every
        ended request."""
        self.remove_finished = remove_finished
        self.now = 0.0
        self.worker = worker
        self.keys: dict[str, KeyPlan] = {
            key.name: key for key in worker.keys if arrival_keys is None or key.name in arrival_keys
        }
        self.sched = make(worker, deployment, lambda: self.now)
        self.max_follow = max(1, deployment.max_consecutive_follower_batches)
        self.reqs: dict[str, Req] = {}
        self.num_batches = 0
        self.num_holds = 0
        self.in_flight: Optional[Batch] = None
        self.spec: Optional[Batch] = None
        self.log: list = []
        self.spec_by_pair = {(s.node, s.walk): s for s in worker.speculation}

    # ------------------------------------------------------------ ops

    def arrive(self, key_pick: int, walk_picks: list[int], tokens: list[int]) -> None:
        key = list(self.keys.values())[key_pick % len(self.keys)]
        steps = [(key.walks[p % len(key.walks)], t) for p, t in zip(walk_picks, tokens)]
        rid = f"r{len(self.reqs)}"
        req = Req(rid, key.name, steps)
        self.reqs[rid] = req
        self._make_ready(req)
        self.sched.add_ready(rid, key.node, steps[0][0], steps[0][1])
        self.log.append(("arrive", rid))

    def build(self) -> None:
        if self.in_flight is not None:
            return
        self._return_holds()
        batch = self.sched.next_batch()
        self.log.append(("build", batch))
        if batch is not None:
            self._check(batch, continuing=[])
            self.in_flight = batch

    def speculate(self) -> None:
        running = self.in_flight
        if running is None or self.spec is not None:
            return
        key = self.keys[running.key]
        chain = None
        for walk in key.walks:
            in_step = running.label == walk if running.label is not None else walk in running.walks
            spec = self.spec_by_pair.get((key.node, walk))
            if in_step and spec is not None and spec.can_speculate:
                chain = walk
                break
        if chain is None:
            self.log.append(("spec", None))
            return
        continuing, tokens = [], []
        for rid, walk in zip(running.request_ids, running.walks):
            req = self.reqs[rid]
            is_next_chain = req.pos + 1 < len(req.steps) and req.steps[req.pos + 1][0] == chain
            if walk == chain and req.state == "flight" and is_next_chain:
                continuing.append(rid)
                tokens.append(req.steps[req.pos + 1][1])
        self._return_holds()
        batch = self.sched.speculate(running, continuing, tokens)
        self.log.append(("spec", batch))
        if batch is not None:
            self._check(batch, continuing=continuing)
            self.spec = batch

    def complete(self, oom_bits: int) -> None:
        """Finish the step in flight; oom_bits != 0 fails it out of memory, holding the rows whose
        position bit is set (all when the bits select none of them)."""
        batch = self.in_flight
        if batch is None:
            return
        self.in_flight = None
        if oom_bits:
            named = [rid for i, rid in enumerate(batch.request_ids) if oom_bits >> (i % 16) & 1] or None
            self.sched.hold(batch, named, 0.05)
            self.log.append(("hold", tuple(named or ())))
            held = set(batch.request_ids if named is None else named)
            self.num_holds += 1
            for at, rid in enumerate(batch.request_ids):
                req = self.reqs[rid]
                if req.state == "removed":
                    continue
                if rid in held:
                    req.state, req.hold_until, req.hold_order = "held", self.now + 0.05, (self.num_holds, at)
                else:
                    self._make_ready(req)
            if self.spec is not None:
                spec, self.spec = self.spec, None
                self.sched.discard(spec)
                self.log.append(("discard", spec.request_ids))
                for rid in spec.request_ids:
                    req = self.reqs[rid]
                    if req.state == "spec":
                        self._make_ready(req)
            return
        spec_ids = set(self.spec.request_ids) if self.spec is not None else set()
        finished = []
        for rid in batch.request_ids:
            req = self.reqs[rid]
            if req.state == "removed":
                continue
            req.pos += 1
            if req.pos == len(req.steps):
                req.state = "done"
                finished.append(rid)
            elif rid in spec_ids:
                req.state = "spec_next"  # its next run is already in the speculative step
            else:
                self._make_ready(req)
                walk, tokens = req.steps[req.pos]
                self.sched.add_ready(rid, self.keys[req.key].node, walk, tokens)
        if self.remove_finished:
            for rid in finished:
                self.sched.remove(rid)
        if self.spec is not None:
            self.in_flight, self.spec = self.spec, None
            for rid in self.in_flight.request_ids:
                if self.reqs[rid].state in ("spec", "spec_next"):
                    self.reqs[rid].state = "flight"

    def remove(self, pick: int) -> None:
        live = [r for r in self.reqs.values() if r.state not in ("done", "removed")]
        if not live:
            return
        req = live[pick % len(live)]
        self.sched.remove(req.rid)
        req.state = "removed"
        self.log.append(("remove", req.rid))

    def advance(self, dt: float) -> None:
        self.now += dt

    def drain(self, max_rounds: int = 5000) -> None:
        """Run to completion; fails if rows are lost (the scheduler stops without finishing)."""
        for _ in range(max_rounds):
            if self.in_flight is not None:
                self.speculate()  # drains exercise speculation chains to their end
                self.complete(0)
                continue
            self.build()
            if self.in_flight is not None:
                continue
            deadline = self.sched.next_hold_deadline()
            if deadline is not None:
                self.now = max(self.now, deadline)
                continue
            break
        unfinished = [r.rid for r in self.reqs.values() if r.state not in ("done", "removed")]
        assert not unfinished, f"requests never finished: {unfinished[:5]}"
        assert self.sched.is_idle()

    # ------------------------------------------------------------ checks

    def _make_ready(self, req: Req) -> None:
        req.state = "ready"
        req.ready_at = self.num_batches
        req.num_ahead = sum(1 for r in self.reqs.values() if r.key == req.key and r.state == "ready" and r is not req)

    def _return_holds(self) -> None:
        """The scheduler call about to be made (next_batch or speculate) first returns every hold
        whose deadline has passed to the end of its ready queue, earliest deadline first, then in
        the order the holds were made, rows in batch order. Those rows are ready from here on:
        older than any row that becomes ready later, so they count in its bound, and their own
        bound counts from here (not from the deadline, which may lie well before this call)."""
        expired = [r for r in self.reqs.values() if r.state == "held" and r.hold_until <= self.now]
        for req in sorted(expired, key=lambda r: (r.hold_until, r.hold_order)):
            self._make_ready(req)

    def _check(self, batch: Batch, continuing: list[str]) -> None:
        key = self.keys[batch.key]
        entry = key.mixtures[batch.mask]
        rows = batch.request_ids
        assert rows, "empty batch"
        assert len(set(rows)) == len(rows), f"row scheduled twice in one step: {rows}"
        assert len(rows) <= entry.cap, f"{len(rows)} rows over cap {entry.cap} of {entry.walks}"
        assert set(batch.walks) == set(entry.walks), "mask does not match the walks present"
        assert set(batch.walks) <= set(key.walks), "rows of another key"
        assert batch.label == (entry.walks[0] if len(entry.walks) == 1 else None)
        if len(entry.walks) > 1:
            for walk, limit in key.rows_limits.items():
                assert batch.walks.count(walk) <= limit, f"rows {walk} <= {limit} broken"
        if batch.capture is not None:
            assert batch.padded_batch >= len(rows)
        self.num_batches += 1
        num_keys = len(self.keys)
        for rid, walk, tokens in zip(rows, batch.walks, batch.num_tokens):
            req = self.reqs[rid]
            if rid in continuing:
                assert req.state == "flight"
                req.state = "spec_next"
                continue
            assert req.key == batch.key
            assert req.state == "ready", f"{rid} scheduled while {req.state}"
            assert (walk, tokens) == req.steps[req.pos], f"{rid} scheduled with the wrong walk or tokens"
            waited = self.num_batches - req.ready_at
            bound = starvation_bound(req.num_ahead, num_keys, self.max_follow)
            assert waited <= bound, f"{rid} waited {waited} batches (bound {bound})"
            req.state = "spec" if batch.is_speculative else "flight"


# ---------------------------------------------------------------- traces


def ops_strategy(max_ops: int = 80):
    """Random traces: bursts of arrivals (a first walk, then a looping walk), ticks (maybe
    speculate, finish the step in flight with maybe an out-of-memory failure, build the next),
    cancellations and clock advances."""
    arrive = st.tuples(
        st.just("arrive"), st.integers(0, 5), st.integers(1, 6),
        st.tuples(st.integers(0, 2), st.integers(0, 2), st.integers(0, 6)), st.integers(1, 40),
    )
    tick = st.tuples(st.just("tick"), st.booleans(), st.sampled_from([0] * 8 + [0b1, 0b101, 0xFFFF]))
    return st.lists(
        st.one_of(
            arrive, tick, tick, tick,
            st.tuples(st.just("remove"), st.integers(0, 100)),
            st.tuples(st.just("advance"), st.sampled_from([0.01, 0.03, 0.06])),
        ),
        max_size=max_ops,
    )


def run_ops(runner: Runner, ops: list) -> None:
    for op in ops:
        name = op[0]
        if name == "arrive":
            _, key_pick, count, (first, loop, length), tokens = op
            for i in range(count):
                runner.arrive(key_pick, [first] + [loop] * (length + i % 2), [tokens] + [1] * (length + 1))
        elif name == "tick":
            _, is_spec, oom_bits = op
            if is_spec:
                runner.speculate()
            runner.complete(oom_bits)
            runner.build()
        elif name == "remove":
            runner.remove(op[1])
        else:
            runner.advance(op[1])
