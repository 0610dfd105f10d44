"""A simulated engine: runs steps by a cost model instead of models, with a small KV pool.

In: the plan; per step, a `Step`. Out: a `StepResult` whose outputs are small placeholders
(a kv node emits one token, as a one-element list, under each output edge name of its call, or
a frame of 1 + depth codes, a tuple, where a depth model extends the output on the row's walk; a
stateless node emits a one-element list holding the row's input length; an output the plan sends
to the client as an image is a small gray RGB image instead, `[3, 8, 8]`, so a client that encodes
it, the server's PNG answer among them, gets one) and whose `elapsed_s`
is the modelled step time. The driver advances a `SimClock` by it, so runs are reproducible and
take only host time.

Per-request behaviour: a kv node reports is_stop (a limit: `is_length`) once it has sampled
`max_tokens` tokens for the request, a row sampling where its call has a `tokens` or `transcript`
output, as on the torch engine (the conductor applies stops only in loops that have a stop
check), and only then: its tokens are placeholders, so stop tokens (the request's, the node's)
are not matched against them, which would end requests at random; a what-if run takes every
request to its max_tokens.

KV pool (per kv node, pages of page_size tokens): the torch engine's page bookkeeping
(`kv/pages.py`, with its prefix cache when the plan turns it on: `claim_prefix` finds a prompt's
cached pages as the torch engine does) and its admission policy (`kv/admission.py`): a request
starts on a node only when its budget, the pages of min(prompt + max_tokens, max_seq_len) tokens
(less a cached prefix it holds; a guided request's guidance sequences too, `guidance_pages`), fits
beside what started requests may still claim; each step a
row takes the pages its tokens add (a simulated sequence holds at most its budget's tokens: media
tokens are not modelled), rows in step order. Rows the pool is short for are named in
allocation_failed (nothing ran for them, the scheduler holds them) and, with `runs_partial_steps`
(the default), the other rows run in the same step; without it the step runs nothing (all or
nothing, and nothing is taken). A request that could never fit the pool is refused by add_request.

Each step is checked against its plan row first, as the torch engine checks it (`step_check.py`:
a step that engine would refuse is a StepContractError here too, so a what-if run finds it).

Step time: `sim_cost.StepCost` (a roofline per step for kv nodes, calibrated to H200 measurements;
a flat per-row model for stateless nodes; docs/runtime.md "## Simulated engine"), plus PAGE_MOVE_S
per KV page moved to or from the host pool; a step in which no row ran costs CAPTURED_LAUNCH_S.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Optional, Sequence

import numpy as np

from mstar.plan.client_images import image_outputs
from mstar.plan.guidance_mode import GuidanceRule
from mstar.plan.output_bound import SAMPLED_ROLES, frame_depths
from mstar.plan.rounds import max_rounds
from mstar.plan.schema import Plan
from mstar.runtime.engine.kv.admission import Admission, PageNeed
from mstar.runtime.engine.kv.claims import claim_cached_prefix
from mstar.runtime.engine.kv.offload import Offload
from mstar.runtime.engine.kv.pages import PagePool
from mstar.runtime.engine.kv.slots import SlotPool, node_slot_pool
from mstar.runtime.engine.prompt_limits import (
    EmptyPrompt, prompt_limit_problem, round_prompt_problem, takes_text_prompt,
)
from mstar.runtime.engine.sim_cost import CAPTURED_LAUNCH_S, StepCost
from mstar.runtime.engine.step_check import StepChecker
from mstar.runtime.step import EngineCaps, RowResult, RunsAtLaunch, Step, StepResult, StepRow

SIM_VOCAB = 4096  # the placeholder tokens are ids below this (a stand-in vocabulary: EngineCaps.vocab_sizes)
# An image output's placeholder: a gray RGB image, [3, 8, 8] in [0, 1], immutable and shared (nested
# tuples: outputs compare with ==, as the tests of equal runs compare them)
SIM_IMAGE = tuple(tuple((0.5,) * 8 for _ in range(8)) for _ in range(3))
SIM_IMAGE_SIZE = (8, 8)  # its (width, height), as EngineCaps.image_sizes says it
PAGE_MOVE_S = 0.00001  # one KV page copied between the device and the host pool
SEQUENCE = "main"  # the simulated engine keeps one KV sequence per request and kv node


class SimClock:
    """Simulated seconds; only the driver moves it."""

    def __init__(self, start: float = 0.0):
        self.now = start

    def __call__(self) -> float:
        return self.now

    def advance_to(self, when: float) -> None:
        if when > self.now:
            self.now = when


def guidance_rules(plan: Plan) -> dict[str, tuple[GuidanceRule, tuple[str, ...]]]:
    """kv node -> (its guidance rule, what each of its guidance sequences drops), for the nodes that
    keep guidance sequences (none on a node with recurrent state, as on the torch engine)."""
    return {node.name: (GuidanceRule.of(node), tuple(g.drops for g in node.guidance)) for node in plan.nodes
            if node.engine == "kv" and node.guidance and node.recurrent is None}


def media_tokens(plan: Plan) -> dict[str, int]:
    """{node: its `media_token`} for the nodes whose prompts hold media placeholders."""
    return {n.name: token for n in plan.nodes if isinstance(token := n.dims.get("media_token"), int)}


@dataclass
class _KvPool:
    pages: PagePool  # the torch engine's page bookkeeping (and prefix cache), without tensors
    max_seq_len: int
    offload: Optional[Offload] = None  # the host pool (cpu_offload_pages), when the plan sizes one
    admission: Admission = field(init=False)  # over this pool's pages (which waiting requests are reachable)
    claimed: dict[str, int] = field(default_factory=dict)  # request -> cached pages it started on
    sampled: dict[str, int] = field(default_factory=dict)  # request -> tokens sampled on this node
    # a node with recurrent state (`NodePlan.recurrent`): its slots, one a started request, as the
    # torch engine holds them (the simulator started every row a slot would have held back)
    slots: Optional[SlotPool] = None
    # request -> pages its guidance sequences may need here (a guided request's, as the torch engine
    # budgets them beside its own sequence; `guidance_pages`)
    guided: dict[str, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.admission = Admission(self.pages.num_pages)

    def release(self, request_id: str) -> None:
        """The request's pages, claim, host pages and counts here go (it ended, or ran its last
        walk on this node)."""
        self.admission.release(request_id)
        self.pages.free_request(request_id)
        if self.slots is not None:
            self.slots.release(request_id)
        self.claimed.pop(request_id, None)
        if self.offload is not None:
            self.offload.forget(request_id)
        self.sampled.pop(request_id, None)
        self.guided.pop(request_id, None)

    @property
    def page_size(self) -> int:
        return self.pages.page_size

    @property
    def num_pages(self) -> int:
        return self.pages.num_pages


class SimEngine(RunsAtLaunch):
    """Engine protocol (mstar.runtime.step.Engine) by a cost model.

    num_pages overrides every kv node's pool size. inject_oom(step) -> request ids lets tests
    fail rows of a step out of memory on purpose; inject_error maps a request id to an error
    message that its first row reports. runs_partial_steps: rows that got memory run beside
    the allocation_failed ones (default); False: a step with any failed row runs nothing.
    check_steps: check each step against its plan row (module docstring); False for drivers of
    hand-built steps that bypass the plan's keys (a conductor unit test's one-row steps).
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
        check_steps: bool = True,
    ):
        self.plan = plan
        self.runs_partial_steps = runs_partial_steps
        self.clock = SimClock()
        self.caps = EngineCaps(is_simulated=True, runs_partial_steps=runs_partial_steps, can_run_followers=True,
                               clock=self.clock,
                               vocab_sizes={n.name: SIM_VOCAB for n in plan.nodes if n.engine == "kv"},
                               # a step raises only in its check against the plan row, before any
                               # pool or count moves; a node with recurrent state is left out as on torch
                               rerun_nodes=frozenset(n.name for n in plan.nodes if n.recurrent is None))
        self.seed = seed
        self.inject_oom = inject_oom
        self.inject_error = dict(inject_error or {})
        self.pools: dict[str, _KvPool] = {}
        self.media_tokens = media_tokens(plan)  # prompts are claimed only up to a placeholder, as on torch
        for pool in plan.deployment.kv_pools:
            pages = num_pages if num_pages is not None else pool.num_pages
            self.pools[pool.node] = _KvPool(PagePool(pages, pool.page_size, pool.prefix_cache == "pages"),
                                            pool.max_seq_len, Offload(pool.host_pages) if pool.host_pages else None)
        for node in plan.nodes:
            if node.engine == "kv" and node.name not in self.pools:
                self.pools[node.name] = _KvPool(PagePool(1 << 30, 16), plan.deployment.max_seq_len)
            if node.engine == "kv" and node.recurrent is not None:
                self.pools[node.name].slots = node_slot_pool(node.name, node.recurrent.num_slots,
                                                             plan.deployment.max_concurrent_requests)
        self.cost = StepCost(plan)
        # per kv node: (name, the spec's vocabulary, whether it takes the text prompt, the tokens a
        # request may reach: max_seq_len a round of a repeating partition, as serve/api.py bounds them,
        # and one round's max_seq_len, which the prompt alone must leave room in)
        self.prompt_limits = [(node.name, node.dims.get("vocab", 0), takes_text_prompt(node),
                               self.pools[node.name].max_seq_len * max_rounds(plan, [node.name]),
                               self.pools[node.name].max_seq_len) for node in plan.nodes if node.engine == "kv"]
        self.empty_prompt, self.guidance = EmptyPrompt(plan), guidance_rules(plan)
        # the torch engine's step contract: a step it would refuse (StepContractError) fails here too
        self.checker = StepChecker(plan) if check_steps else None
        tables = _CallTables(plan)
        self.out_names, self.image_names = tables.out_names, tables.image_names
        self.caps = replace(self.caps, image_sizes={node: SIM_IMAGE_SIZE for node, _ in self.image_names})
        self.sampling, self.depth_frames = tables.sampling, tables.depth_frames
        self.requests: dict[str, Any] = {}
        self.budget_tokens: dict[str, int] = {}  # request -> prompt + max_tokens (its KV budget's tokens)
        self.num_steps = 0
        self.num_moved_pages = 0  # KV pages moved to or from the host pool in the running step

    # ------------------------------------------------------------ Engine protocol

    def add_request(self, request_id: str, spec: Any) -> Optional[str]:
        if (getattr(spec, "logprobs", None) is not None or getattr(spec, "prompt_logprobs", None) is not None
                or getattr(spec, "logit_bias", None)):
            return ("logprobs, prompt_logprobs and logit_bias need a model's logits, and the simulated engine draws "
                    "its tokens without any")
        need_tokens = len(spec.prompt_tokens) + spec.max_tokens
        reason = self._refusal(spec)
        if reason is not None:
            return reason
        guided = self.guidance_pages(spec, need_tokens)
        for node, pool in self.pools.items():
            pages = self._pages_for(pool, need_tokens) + guided.get(node, 0)
            if pages > pool.num_pages:
                sequences = " with its guidance sequences" if node in guided else ""
                return (
                    f"can never fit: needs {pages} KV pages of {pool.page_size} tokens on {node}{sequences} "
                    f"(prompt {len(spec.prompt_tokens)} + max_tokens {spec.max_tokens}), "
                    f"the pool has {pool.num_pages}"
                )
        self.requests[request_id] = spec
        self.budget_tokens[request_id] = need_tokens
        for node, pages in guided.items():
            self.pools[node].guided[request_id] = pages
        return None

    def guidance_pages(self, spec: Any, need_tokens: int) -> dict[str, int]:
        """kv node -> the pages a guided request's guidance sequences may need there, as the torch
        engine budgets them (`DecoderRunner._needed_pages`): the prompt + max_tokens for a sequence
        that drops the media, the media for one that drops the text (0 here: the media tokens an
        encoder feeds are not modelled). Empty for a request no node guides (GuidanceRule)."""
        scales = getattr(spec, "guidance", None) or {}
        route = getattr(spec, "route", None) or {}
        route_walks = frozenset(walk for walks in route.values() for walk in walks)
        return {node: sum(self._pages_for(self.pools[node], 0 if drops == "text" else need_tokens) for drops in dropped)
                for node, (rule, dropped) in self.guidance.items()
                if node in self.pools and rule.requires(scales, route_walks)}

    def _refusal(self, spec: Any) -> Optional[str]:
        """What the torch engine refuses too (prompt_limits.py: a token id outside the vocabulary,
        prompt + max_tokens past max_seq_len, a prompt that alone fills one round's sequence of a
        repeating partition, an empty prompt a walk gives a node; before, the simulated engine ran
        them)."""
        for node, vocab, is_text_prompt, max_seq_len, _ in self.prompt_limits:
            problem = prompt_limit_problem(node, vocab, is_text_prompt, spec.prompt_tokens, spec.max_tokens,
                                           max_seq_len)
            if problem is not None:
                return f"cannot run: {problem}"
        for node, _, is_text_prompt, _, sequence_len in self.prompt_limits:
            # (the torch engine's Whisper decoder refuses it: each round's sequence holds the prompt)
            problem = round_prompt_problem(spec.prompt_tokens, sequence_len) if is_text_prompt else None
            if problem is not None:
                return f"cannot run: node {node}: {problem}"
        empty = self.empty_prompt.problem(spec)
        return f"cannot run: {empty}" if empty else None

    def end_request(self, request_id: str) -> None:
        self.requests.pop(request_id, None)
        self.budget_tokens.pop(request_id, None)
        for pool in self.pools.values():
            pool.release(request_id)

    def end_node(self, request_id: str, node: str) -> None:
        pool = self.pools.get(node)
        if pool is not None:
            pool.release(request_id)

    def offload_figures(self) -> dict[str, dict[str, int]]:
        """Per kv node with a host pool: the KV pages moved to it and back so far (for the report)."""
        return {node: pool.offload.figures() for node, pool in self.pools.items() if pool.offload is not None}

    def kv_pages(self) -> dict[str, tuple[int, int]]:
        """Per kv node: (pages in use, pages in its pool), for a server's metrics (cached pages
        nobody holds count as free)."""
        return {node: (pool.num_pages - pool.pages.num_free_pages, pool.num_pages) for node, pool in self.pools.items()}

    def num_pages_held(self) -> int:
        """KV pages requests hold now (cached pages nobody holds count as free)."""
        return sum(pool.num_pages - pool.pages.num_free_pages for pool in self.pools.values())

    def claim_prefix(self, request_id: str, node: str, tokens: list[int]) -> int:
        """The prompt's longest cached prefix (whole pages), as the torch engine claims it."""
        pool = self.pools.get(node)
        if pool is None or pool.admission.is_started(request_id):
            return 0
        num_cached = claim_cached_prefix(pool.admission, pool.pages, (request_id, SEQUENCE), tokens,
                                         self.media_tokens.get(node))
        pool.claimed[request_id] = pool.pages.pages_for(num_cached)
        # first come, first started (kv/admission.py)
        pool.admission.join(request_id, self._budget_pages(pool, request_id),
                            pool.pages.page_table((request_id, SEQUENCE)) if num_cached else None)
        return num_cached

    def run_step(self, step: Step) -> StepResult:
        result = self._run_step(step)
        if self.num_moved_pages:  # KV pages copied to or from the host pool this step
            result.elapsed_s += self.num_moved_pages * PAGE_MOVE_S
            self.num_moved_pages = 0
        return result

    def _run_step(self, step: Step) -> StepResult:
        if not step.rows:  # a TP follower's copy of its leader's step: it costs time, nothing more
            return StepResult(rows=[], elapsed_s=self.step_time(step))
        if self.checker is not None:
            self.checker.check(step)
        self.num_steps += 1
        node = step.node
        pool = self.pools.get(node)
        # A test's injected failures are known before the pool is touched: their rows are neither
        # reserved nor committed (committed first, a retried prompt was written twice)
        injected = list(self.inject_oom(step)) if self.inject_oom is not None else []
        if injected and not self.runs_partial_steps:
            return StepResult(rows=[], allocation_failed=injected, elapsed_s=CAPTURED_LAUNCH_S)
        short: list[str] = []
        if pool is not None:
            short = self._reserve(step, pool, set(injected))
            if short and not self.runs_partial_steps:
                return StepResult(rows=[], allocation_failed=short, elapsed_s=CAPTURED_LAUNCH_S)
        short.extend(rid for rid in injected if rid not in short)
        if not short:
            results, token_ids, stop_rows = self._row_results(step.node, step.rows)
            return StepResult(rows=results, elapsed_s=self.step_time(step),
                              token_ids=None if token_ids is None else np.array(token_ids, dtype=np.int64),
                              stop_rows=stop_rows)
        failed = set(short)
        rows = [row for row in step.rows if row.request_id not in failed]
        if not rows:
            return StepResult(rows=[], allocation_failed=short, elapsed_s=CAPTURED_LAUNCH_S)
        ran = Step(
            worker=step.worker, key=step.key, node=node, mask=step.mask, label=step.label, rows=rows,
            attention=step.attention, capture=step.capture, padded_batch=step.padded_batch,
            token_bucket=step.token_bucket, is_speculative=step.is_speculative, is_guided=step.is_guided,
        )
        return StepResult(rows=self._row_results(node, rows)[0], allocation_failed=short,
                          elapsed_s=self.step_time(ran))

    # ------------------------------------------------------------ internals

    @staticmethod
    def _pages_for(pool: _KvPool, num_tokens: int) -> int:
        return math.ceil(min(num_tokens, pool.max_seq_len) / pool.page_size)

    def _reserve(self, step: Step, pool: _KvPool, injected: frozenset[str] | set[str] = frozenset()) -> list[str]:
        """Take the pages each row's tokens add, by the admission policy, rows in step order;
        returns the rows the pool is short for. All or nothing per step without
        runs_partial_steps (then nothing is taken). With a host pool, rows of offloaded requests
        move back first, and started requests with no row here move out when rows are short.
        injected: requests whose rows a test fails (`inject_oom`), left out."""
        pages = pool.pages
        on_host: list[str] = []
        rows = [row for row in step.rows if row.request_id not in injected] if injected else step.rows
        if pool.offload is not None:
            pool.offload.note_step([row.request_id for row in rows])
            on_host = self._move_back(rows, pool)
        needs, steady = self._page_needs([row for row in rows if row.request_id not in on_host]
                                         if on_host else rows, pool)
        row_needs = [need for _, _, need in needs]
        short = self._refused(pool, row_needs) if needs else []
        movable = (pool.admission.startable_by_pages(row_needs, short, self._free_slots(pool))
                   if short and pool.offload is not None else [])
        if movable and self._move_out(step, pool, row_needs, movable):
            short = self._refused(pool, row_needs)
        short = on_host + short
        if short and not self.runs_partial_steps:
            return short
        failed = set(short)
        # As the torch engine does: every row's pages reserved, then (the KV written) every row's
        # tokens committed, in step order, keying full pages. Reserved and committed row by row, a
        # later row's reservation could evict a page an earlier row had just keyed, and the two
        # engines then cached different pages; a steady row (a prompt chunk within its pages)
        # committed without its tokens stopped keying its sequence.
        written: dict[str, int] = {}
        for row, num_new, need in needs:
            if need.request_id not in failed:
                pool.admission.grant(need)
                pages.reserve((row.request_id, SEQUENCE), num_new)
                written[row.request_id] = num_new
                if need.needs_slot and pool.slots is not None:
                    pool.slots.acquire(row.request_id)
        written.update((row.request_id, num_new) for row, num_new in steady)
        is_keyed = pages.cache is not None
        for row in rows:
            num_written = written.get(row.request_id)
            if num_written is not None:
                pages.commit((row.request_id, SEQUENCE), num_written,
                             _prompt_tokens(row, num_written) if is_keyed else None)
        return short

    @staticmethod
    def _free_slots(pool: _KvPool) -> int:
        return pool.slots.num_free_slots if pool.slots is not None else 0

    def _refused(self, pool: _KvPool, needs: list[PageNeed]) -> list[str]:
        """The requests of `needs` the admission policy refuses with the pages and state slots free now."""
        return pool.admission.shortfall(needs, pool.pages.num_free_pages, self._free_slots(pool))

    def _budget_pages(self, pool: _KvPool, request_id: str) -> int:
        """Pages the request may need on the node: min(prompt + max_tokens, max_seq_len) tokens' worth
        (a simulated sequence never holds more) and its guidance sequences' (a guided request's),
        less a cached prefix it started on."""
        return (self._pages_for(pool, self.budget_tokens[request_id]) + pool.guided.get(request_id, 0)
                - pool.claimed.get(request_id, 0))

    def _page_needs(self, rows: list[StepRow], pool: _KvPool
                    ) -> tuple[list[tuple[StepRow, int, PageNeed]], list[tuple[StepRow, int]]]:
        """Each row's tokens it writes and PageNeed, except the steady rows: a started request
        whose tokens this step stay within the pages it holds (a decode row between page
        boundaries), for which the policy's shortfall and grant change nothing."""
        budget_tokens, started, pages = self.budget_tokens, pool.admission.budgets, pool.pages
        needs = []
        steady = []
        for row in rows:
            request_id = row.request_id
            num_budget_tokens = budget_tokens.get(request_id)
            if num_budget_tokens is None:
                continue
            # The simulated sequence holds at most prompt + max_tokens tokens (media tokens an
            # encoder feeds are not modelled), so a request never outgrows its budget here.
            key = (request_id, SEQUENCE)
            num_left = min(num_budget_tokens, pool.max_seq_len) - pages.num_tokens(key)
            num_new = row.num_tokens if row.num_tokens < num_left else max(num_left, 0)
            num_pages = pages.num_new_pages(key, num_new)
            if num_pages == 0 and request_id in started:
                steady.append((row, num_new))
            else:
                needs_slot = pool.slots is not None and pool.slots.slot_of(request_id) is None
                needs.append((row, num_new, PageNeed(request_id, num_pages, self._budget_pages(pool, request_id),
                                                     needs_slot)))
        return needs, steady

    def _move_out(self, step: Step, pool: _KvPool, needs: list[PageNeed], short: list[str]) -> bool:
        """Move started requests with no row in the step to the host pool (kv/offload.py) so that
        the short rows' pages fit; True when any moved."""
        assert pool.offload is not None
        num_moved = pool.offload.move_out(pool.pages, pool.admission, pool.claimed, {r.request_id for r in step.rows},
                                          needs, short)
        self.num_moved_pages += num_moved
        return num_moved > 0

    def _move_back(self, rows: list[StepRow], pool: _KvPool) -> list[str]:
        """Rows of requests on the host pool: moved back when their budget fits (they start again),
        else returned (short, held and retried like any row short of pages)."""
        assert pool.offload is not None
        on_host = []
        for row in rows:
            request_id = row.request_id
            if not pool.offload.is_offloaded(request_id) or request_id not in self.requests:
                continue
            num_pages = sum(len(s.host_pages) for s in pool.offload.offloaded[request_id])
            need = PageNeed(request_id, num_pages, self._budget_pages(pool, request_id))
            if pool.admission.shortfall([need], pool.pages.num_free_pages):
                on_host.append(request_id)
                continue
            pool.admission.grant(need)
            for seq in pool.offload.restore(request_id):
                pool.pages.restore((request_id, seq.label), seq.num_tokens)
            self.num_moved_pages += num_pages
        return on_host

    def _row_results(self, node: str, rows: list[StepRow]
                     ) -> tuple[list[RowResult], Optional[list[int]], list[int]]:
        """One pass over the rows that run: placeholder outputs, sampled counts, stops, injected
        errors; and the same in columns (StepResult.token_ids, stop_rows) when every row sampled
        one token with no error (else None)."""
        pool = self.pools.get(node)
        errors, requests, seed = self.inject_error, self.requests, self.seed
        results: list[RowResult] = []
        append = results.append
        token_ids: Optional[list[int]] = [] if pool is not None else None
        stop_rows: list[int] = []
        walk: Optional[str] = None
        names: Sequence[str] = ()
        images: Sequence[str] = ()
        depths: dict[str, int] = {}
        samples = False
        for row in rows:
            request_id = row.request_id
            if errors and request_id in errors:
                append(RowResult(request_id, error=errors.pop(request_id)))
                token_ids = None
                continue
            if row.walk != walk:  # one lookup per run of rows of one walk
                walk = row.walk
                names = self.out_names.get((node, walk), ())
                images = self.image_names.get((node, walk), ())
                depths = self.depth_frames.get((node, walk), {})
                samples = (node, walk) in self.sampling
            if pool is None:
                outputs = _placeholders(names, row.num_tokens)
                append(RowResult(request_id, _with_images(outputs, images) if images else outputs))
                continue
            if row.is_partial:  # a chunk of a cut prompt that is not its last: KV only, no token
                append(RowResult(request_id))
                token_ids = None
                continue
            count = pool.sampled.get(request_id, 0) + samples
            pool.sampled[request_id] = count
            token = (count * 7919 + len(request_id) * 104729 + seed) % SIM_VOCAB
            spec = requests.get(request_id)
            is_stop = samples and spec is not None and count >= spec.max_tokens
            outputs = _placeholders(names, token)
            if depths:
                for name, depth in depths.items():
                    if name in outputs:
                        outputs[name] = _frame(token, depth)
            # positional (a keyword costs on this path); is_length = is_stop: the sim stops at max_tokens only
            append(RowResult(request_id, _with_images(outputs, images) if images else outputs, is_stop, None, False,
                             is_stop))
            if token_ids is not None:
                if not names or not samples or images or depths:  # nothing sampled or to answer, or an
                    token_ids = None  # image or a frame of codes, which the columns cannot carry
                    continue
                token_ids.append(token)
                if is_stop:
                    stop_rows.append(len(results) - 1)
        return results, token_ids, stop_rows

    def step_time(self, step: Step) -> float:
        """The step's modelled seconds (sim_cost.StepCost)."""
        return self.cost.seconds(step)


