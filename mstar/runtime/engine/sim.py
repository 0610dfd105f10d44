"""A simulated engine: runs steps by a cost model instead of models, with a small KV pool.

In: the plan; per step, a `Step`. Out: a `StepResult` whose outputs are small placeholders
(a kv node emits one token, as a one-element list, under each output edge name of its call; a
stateless node emits a one-element list holding the row's input length) and whose `elapsed_s`
is the modelled step time. The driver advances a `SimClock` by it, so runs are reproducible and
take only host time.

Per-request behaviour: a kv node reports is_stop once it has sampled `max_tokens` tokens for the
request (the conductor applies stops only in loops that have a stop check).

KV pool (per kv node, pages of page_size tokens): the torch engine's admission policy
(`kv/admission.py`): a request starts on a node only when its budget, the pages of
min(prompt + max_tokens, max_seq_len) tokens, fits beside what started requests may still claim;
each step a row takes the pages its tokens add (a simulated sequence holds at most its budget's
tokens: media tokens are not modelled), rows in step order. Rows the pool is short for are
named in allocation_failed (nothing ran for them, the scheduler holds them) and, with
`runs_partial_steps` (the default), the other rows run in the same step; without it the step runs
nothing (all or nothing, and nothing is taken). A request that could never fit the pool is
refused by add_request.

Cost model, seconds per step (documented in docs/runtime.md "## Simulated engine"):

    time = launch + num_rows_run * per_row + w * (num_tokens * per_token + sum_context * per_context)

    (over the rows that ran; a step in which no row ran costs CAPTURED_LAUNCH_S)

    launch:      CAPTURED_LAUNCH_S when the step replays a capture (padded_batch > 0), else
                 EAGER_LAUNCH_S; a split-attention mixed step adds SPLIT_EXTRA_S.
    num_rows_run: padded_batch for captured steps (padding rows cost like real ones), else rows.
    w:           node weight = layers * hidden / (28 * 3072) for kv nodes (1 for an Orpheus-size
                 LLM), STATELESS_WEIGHT for stateless nodes.
"""
from __future__ import annotations

import math
from operator import attrgetter
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence

from mstar.plan.schema import Plan
from mstar.runtime.engine.kv.admission import Admission, PageNeed
from mstar.runtime.step import EngineCaps, RowResult, RunsAtLaunch, Step, StepResult, StepRow

CAPTURED_LAUNCH_S = 0.0003
EAGER_LAUNCH_S = 0.0015
SPLIT_EXTRA_S = 0.0002
PER_ROW_S = 0.00005
PER_TOKEN_S = 0.00002
PER_CONTEXT_S = 0.00000002
STATELESS_WEIGHT = 0.2
SIM_VOCAB = 4096  # the placeholder tokens are ids below this (a stand-in vocabulary: EngineCaps.vocab_sizes)
_tokens_of = attrgetter("num_tokens")
_context_of = attrgetter("context_len")


class SimClock:
    """Simulated seconds; only the driver moves it."""

    def __init__(self, start: float = 0.0):
        self.now = start

    def __call__(self) -> float:
        return self.now

    def advance_to(self, when: float) -> None:
        if when > self.now:
            self.now = when


@dataclass
class _KvPool:
    page_size: int
    num_pages: int
    max_seq_len: int
    num_free: int
    admission: Admission = field(default_factory=Admission)
    fed: dict[str, int] = field(default_factory=dict)  # request -> tokens fed on this node
    sampled: dict[str, int] = field(default_factory=dict)  # request -> tokens sampled on this node