class _CallTables:
    """What each (node, walk) call of the plan answers, read once at start."""

    def __init__(self, plan: Plan):
        # (node, walk) -> output edge names (loop-backs on the device carry no value).
        self.out_names: dict[tuple[str, str], list[str]] = {}
        # (node, walk) -> the output edges the client takes as images, through a loop's exit too
        # (placeholders of that shape)
        self.image_names: dict[tuple[str, str], list[str]] = {}
        for walk in plan.walks:
            for node, name in image_outputs(walk):
                self.image_names.setdefault((node, walk.name), []).append(name)
        # (node, walk) of the calls that sample a token (a `tokens` or `transcript` output, as the
        # torch engine samples): the others count nothing toward max_tokens
        self.sampling: set[tuple[str, str]] = set()
        roles = {(node.name, out.name): out.role for node in plan.nodes for out in node.outputs}
        for walk in plan.walks:
            for call in walk.calls:
                if any(roles.get((call.node, edge.name)) in SAMPLED_ROLES for edge in call.edges):
                    self.sampling.add((call.node, walk.name))
                names = self.out_names.setdefault((call.node, walk.name), [])
                for edge in call.edges:
                    if not edge.is_device and edge.name not in names:
                        names.append(edge.name)
        # (node, walk) -> {tokens output: depth} where a depth model extends the sampled token into a
        # frame of 1 + depth codes, as the torch engine's one-item frame (a tuple here: counted and
        # streamed as one item of 1 + depth tokens)
        self.depth_frames: dict[tuple[str, str], dict[str, int]] = {
            (node.name, walk): frame_depths(node, walk)
            for node in plan.nodes for walk in {w for sub in node.submodels if sub.samples for w in sub.walks}}


def _placeholders(names: Sequence[str], value: int) -> dict[str, Any]:
    """A one-element list of `value` under each name (a list of its own per name)."""
    if len(names) == 1:
        return {names[0]: [value]}
    return {name: [value] for name in names}


def _frame(token: int, depth: int) -> tuple[int, ...]:
    """A frame of codes: the sampled placeholder, then `depth` more (placeholders too)."""
    return (token, *((token * 31 + k * 977) % SIM_VOCAB for k in range(1, depth + 1)))


def _with_images(outputs: dict[str, Any], images: Sequence[str]) -> dict[str, Any]:
    """The placeholders with each image output `SIM_IMAGE`."""
    for name in images:
        outputs[name] = SIM_IMAGE
    return outputs


def _prompt_tokens(row: StepRow, num: int) -> Optional[list[int]]:
    """The token ids a row feeds, when its input is a list of them (a prompt or its chunk)."""
    value = next(iter(row.inputs.values()), None) if len(row.inputs) == 1 else None
    if not isinstance(value, list) or not value or not isinstance(value[0], int):
        return None
    tokens = value[row.chunk_start:row.chunk_start + num]
    return tokens if len(tokens) == num else None