class SimEngine(RunsAtLaunch):
    """Engine protocol (mstar.runtime.step.Engine) by a cost model.

    num_pages overrides every kv node's pool size. inject_oom(step) -> request ids lets tests
    fail rows of a step out of memory on purpose; inject_error maps a request id to an error
    message that its first row reports. runs_partial_steps: rows that got memory run beside
    the allocation_failed ones (default); False: a step with any failed row runs nothing.
    """

    def __init__(
        self,
        plan: Plan,
        *,
        seed: int = 0,
        num_pages: Optional[int] = None,
        inject_oom: Optional[Callable[[Step], list[str]]] = None,
        inject_error: Optional[dict[str, str]] = None,
        runs_partial_steps: bool = True,
    ):
        self.plan = plan
        self.runs_partial_steps = runs_partial_steps
        self.clock = SimClock()
        self.caps = EngineCaps(is_simulated=True, runs_partial_steps=runs_partial_steps, can_run_followers=True,
                               clock=self.clock,
                               vocab_sizes={n.name: SIM_VOCAB for n in plan.nodes if n.engine == "kv"})
        self.seed = seed
        self.inject_oom = inject_oom
        self.inject_error = dict(inject_error or {})
        self.pools: dict[str, _KvPool] = {}
        for pool in plan.deployment.kv_pools:
            pages = num_pages if num_pages is not None else pool.num_pages
            self.pools[pool.node] = _KvPool(pool.page_size, pages, pool.max_seq_len, pages)
        self.weights: dict[str, float] = {}
        for node in plan.nodes:
            if node.engine == "kv":
                layers = node.dims.get("layers", 28)
                hidden = node.dims.get("hidden", 3072)
                if isinstance(layers, int) and isinstance(hidden, int):
                    self.weights[node.name] = layers * hidden / (28 * 3072)
                else:
                    self.weights[node.name] = 1.0
                if node.name not in self.pools:
                    seq = plan.deployment.max_seq_len
                    self.pools[node.name] = _KvPool(16, 1 << 30, seq, 1 << 30)
            else:
                self.weights[node.name] = STATELESS_WEIGHT
        # (node, walk) -> output edge names (loop-backs on the device carry no value).
        self.out_names: dict[tuple[str, str], list[str]] = {}
        for walk in plan.walks:
            for call in walk.calls:
                names = self.out_names.setdefault((call.node, walk.name), [])
                for edge in call.edges:
                    if not edge.is_device and edge.name not in names:
                        names.append(edge.name)
        self.requests: dict[str, Any] = {}
        self.budget_tokens: dict[str, int] = {}  # request -> prompt + max_tokens (its KV budget's tokens)
        self.reserved: dict[tuple[str, str], int] = {}  # (request, kv node) -> pages it holds
        self.num_steps = 0

    # ------------------------------------------------------------ Engine protocol

    def add_request(self, request_id: str, spec: Any) -> Optional[str]:
        need_tokens = len(spec.prompt_tokens) + spec.max_tokens
        for node, pool in self.pools.items():
            pages = self._pages_for(pool, need_tokens)
            if pages > pool.num_pages:
                return (
                    f"can never fit: needs {pages} KV pages of {pool.page_size} tokens on {node} "
                    f"(prompt {len(spec.prompt_tokens)} + max_tokens {spec.max_tokens}), "
                    f"the pool has {pool.num_pages}"
                )
        self.requests[request_id] = spec
        self.budget_tokens[request_id] = need_tokens
        return None

    def end_request(self, request_id: str) -> None:
        self.requests.pop(request_id, None)
        self.budget_tokens.pop(request_id, None)
        for node, pool in self.pools.items():
            pool.num_free += pool.admission.release(request_id)
            self.reserved.pop((request_id, node), None)
            pool.fed.pop(request_id, None)
            pool.sampled.pop(request_id, None)

    def kv_pages(self) -> dict[str, tuple[int, int]]:
        """Per kv node: (pages in use, pages in its pool), for a server's metrics."""
        return {node: (pool.num_pages - pool.num_free, pool.num_pages) for node, pool in self.pools.items()}

    def run_step(self, step: Step) -> StepResult:
        if not step.rows:  # a TP follower's copy of its leader's step: it costs time, nothing more
            return StepResult(rows=[], elapsed_s=self.step_time(step))
        self.num_steps += 1
        node = step.node
        pool = self.pools.get(node)
        short: list[str] = []
        if pool is not None:
            short = self._reserve(step, pool)
            if short and not self.runs_partial_steps:
                return StepResult(rows=[], allocation_failed=short, elapsed_s=CAPTURED_LAUNCH_S)
        if self.inject_oom is not None:
            injected = [rid for rid in self.inject_oom(step) if rid not in short]
            if injected and not self.runs_partial_steps:
                return StepResult(rows=[], allocation_failed=injected, elapsed_s=CAPTURED_LAUNCH_S)
            short.extend(injected)
        if not short:
            return StepResult(rows=self._row_results(step.node, step.rows), elapsed_s=self.step_time(step))
        failed = set(short)
        rows = [row for row in step.rows if row.request_id not in failed]
        if not rows:
            return StepResult(rows=[], allocation_failed=short, elapsed_s=CAPTURED_LAUNCH_S)
        ran = Step(
            worker=step.worker, key=step.key, node=node, mask=step.mask, label=step.label, rows=rows,
            attention=step.attention, capture=step.capture, padded_batch=step.padded_batch,
            token_bucket=step.token_bucket, is_speculative=step.is_speculative,
        )
        return StepResult(rows=self._row_results(node, rows), allocation_failed=short, elapsed_s=self.step_time(ran))

    # ------------------------------------------------------------ internals

    @staticmethod
    def _pages_for(pool: _KvPool, num_tokens: int) -> int:
        return math.ceil(min(num_tokens, pool.max_seq_len) / pool.page_size)

    def _reserve(self, step: Step, pool: _KvPool) -> list[str]:
        """Take the pages each row's tokens add, by the admission policy, rows in step order;
        returns the rows the pool is short for. All or nothing per step without
        runs_partial_steps (then nothing is taken)."""
        needs, steady = self._page_needs(step.rows, pool)
        short = pool.admission.shortfall([need for _, need in needs], pool.num_free) if needs else []
        if short and not self.runs_partial_steps:
            return short
        failed = set(short)
        node, fed = step.node, pool.fed
        for row, need in needs:
            if need.request_id not in failed:
                pool.admission.grant(need)
                pool.num_free -= need.num_pages
                key = (row.request_id, node)
                self.reserved[key] = self.reserved.get(key, 0) + need.num_pages
                fed[row.request_id] = fed.get(row.request_id, 0) + row.num_tokens
        for row in steady:
            fed[row.request_id] += row.num_tokens
        return short

    def _page_needs(self, rows: list[StepRow], pool: _KvPool) -> tuple[list[tuple[StepRow, PageNeed]], list[StepRow]]:
        """Each row's PageNeed, except the steady rows: a started request whose tokens this step
        stay within the pages it holds (a decode row between page boundaries), for which the
        policy's shortfall and grant change nothing (it asks no page and is always granted)."""
        budget_tokens, fed, started = self.budget_tokens, pool.fed, pool.admission.budgets
        size, max_seq_len = pool.page_size, pool.max_seq_len
        needs = []
        steady = []
        for row in rows:
            request_id = row.request_id
            num_budget_tokens = budget_tokens.get(request_id)
            if num_budget_tokens is None:
                continue
            # The simulated sequence holds at most prompt + max_tokens tokens (media tokens an
            # encoder feeds are not modelled), so a request never outgrows its budget here.
            limit = num_budget_tokens if num_budget_tokens < max_seq_len else max_seq_len
            before = fed.get(request_id, 0)
            after = before + row.num_tokens
            # pages of min(tokens, budget tokens, max_seq_len) after less before, integer ceilings
            after, before = (after if after < limit else limit), (before if before < limit else limit)
            num_pages = -(-after // size) + before // -size
            if num_pages == 0 and request_id in started:
                steady.append(row)
            else:
                needs.append((row, PageNeed(request_id, num_pages, -(-limit // size))))
        return needs, steady

    def _row_results(self, node: str, rows: list[StepRow]) -> list[RowResult]:
        """One pass over the rows that run: placeholder outputs, sampled counts, stops, injected errors."""
        pool = self.pools.get(node)
        errors, requests, seed = self.inject_error, self.requests, self.seed
        results: list[RowResult] = []
        append = results.append
        walk: Optional[str] = None
        names: Sequence[str] = ()
        for row in rows:
            request_id = row.request_id
            if errors and request_id in errors:
                append(RowResult(request_id, error=errors.pop(request_id)))
                continue
            if row.walk != walk:  # one lookup per run of rows of one walk
                walk = row.walk
                names = self.out_names.get((node, walk), ())
            if pool is None:
                append(RowResult(request_id, _placeholders(names, row.num_tokens)))
                continue
            count = pool.sampled.get(request_id, 0) + 1
            pool.sampled[request_id] = count
            token = (count * 7919 + len(request_id) * 104729 + seed) % SIM_VOCAB
            spec = requests.get(request_id)
            append(RowResult(request_id, _placeholders(names, token), spec is not None and count >= spec.max_tokens))
        return results

    def step_time(self, step: Step) -> float:
        """The cost model (module docstring)."""
        is_captured = step.padded_batch > 0
        launch = CAPTURED_LAUNCH_S if is_captured else EAGER_LAUNCH_S
        if step.attention == "split":
            launch += SPLIT_EXTRA_S
        num_rows = step.padded_batch if is_captured else len(step.rows)
        num_tokens = sum(map(_tokens_of, step.rows))
        num_context = sum(map(_context_of, step.rows))
        weight = self.weights.get(step.node, STATELESS_WEIGHT)
        return launch + num_rows * PER_ROW_S + weight * (num_tokens * PER_TOKEN_S + num_context * PER_CONTEXT_S)


def _placeholders(names: Sequence[str], value: int) -> dict[str, list[int]]:
    """A one-element list of `value` under each name (a list of its own per name)."""
    if len(names) == 1:
        return {names[0]: [value]}
    return {name: [value] for name in names}
