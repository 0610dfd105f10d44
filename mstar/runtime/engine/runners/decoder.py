"""Runs the rows of one kv node's step: allocate KV pages and state slots, pack, forward, sample.

In: `(StepRow, CallInfo, RequestState)` triples of one step (rows may belong to different walks: a mixed step).
Out: a `RowResult` per row that ran or failed alone, and the ids of rows that could not get memory
(nothing ran for them; the scheduler holds and retries them).

Inputs per row, by the role the spec gives them (docs/language.md "Roles"; see docs/engine.md):
token-id values are embedded, embedding tensors (encoder output, hidden states of another LLM) are
added in (through a seeded adapter when their width is not the node's hidden), masks and signals
are ignored. On a node with a `media_token` argument, embedding tensors instead replace the
embeddings of the prompt positions holding that token id, in order (Qwen3-ASR's audio
placeholders; the counts must agree), as transformers' masked_scatter does. A call that takes
`flow_latents` is an image-flow step: latents and the `flow_time` input in, one Euler step of the
flow out; it reads the KV context without writing it. Outputs per edge, by the output's role:
`tokens` a sampled token id `[id]` (or, on an edge feeding a codec of Q > 1 quantizers, one frame:
a tensor of Q codes), `hidden` the hidden states of every token of the row (the last one when it
loops back to this node), `embeddings` the last token's hidden state (the next input embedding),
`mask` a bool tensor, `velocity` the flow velocity, `flow_latents` and `flow_time` the flow's next
latents and time index.

Guidance (BAGEL, see mstar/runtime/engine/runners/guidance.py): on a node with guidance sequences, a
guided request's writing rows extend the sequences their walk `writes` and its image-flow rows read
the walk's `reads`; each (row, sequence) pair is one segment of the packed step, and the flow rows'
velocities are combined into one. Other requests use the first sequence only.

Random parts (adapters, code heads, stand-in latents) are seeded by the node's position in the plan
and the input's or output's position on the node, never by a name.

Memory: pages are allocated per step by the admission policy shared with the simulated engine
(`kv/admission.py`); a row that cannot get pages or a slot does not run and is reported in
allocation_failed (the runtime holds it), while the other rows of the step run. A request starts on
the node only when the pages it may need (prompt + max_tokens, plus media and guidance sequences)
fit beside what already-started requests may still need, so running requests can always finish and
a full pool never deadlocks. The media part is the encoders' declared figure, an estimate, so a row
may pass that budget; one that could never get its pages (past the pool's) fails its request alone.
"""
from __future__ import annotations

import zlib
from dataclasses import dataclass
from functools import partial
from typing import Callable, Collection, Optional

import torch

from mstar.plan.guidance_mode import GuidanceRule
from mstar.plan.schema import NodePlan
from mstar.runtime.engine.attention.routes import RouteError
from mstar.runtime.engine.attention.torch_paged import Segment
from mstar.plan.dims import DecoderDims
from mstar.runtime.engine.runners.request_state import RequestState, output_tokens
from mstar.runtime.engine.runners.values import (InputError, RequestInputError, chunk_of, classify, classify_for_row,
                                                 failed_row, synthesise)
from mstar.runtime.engine.attention.flashinfer_paged import FlashInferAttention
from mstar.runtime.engine.runners.guidance import NodeGuidance, in_interval
from mstar.runtime.engine.kv.admission import Admission, PageNeed
from mstar.runtime.engine.kv.cache import KvCache
from mstar.runtime.engine.kv.claims import claim_cached_prefix
from mstar.runtime.engine.kv.host_cache import HostKv, page_tensors
from mstar.runtime.engine.kv.offload import Offload
from mstar.runtime.engine.kv.pages import PagePool
from mstar.runtime.engine.prompt_limits import logit_bias_problem, prompt_limit_problem, takes_text_prompt
from mstar.runtime.engine.prompt_logprobs import score_row
from mstar.runtime.engine.kv.slots import SlotPool
from mstar.runtime.engine.models.decoder import Decoder, DecoderBatch
from mstar.runtime.engine.models.depth import DepthModel
from mstar.runtime.engine.models.gdn import LinearStates
from mstar.runtime.engine.models.kinds import CallInfo
from mstar.runtime.engine.placement import CPU, Placement
from mstar.runtime.engine.sampling import SamplingParams, draw_stream, row_biases, sample_tokens, token_logprobs
from mstar.runtime.step import AheadChunks, RowResult, StepRow, TokenLogprobs, row_stop


@dataclass
class _Prepared:
    row: StepRow
    call: CallInfo
    request: RequestState
    embeds: torch.Tensor  # [T, hidden]
    tokens_fed: list[int]
    is_flow: bool = False
    latents: Optional[torch.Tensor] = None
    time_index: int = 0
    num_steps: int = 0  # a flow row: the steps its loop runs for this request (the flow's schedule)
    writes: tuple[str, ...] = ()  # KV sequences the row extends (none for a flow row or a read-only walk)
    reads: tuple[str, ...] = ()  # KV sequences a row that writes none attends over
    # a not-started request's page need, counted by `_room_problem` in this step before any grant
    # (the pool and the budgets are as admission then finds them): `_shortfall` takes it as is
    start_need: Optional[PageNeed] = None
    # it feeds a token the engine kept on the device (an on-device loop-back): its pages are not
    # keyed for the prefix cache, as on the GPU runner and the simulated engine (docs/runtime.md)
    is_token_kept: bool = False

    def keys(self) -> list[tuple[str, str]]:
        return [(self.row.request_id, label) for label in self.writes]


class DecoderRunner:
    # why this runner cannot compute a prompt's log-probabilities; None: it can (`_prompt_logprobs`)
    prompt_logprobs_refusal: Optional[str] = None
    # A step that raises leaves its requests as before it (`start` rewinds what the forward changed
    # of them; KV written again at the same positions is the same), so the run loop may run the
    # rows again (EngineCaps.rerun_nodes) where the node keeps no recurrent state.
    rewinds_failed_steps = True

    def __init__(self, node: NodePlan, dims: DecoderDims, model: Decoder, page_size: int, num_pages: int,
                 max_seq_len: int, slots: Optional[SlotPool], seed: int,
                 code_frames: Optional[dict[str, tuple[int, int]]] = None,
                 position: int = 0, placement: Placement = CPU,
                 flashinfer: Optional[FlashInferAttention] = None, prefix_cache: bool = False,
                 host_pages: int = 0, state_versions: int = 1):
        """code_frames: token edge name -> (quantizers, codebook) of the codec it feeds, for edges
        that carry whole frames of codes (Qwen3-Omni's Talker -> Code2Wav). position: the node's
        index in the plan (what its random parts are seeded by). placement: where the model runs (the KV
        cache and recurrent states are allocated there);
        flashinfer: the GPU attention backend, or None for the torch path. prefix_cache: share full
        pages between requests (the plan's KvPoolPlan.prefix_cache is "pages"). host_pages: the host
        pool KV offload moves pages to (KvPoolPlan.host_pages; 0: none). state_versions: copies of each
        recurrent state slot (2 for a runner that launches steps ahead: `LinearStates`)."""
        self.node = node
        self.dims = dims
        self.model = model
        # walk -> the sub-model its rows run (engine/submodels.py); other walks run `model`
        self.models_by_walk: dict[str, Decoder] = {}
        # walk -> tokens output -> the depth model that extends the token sampled for it (models/depth.py)
        self.depth_by_walk: dict[str, dict[str, DepthModel]] = {}
        self.max_seq_len = max_seq_len
        self.seed = seed
        self.pool = PagePool(num_pages, page_size, prefix_cache)
        self.claimed: dict[str, int] = {}  # request -> cached pages its first sequence started on
        self.cache = self._new_cache(dims, placement)
        self.flashinfer = flashinfer
        self.offload = Offload(host_pages) if host_pages else None
        self.host = HostKv(host_pages, self._page_tensors()) if host_pages else None
        self.can_run_ahead = False  # `prelaunch` launches nothing here (gpu/runner.py's can)
        # the walks giving prompt log-probabilities (prompt_logprobs.py; set by the engine on the one node
        # that gives them) and the live requests asking for them (empty: a step looks no further)
        self.prompt_logprob_walks: frozenset[str] = frozenset()
        self.scoring: set[str] = set()
        # the rows of the step being started: KV offload never moves their requests out, even where
        # admission is asked about a part of the step only (gpu/runner.py, decode_columns.py)
        self.step_rows: list[tuple[StepRow, CallInfo, RequestState]] = []
        self.slots = slots
        self.states = (LinearStates.for_dims(dims, slots.num_slots, placement.device, versions=state_versions)
                       if slots else None)
        self.stop_tokens = _node_stop_tokens(node)
        media_token = node.dims.get("media_token")  # embeddings replace these prompt positions
        self.media_token = media_token if isinstance(media_token, int) and not isinstance(media_token, bool) else None
        self.admission = Admission(self.pool.num_pages)  # the start budgets over this node's pages (kv/admission.py)
        self._adapters: dict[tuple[str, int, int], torch.Tensor] = {}  # (input, width, model width)
        self.code_frames = code_frames or {}
        self.num_media_tokens = 0  # tokens the encoders feeding this node emit per request (set by the engine)
        self._code_heads: dict[tuple[str, int], torch.Tensor] = {}  # (output, model width)
        self.position = position
        self.input_positions = {r.name: i for i, r in enumerate(node.input_roles)}
        self.output_positions = {o.name: i for i, o in enumerate(node.outputs)}
        self.takes_text_prompt = takes_text_prompt(node)
        self.bidirectional_walks = frozenset(node.bidirectional_walks)
        self.guidance = NodeGuidance.of(node)
        self.guidance_rule = GuidanceRule.of(node)  # the plan's rule: the scheduler keys captures on it too
        self.has_guidance = bool(self.guidance.labels) and not dims.has_linear_layers
        # the running step's (set by `run`)
        self._route = "packed"
        self._step_bucket: tuple[Optional[str], int] = (None, 0)  # the latest step's (capture, token bucket)
        self._decode_walks: frozenset[str] = frozenset()

    def _new_cache(self, dims: DecoderDims, placement: Placement) -> KvCache:
        """The node's KV tensors (the GPU fast path's runner lays them out its own way)."""
        return KvCache(self.pool, dims.num_full_layers, dims.num_kv_heads, dims.head_dim,
                       dtype=placement.kv_dtype, device=placement.device)

    def _page_tensors(self) -> list[torch.Tensor]:
        """The KV cache as page-major tensors, what KV offload copies (kv/host_cache.py)."""
        return page_tensors(self.cache)

    def attention_backend(self) -> str:
        """The attention backend this node's steps use where they can (for the report)."""
        return "flashinfer" if self.flashinfer is not None else "torch"

    # ------------------------------------------------------------------ requests

    def _budget_tokens(self, request: RequestState) -> int:
        return len(request.prompt_tokens) + (request.params.max_tokens or 0)

    def is_guided(self, request: RequestState) -> bool:
        """Whether the request keeps the three guidance sequences here (guidance.py's rule)."""
        return self.has_guidance and self.guidance_rule.requires(request.guidance.scales, request.route_walks)

    def _needed_pages(self, request: RequestState) -> int:
        """Pages a request may need here: its text plus the media tokens encoders may feed in;
        when guided also each guidance sequence (the media for one that drops the text, the text
        for one that drops the media)."""
        text, media = self._budget_tokens(request), self.num_media_tokens
        pages = self.pool.pages_for(text + media)
        if self.is_guided(request):
            for guidance in self.node.guidance:
                pages += self.pool.pages_for(media if guidance.drops == "text" else text)
        return pages

    def start_budget_pages(self, request: RequestState) -> int:
        """Pages the admission policy reserves when the request starts on this node (less those of
        a cached prefix it holds already)."""
        return min(self._needed_pages(request), self.pool.num_pages) - self.claimed.get(request.request_id, 0)

    def claim_prefix(self, request: RequestState, tokens: list[int]) -> int:
        """Start the request's first sequence on the cached pages of its prompt's longest cached
        prefix (kv/pages.py; never pages that started requests may still claim); the tokens they
        hold join its history as if fed."""
        if self.pool.cache is None or self.admission.is_started(request.request_id):
            return 0
        key = (request.request_id, self.guidance.first)
        num_cached = claim_cached_prefix(self.admission, self.pool, key, tokens, self.media_token)
        self.claimed[request.request_id] = self.pool.pages_for(num_cached)
        request.history.setdefault(self.node.name, []).extend(tokens[:num_cached])
        self.admission.join(request.request_id, self.start_budget_pages(request),
                            self.pool.page_table(key) if num_cached else None)
        return num_cached

    def refusal(self, request: RequestState) -> Optional[str]:
        """Why the request can never run on this node, or None when it can."""
        vocab = self.node.dims.get("vocab", 0)
        problem = (prompt_limit_problem(self.node.name, vocab, self.takes_text_prompt, request.prompt_tokens,
                                        request.params.max_tokens, self.max_seq_len)
                   or logit_bias_problem(self.node.name, vocab, self.takes_text_prompt, request.params.logit_bias))
        if problem is not None:
            return problem
        num_tokens = self._budget_tokens(request)
        num_pages = self.pool.pages_for(num_tokens)
        if num_pages > self.pool.num_pages:
            return (f"can never fit: node {self.node.name}: prompt ({len(request.prompt_tokens)}) + max_tokens "
                    f"({request.params.max_tokens}) = {num_tokens} tokens need {num_pages} KV pages of "
                    f"{self.pool.page_size} but the pool has only {self.pool.num_pages}")
        if self.is_guided(request) and self._needed_pages(request) > self.pool.num_pages:
            labels = ", ".join(self.guidance.labels)
            return (f"can never fit: node {self.node.name}: with guidance the request keeps "
                    f"{1 + len(self.guidance.labels)} KV sequences ({self._needed_pages(request)} pages of "
                    f"{self.pool.page_size}) but the pool has only {self.pool.num_pages}; lower max_tokens, or set "
                    f"the guidance scales ({labels}) to 1")
        return None

    def end_request(self, request_id: str) -> None:
        self.pool.free_request(request_id)
        if self.offload is not None:
            self.offload.forget(request_id)
        self.claimed.pop(request_id, None)
        self.scoring.discard(request_id)
        self.admission.release(request_id)
        if self.slots:
            self.slots.release(request_id)

    # ------------------------------------------------------------------ a step

    def run(self, rows: list[tuple[StepRow, CallInfo, RequestState]], is_partial_ok: bool = False,
            route: str = "packed", decode_walks: frozenset[str] = frozenset()) -> tuple[list[RowResult], list[str]]:
        """With `is_partial_ok` (the engines' default) the rows that got memory run and only the
        others are reported failed; the driver holds those and post-processes the rest. Without
        it, all or nothing: when any row cannot get memory, nothing runs. `route` is the step's
        attention route from the plan (attention/routes.py); `decode_walks` the walks whose rows
        a `split` step attends on decode kernels."""
        results, failed, finish = self.start(rows, is_partial_ok, route, decode_walks)
        return results + finish(), failed

    def start(self, rows: list[tuple[StepRow, CallInfo, RequestState]], is_partial_ok: bool = False,
              route: str = "packed", decode_walks: frozenset[str] = frozenset(), worker: int = 0,
              bucket: tuple[Optional[str], int] = (None, 0),
              ) -> tuple[list[RowResult], list[str], Callable[[], list[RowResult]]]:
        """`run` split at the device: (results known now, rows short of memory, finish), where
        `finish()` waits for the rows that ran and returns their results. Here the forward runs
        at once; a runner whose device runs ahead of the host (gpu/runner.py) returns before.
        bucket: the step's capture family and token bucket from the plan (`Step.capture`,
        `Step.token_bucket`); a runner with packed graphs replays them (gpu/runner.py)."""
        self.step_rows = rows
        results, ready = self._items(rows)
        long = next((item for item in ready if item.embeds.shape[0] != 1), None) if route == "decode" else None
        if long is not None:
            raise RouteError(f"node {self.node.name}: attention route decode takes one token a row, but "
                             f"request {long.row.request_id} feeds {long.embeds.shape[0]}")
        self._route, self._decode_walks, self._step_bucket = route, decode_walks, bucket
        on_host: list[str] = []
        if self.offload is not None:
            self.note_step(rows)
            on_host = self._move_back(ready)
        asked = self._within_length(ready, results, on_host)
        ready, failed = self._admit(asked, on_host, is_partial_ok)
        if failed and not is_partial_ok:
            return results, failed, list  # nothing ran: the run loop holds the whole step
        if failed:
            failed = self._past_pool(asked, failed, results)
        return results, failed, self._start_rewound(ready, worker) if ready else list

    def _start_rewound(self, ready: list[_Prepared], worker: int) -> Callable[[], list[RowResult]]:
        """`_start_forward`, its requests put back as they were when it raises (RequestState.rewind):
        rows run again after a failed step then feed and sample as if it had never run."""
        node = self.node.name
        marks = [(item.request, item.request.mark(node)) for item in ready]
        try:
            return self._start_forward(ready, worker)
        except Exception:
            for request, mark in reversed(marks):
                request.rewind(node, mark)
            raise

    def _items(self, rows: list[tuple[StepRow, CallInfo, RequestState]]) -> tuple[list[RowResult], list[_Prepared]]:
        """Each row's item, in step order, and an error result for each row whose inputs the node
        cannot take (it does not run)."""
        results: list[RowResult] = []
        ready: list[_Prepared] = []
        for row, call, request in rows:
            try:
                ready.append(self._prepare(row, call, request))
            except InputError as error:
                results.append(failed_row(row.request_id, self.node.name, error))
        return results, ready

    def _within_length(self, ready: list[_Prepared], results: list[RowResult],
                       on_host: Collection[str] = ()) -> list[_Prepared]:
        """The items that fit max_seq_len and could start their request, less the rows whose pages
        stay on the host; an error result joins `results` for each of the others."""
        kept: list[_Prepared] = []
        for item in ready:
            if item.row.request_id in on_host:
                continue
            problem = self._length_problem(item) or self._room_problem(item)
            if problem:
                results.append(RowResult(item.row.request_id, error=problem))
            else:
                kept.append(item)
        return kept

    def _room_problem(self, item: _Prepared) -> Optional[str]:
        """Why the row can never start its request, or None: it adds more pages than the request's
        budget, past the room the admission policy keeps for it (`Admission.outgrows_room`: held,
        it and a younger request could each wait on the other's prefix claim forever)."""
        if self.admission.is_started(item.row.request_id):
            return None
        need = item.start_need = self._page_needs([item])[0]
        if not self.admission.outgrows_room(need):
            return None
        return (f"node {self.node.name}: the request's first row adds {need.num_pages} KV pages, past its budget "
                f"of {need.budget_pages} (its prompt, max_tokens and the node's declared media tokens), more than "
                f"the pool of {self.pool.num_pages} can keep for it beside the pages the waiting requests' prefix "
                f"claims hold")

    def _past_pool(self, asked: list[_Prepared], short: list[str], results: list[RowResult]) -> list[str]:
        """`short` less the rows of started requests that can never get their pages: the request's
        sequences would hold more pages than the pool has. Its budget was cut to the pool, the
        declared media tokens only an estimate (docs/runtime.md "Admission"), and its rows fed more;
        held, it waited until the run loop called it stalled (30 s, the pool held all the while).
        An error result joins `results` for each, so that request ends alone now."""
        is_short = set(short)
        for item in asked:
            request_id = item.row.request_id
            if request_id not in is_short or not self.admission.is_started(request_id):
                continue
            num_pages = self.pool.num_pages_held(request_id) + self._page_needs([item])[0].num_pages
            if num_pages > self.pool.num_pages:
                is_short.discard(request_id)
                results.append(RowResult(request_id, error=(
                    f"node {self.node.name}: the request's KV sequences would grow to {num_pages} pages of "
                    f"{self.pool.page_size} tokens, past the pool's {self.pool.num_pages}: its rows fed more tokens "
                    f"than its start budget of {self.admission.budgets[request_id]} pages counted (its prompt, "
                    f"max_tokens and the node's declared media tokens, cut to the pool)")))
        return [request_id for request_id in short if request_id in is_short]

    def _admit(self, ready: list[_Prepared], on_host: list[str],
               is_partial_ok: bool) -> tuple[list[_Prepared], list[str]]:
        """The rows the admission policy lets run, their pages and slots granted, and the ids of
        the rows short of memory (`on_host` first). Without `is_partial_ok`, when any row is short
        nothing is granted and no row runs."""
        needs, failed = self._shortfall(ready)
        failed = on_host + failed
        if failed and not is_partial_ok:
            return [], failed
        granted = [(item, need) for item, need in zip(ready, needs) if need.request_id not in failed]
        self._grant(granted)
        return [item for item, _ in granted], failed

    def _start_forward(self, ready: list[_Prepared], worker: int = 0) -> Callable[[], list[RowResult]]:
        """The forward of the granted rows (of `worker`'s step); returns what waits for their results."""
        ran: list[RowResult] = []
        for model in dict.fromkeys(self.model_of(item.row.walk) for item in ready):
            # rows of one model at a time (a node with sub-models runs each on its own weights)
            ran.extend(self._forward([item for item in ready if self.model_of(item.row.walk) is model], model))
        return lambda: ran

    def prelaunch(self, worker: int, rows: list[tuple[str, str, CallInfo, RequestState]],
                  chunks: Optional[AheadChunks] = None, decode_walks: frozenset[str] = frozenset()) -> None:
        """Launch `worker`'s next step ahead for these (request id, walk) rows: this runner's
        forward runs when its step is launched, so it has nothing to run ahead (gpu/runner.py does)."""

    def _shortfall(self, ready: list[_Prepared]) -> tuple[list[PageNeed], list[str]]:
        """The rows' page needs, and the rows short of memory after moving other started requests
        to the host pool when the plan gives one (kv/offload.py). A row whose need `_room_problem`
        counted keeps it: a need reads only the pool and the budgets, which no grant changed since."""
        uncounted = [item for item in ready if item.start_need is None]
        needs = self._page_needs(uncounted)
        if len(uncounted) < len(ready):
            counted = iter(needs)
            needs = [next(counted) if item.start_need is None else item.start_need for item in ready]
        failed = self.refused(needs)
        movable = (self.admission.startable_by_pages(needs, failed, self._num_free_slots())
                   if failed and self.offload is not None else [])
        if movable and self._move_out(self._step_ids(ready), needs, movable):
            failed = self.refused(needs)
        return needs, failed

    def refused(self, needs: list[PageNeed]) -> list[str]:
        """The requests of `needs` the admission policy refuses with the pages and state slots free now."""
        return self.admission.shortfall(needs, self.pool.num_free_pages, self._num_free_slots())

    def _num_free_slots(self) -> int:
        return self.slots.num_free_slots if self.slots else 0

    def _step_ids(self, ready: list[_Prepared]) -> set[str]:
        """The requests with a row in the step being started (`step_rows`) or among `ready`."""
        return {row.request_id for row, _, _ in self.step_rows} | {item.row.request_id for item in ready}

    def note_step(self, rows: list[tuple[StepRow, CallInfo, RequestState]]) -> None:
        """The step's requests ran last now: the host pool's victims are the least recently run
        (kv/offload.py), as the simulated engine chooses them (it was never told here, and moved out
        the request with the most pages, one that had just run)."""
        assert self.offload is not None
        self.offload.note_step([row.request_id for row, _, _ in rows])

    def _move_out(self, step_ids: set[str], needs: list[PageNeed], short: list[str]) -> bool:
        """Copy the pages of started requests with no row in this step to the host pool and free
        them, until the short rows' pages fit; True when any moved."""
        assert self.offload is not None and self.host is not None
        return self.offload.move_out(self.pool, self.admission, self.claimed, step_ids, needs, short,
                                     self.host.copy_out) > 0

    def _move_back(self, ready: list[_Prepared]) -> list[str]:
        """Rows of requests whose pages are on the host: copied back to fresh device pages when the
        request's budget fits (it starts again), else left there (short: held and retried)."""
        assert self.offload is not None and self.host is not None
        on_host = []
        for item in ready:
            request_id = item.row.request_id
            if not self.offload.is_offloaded(request_id):
                continue
            num_pages = sum(len(s.host_pages) for s in self.offload.offloaded[request_id])
            need = PageNeed(request_id, num_pages, self.start_budget_pages(item.request))
            if self.admission.shortfall([need], self.pool.num_free_pages):
                on_host.append(request_id)
                continue
            self.admission.grant(need)
            for seq in self.offload.restore(request_id):
                key = (request_id, seq.label)
                if not self.pool.restore(key, seq.num_tokens):
                    raise RuntimeError(f"KV pages vanished between the check and the move back of {request_id}")
                self.host.copy_in(seq.host_pages, self.pool.page_table(key))
        return on_host

    def model_of(self, walk: str) -> Decoder:
        """The model a walk's rows run: its sub-model, else the node's."""
        return self.models_by_walk.get(walk, self.model)

    def _prepare(self, row: StepRow, call: CallInfo, request: RequestState) -> _Prepared:
        if call.is_image_flow:
            return self._prepare_flow(row, call, request)
        model = self.model_of(row.walk)
        parts: list[torch.Tensor] = []
        tokens_fed: list[int] = []
        states: list[torch.Tensor] = []  # media states for the prompt's placeholders (`media_token`)
        prompt: Optional[tuple[int, torch.Tensor]] = None  # (index in parts, the whole prompt's ids)
        is_token_kept = False
        for name in call.inputs:
            raw = row.inputs.get(name)
            if raw is None and name in self._device_loop_backs(call):
                # An on-device loop-back the conductor never saw: the engine kept the token.
                raw, is_token_kept = request.last_token.get(self.node.name), True
            if call.input_roles.get(name) in ("mask", "signal"):
                continue  # read by no model here
            value = classify_for_row(row, request.cut_inputs, self.node.name, name, raw)
            if value.tensor is None:
                continue  # a signal: no model input
            if value.kind == "tokens":
                tokens = chunk_of(value.tensor, row)
                prompt = (len(parts), value.tensor)
                parts.append(model.embed_tokens(tokens))
                tokens_fed.extend(tokens.tolist())
            elif value.kind == "embeddings" and self.media_token is not None:
                states.append(self._adapt(name, value.tensor, model.dims.hidden))
            elif value.kind == "embeddings":
                parts.append(self._adapt(name, chunk_of(value.tensor, row), model.dims.hidden))
        if states:
            if prompt is None:
                raise InputError(f"media states arrive without a prompt to place them in (media_token "
                                 f"{self.media_token})")
            parts[prompt[0]] = chunk_of(self._splice(model, prompt[1], torch.cat(states)), row)
        num_tokens = max((p.shape[0] for p in parts), default=1)
        embeds = torch.zeros(num_tokens, model.dims.hidden)
        for part in parts:
            embeds[:part.shape[0]] += part
        is_guided = self.is_guided(request)
        # what the row feeds: text (token ids), media (embeddings: an image's or audio's states)
        is_media_fed = bool(states) or len(parts) > (prompt is not None)
        fed = frozenset((["text"] if tokens_fed else []) + (["image", "audio"] if is_media_fed else []))
        writes = self.guidance.written(row.walk, is_guided, fed)
        reads = () if writes else self.guidance.read(row.walk, is_guided)  # a read-only KV walk
        return _Prepared(row, call, request, embeds, tokens_fed, writes=writes, reads=reads,
                         is_token_kept=is_token_kept)

    def _prepare_flow(self, row: StepRow, call: CallInfo, request: RequestState) -> _Prepared:
        if self.dims.has_linear_layers:
            raise InputError("image flow steps on a node with linear-attention layers are not supported")
        model = self.model_of(row.walk)  # a sub-model may have latents of its own size
        shape = (model.dims.latent_tokens, model.dims.latent_channels)
        latents_input, time_input = call.input_with("flow_latents"), call.input_with("flow_time")
        value = classify(latents_input or "", row.inputs.get(latents_input or ""))
        if value.kind == "signal":
            latents = synthesise(request.params.seed, self.position, self.input_positions.get(latents_input or "", 0),
                                 shape)
        elif value.kind == "embeddings" and value.tensor is not None and tuple(value.tensor.shape) == shape:
            latents = value.tensor
        else:
            raise InputError(f"latents must be a float tensor of shape {shape}")
        time_index = _as_int(row.inputs.get(time_input) if time_input else None, row.loop_iter)
        # The request's own loop count (`count=`), else the loop's maximum, sets the schedule.
        num_steps = row.loop_count or call.loop_max_iters
        embeds = model.embed_latents(latents, time_index, num_steps)
        return _Prepared(row, call, request, embeds, [], is_flow=True, latents=latents, time_index=time_index,
                         num_steps=num_steps, writes=(), reads=self.guidance.read(row.walk, self.is_guided(request)))

    def _splice(self, model: Decoder, prompt: torch.Tensor, states: torch.Tensor) -> torch.Tensor:
        """The whole prompt's embeddings with its `media_token` positions replaced, in order, by
        `states` (as transformers' masked_scatter places Qwen3-ASR's audio); the counts must agree."""
        assert self.media_token is not None  # called only on a node with one
        is_slot = torch.eq(prompt, self.media_token)
        num_slots = int(is_slot.sum())
        if num_slots != states.shape[0]:
            raise RequestInputError(f"the prompt holds {num_slots} media placeholders (token {self.media_token}), "
                                    f"the media bring {states.shape[0]} states")
        embeds = model.embed_tokens(prompt).clone()
        embeds[is_slot.to(embeds.device)] = states.to(embeds.device, embeds.dtype)  # the encoder may run elsewhere
        return embeds

    def _adapt(self, name: str, embeds: torch.Tensor, hidden: int) -> torch.Tensor:
        """Embeddings of another width are mapped to `hidden` (the width of the model the row runs:
        the node's or a sub-model's) by a fixed seeded projection."""
        width = embeds.shape[1]
        if width == hidden:
            return embeds
        key = (name, width, hidden)
        if key not in self._adapters:
            seed = zlib.crc32(f"{self.seed}/{self.position}/in{self.input_positions.get(name, 0)}/{width}".encode())
            generator = torch.Generator().manual_seed(seed)
            self._adapters[key] = torch.randn(hidden, width, generator=generator) * width ** -0.5
        return embeds @ self._adapters[key].T

    def _num_new(self, item: _Prepared) -> int:
        """Positions the row writes (an image-flow row or a read-only walk's row reads only)."""
        return item.embeds.shape[0] if item.writes else 0

    def _length_problem(self, item: _Prepared) -> Optional[str]:
        for key in item.keys():
            length = self.pool.num_tokens(key) + self._num_new(item)
            if length > self.max_seq_len:
                return (f"node {self.node.name}: sequence {key[1]} would grow to {length} tokens, past "
                        f"max_seq_len {self.max_seq_len}")
        return None

    def _page_needs(self, ready: list[_Prepared]) -> list[PageNeed]:
        """Per row: the pages its sequences gain this step, its request's start budget, whether it
        still needs a recurrent state slot (the admission policy decides, kv/admission.py)."""
        needs = []
        for item in ready:
            request_id = item.row.request_id
            num_pages = sum(self.pool.num_new_pages(key, self._num_new(item)) for key in item.keys())
            budget = 0 if self.admission.is_started(request_id) else self.start_budget_pages(item.request)
            needs_slot = self.slots is not None and self.slots.slot_of(request_id) is None
            needs.append(PageNeed(request_id, num_pages, budget, needs_slot))
        return needs

    def _grant(self, granted: list[tuple[_Prepared, PageNeed]]) -> None:
        """Reserve pages and slots for rows the admission policy cleared."""
        for item, need in granted:
            request_id = item.row.request_id
            self.admission.grant(need)
            is_reserved = all(self.pool.reserve(key, self._num_new(item)) for key in item.keys())
            if not is_reserved:
                raise RuntimeError(f"KV pages vanished between the check and the grant for {request_id}")
            if need.needs_slot:
                assert self.slots is not None and self.states is not None, "only a node with linear layers needs slots"
                slot = self.slots.acquire(request_id)
                if slot is None:
                    raise RuntimeError(f"a state slot vanished between the check and the grant for {request_id}")
                self.states.clear(slot)

    def _forward(self, ready: list[_Prepared], model: Decoder) -> list[RowResult]:
        """One packed forward: a segment per (row, KV sequence) it writes or reads; the first
        segment of each row (its `main` one) gives its outputs."""
        segments, bounds, positions, slots, embeds, tables = [], [], [], [], [], []
        spans: list[dict[str, tuple[int, int]]] = []  # per item: sequence label -> token span
        start = 0
        for item in ready:
            num_tokens = item.embeds.shape[0]
            spans.append({})
            for label in item.writes or item.reads:
                key = (item.row.request_id, label)
                num_cached = self.pool.num_tokens(key)
                num_positions = num_cached + (num_tokens if item.writes else 0)
                table = self.pool.page_table(key)
                flat = self.cache.flat_positions(table, num_positions)
                tables.append(table)
                is_causal = not item.is_flow and item.row.walk not in self.bidirectional_walks
                segments.append(Segment(start, num_tokens, num_cached, flat, is_causal=is_causal,
                                        is_write=bool(item.writes), is_decode=item.row.walk in self._decode_walks))
                bounds.append((start, start + num_tokens))
                positions.append(torch.arange(num_cached, num_cached + num_tokens))
                slot = self.slots.slot_of(item.row.request_id) if self.slots else 0
                assert slot is not None, "a row granted to a node with linear layers holds a slot"
                slots.append(slot)
                embeds.append(item.embeds)
                spans[-1][label] = (start, start + num_tokens)
                start += num_tokens
        batch = DecoderBatch(torch.cat(positions), bounds, segments, slots, route=self._route)
        if self.flashinfer is not None and all(s.is_causal and s.is_write for s in segments):
            rows = [(s.num_tokens, s.num_cached, table) for s, table in zip(segments, tables)]
            new_index = torch.cat([s.flat_index[s.num_cached:] for s in segments])
            batch.attend = self.flashinfer.plan_step(rows, new_index, self.dims.head_dim ** -0.5)
        with torch.no_grad():
            hidden = model(torch.cat(embeds), batch, self.cache, self.states)
            mains, velocities = [], []
            for item, span in zip(ready, spans):
                first = span.get(self.guidance.first) or next(iter(span.values()))
                mains.append(hidden[slice(*first)])
                velocities.append(self._flow_velocity(item, {label: hidden[slice(*s)] for label, s in span.items()}))
            tokens, logprobs = self._sample(ready, mains, model)
            frames = [self._depth_frames(item, main, token, model) for item, main, token in zip(ready, mains, tokens)]
            results = [RowResult(item.row.request_id) if item.row.is_partial  # a chunk before the last: KV only
                       else self._outputs(item, self._whole_prompt(item, main), velocity, token, frame)
                       for item, main, velocity, token, frame in zip(ready, mains, velocities, tokens, frames)]
            for index, row_logprobs in logprobs.items():
                results[index].logprobs = row_logprobs
            if self.scoring:
                self._prompt_logprobs(ready, mains, results, model)
            for item, main in zip(ready, mains):
                if item.row.is_partial and self._sends_per_position(item.call):
                    item.request.cut_hidden.setdefault(self.node.name, []).append(main.clone())
        for item in ready:
            num_new = item.embeds.shape[0]
            # fed tokens key the pages for the prefix cache; a sub-model's KV is not the node's model's,
            # so its pages are never shared
            fed = (item.tokens_fed if len(item.tokens_fed) == num_new and model is self.model and not item.is_token_kept
                   else None)
            for key in item.keys():
                self.pool.commit(key, num_new, fed)
        return results

    def _prompt_logprobs(self, ready: list[_Prepared], mains: list[torch.Tensor], results: list[RowResult],
                         model: Decoder) -> None:
        """The prompt log-probabilities of the rows that feed a prompt (or a chunk of one) for a
        request that asks for them (prompt_logprobs.py); a chunk's tail waits on the request."""
        for item, main, result in zip(ready, mains, results):
            if (item.request.params.prompt_logprobs is not None and item.row.walk in self.prompt_logprob_walks
                    and not item.is_flow):
                result.prompt_logprobs = score_row(model.logits, main, item.tokens_fed, item.request, self.node.name,
                                                   item.row.is_partial)

    def _flow_velocity(self, item: _Prepared, hidden: dict[str, torch.Tensor]) -> Optional[torch.Tensor]:
        """A flow row's velocity: the first sequence's, or the guided combination inside the interval."""
        if not item.is_flow:
            return None
        first = self.guidance.first if self.guidance.first in hidden else next(iter(hidden))
        model = self.model_of(item.row.walk)
        v_first = model.velocity(hidden[first])
        if len(hidden) == 1 or not in_interval(item.time_index, item.num_steps):
            return v_first
        velocities = {label: model.velocity(h) for label, h in hidden.items() if label != first}
        velocities[first] = v_first
        return self.guidance.combine(velocities, item.request.guidance)

    def _sample(self, ready: list[_Prepared], mains: list[torch.Tensor],
                model: Decoder) -> tuple[list[Optional[int]], dict[int, TokenLogprobs]]:
        """Each row's fed tokens join its history; the rows with a tokens output get a token from
        one batched sampling call over their last hidden states (None for the other rows), and
        those whose request asks for log-probabilities of a token the call sends as text get them
        (by index in `ready`)."""
        node = self.node.name
        picked = []
        for index, item in enumerate(ready):
            item.request.history.setdefault(node, []).extend(item.tokens_fed)
            roles = (item.call.output_roles.get(name, "tokens") for name in item.call.output_names)
            if not item.is_flow and not item.row.is_partial and "tokens" in roles:
                picked.append(index)
        tokens: list[Optional[int]] = [None] * len(ready)
        if not picked:
            return tokens, {}
        requests = [ready[i].request for i in picked]
        logits = model.logits(torch.cat([mains[i][-1:] for i in picked]))
        sampled = sample_tokens(
            logits, [r.params for r in requests],
            [torch.tensor(r.history[node], dtype=torch.long) for r in requests],
            [draw_stream(r.params.seed, self.position) for r in requests],
            [r.num_sampled.get(node, 0) for r in requests], output_tokens(requests, node),
            _biases(ready, picked, node, self.stop_tokens))
        for index, token in zip(picked, sampled):
            tokens[index] = token
        return tokens, _logprobs_of(ready, picked, logits, sampled)

    def _depth_frames(self, item: _Prepared, hidden: torch.Tensor, token: Optional[int],
                      model: Decoder) -> dict[str, torch.Tensor]:
        """Per tokens output with a depth model on the row's walk: the frame, the sampled token then
        the depth model's tokens (codebook 0 from the node, the others from the depth model), as
        the node's output value `[1 + depth]`. Each inner token is drawn from the request's
        sampling settings on a stream of its own (the node's position and the output's), at step
        frame * depth + k, so the draws stay batch-invariant."""
        depth_models = self.depth_by_walk.get(item.row.walk)
        if token is None or not depth_models or item.row.is_partial:
            return {}
        request, frames = item.request, {}
        frame_index = request.num_sampled.get(self.node.name, 0)
        first = model.embed_tokens(torch.tensor([token], device=hidden.device))[0]
        for name, depth in depth_models.items():
            if name not in item.call.output_names:
                continue
            output = self.output_positions.get(name, 0)
            stream = zlib.crc32(f"{request.params.seed}/{self.position}/depth{output}".encode())
            pick = partial(_pick_inner, request.params, stream, frame_index * depth.dims.depth)
            frames[name] = torch.tensor([token] + depth.generate(hidden[-1], first, pick))
        return frames

    def _outputs(self, item: _Prepared, hidden: torch.Tensor, velocity: Optional[torch.Tensor],
                 token: Optional[int], frames: Optional[dict[str, torch.Tensor]] = None) -> RowResult:
        node, request = self.node.name, item.request
        result = RowResult(item.row.request_id)
        roles = {name: item.call.output_roles.get(name, "tokens") for name in item.call.output_names}
        if token is not None:
            num_sampled = request.count_sampled(node, token)
            request.last_token[node] = [token]
            node_stops = frozenset() if request.params.ignore_eos and item.call.sends_text_tokens else self.stop_tokens
            result.is_stop, result.is_length = row_stop(token, request.params.stop_tokens, node_stops,
                                                        num_sampled, request.params.max_tokens)
        for name, role in roles.items():
            if role == "tokens":
                if token is not None and frames and name in frames:
                    result.outputs[name] = frames[name]
                elif token is not None and name in self.code_frames:
                    result.outputs[name] = self._code_frame(name, token, hidden[-1])
                elif token is not None:
                    result.outputs[name] = [token]
            elif role == "flow_latents" and item.is_flow and item.latents is not None and velocity is not None:
                result.outputs[name] = item.latents + velocity / max(item.num_steps, 1)
            elif role == "flow_time":
                result.outputs[name] = item.time_index + 1
            elif role == "mask":
                result.outputs[name] = torch.ones(hidden.shape[0], dtype=torch.bool)
            elif role == "velocity" and item.is_flow:
                result.outputs[name] = velocity
            else:  # hidden states (a flow output on a row that runs no flow gives them too)
                is_last_only = role == "embeddings" or self._is_self_loop(item.call, name)
                result.outputs[name] = hidden[-1:].clone() if is_last_only else hidden.clone()
        return result

    def _code_frame(self, name: str, token: int, last_hidden: torch.Tensor) -> torch.Tensor:
        """One frame of codes: the sampled token, then one greedy code per further quantizer from a
        fixed seeded head (a stand-in for Qwen3-Omni's code predictor). One stream item."""
        num_quantizers, codebook = self.code_frames[name]
        hidden = last_hidden.shape[0]  # the node's width, or its sub-model's
        key = (name, hidden)
        if key not in self._code_heads:
            seed = zlib.crc32(f"{self.seed}/{self.position}/out{self.output_positions.get(name, 0)}/code_head".encode())
            generator = torch.Generator().manual_seed(seed)
            self._code_heads[key] = torch.randn((num_quantizers - 1) * codebook, hidden,
                                                generator=generator) * hidden ** -0.5
        scores = (self._code_heads[key] @ last_hidden).view(num_quantizers - 1, codebook)
        return torch.cat([torch.tensor([token]), scores.argmax(-1)])

    def _device_loop_backs(self, call: CallInfo) -> set[str]:
        return {e.name for e in call.edges if e.is_device and e.is_loop_back and e.dest == self.node.name}

    def _sends_per_position(self, call: CallInfo) -> bool:
        """Whether the call sends a value per fed position (`_outputs`: hidden states that do not
        loop back into this node, a mask), which a prompt cut into chunks must send for every chunk."""
        return any((role == "hidden" and not self._is_self_loop(call, name)) or role == "mask"
                   for name, role in ((n, call.output_roles.get(n, "tokens")) for n in call.output_names))

    def _whole_prompt(self, item: _Prepared, hidden: torch.Tensor) -> torch.Tensor:
        """A row's hidden states for its outputs: on the last chunk of a cut prompt, those of the
        chunks before it (kept by `_forward`) then its own, so a per-position output covers every
        prompt position as one uncut step's does; the row's own otherwise."""
        pieces = item.request.cut_hidden.pop(self.node.name, None)
        return torch.cat([*pieces, hidden]) if pieces else hidden

    def _is_self_loop(self, call: CallInfo, name: str) -> bool:
        return any(e.name == name and e.dest_kind == "node" and e.dest == self.node.name for e in call.edges)


def _biases(ready: list[_Prepared], picked: list[int], node: str,
            node_stops: frozenset[int]) -> Optional[list[tuple[tuple[int, float], ...]]]:
    """The picked rows' additions to their logits (`sampling.row_biases`: the logit bias, min_tokens'
    stop masks), where their calls send the token to the client as text (the tokens the biases'
    ids name); None when no such row has any."""
    if not any(ready[index].request.has_biases for index in picked):
        return None
    return [row_biases(item.request.params, item.request.num_sampled.get(node, 0), node_stops)
            if item.call.sends_text_tokens else () for item in (ready[index] for index in picked)]


def _logprobs_of(ready: list[_Prepared], picked: list[int], logits: torch.Tensor,
                 sampled: list[int]) -> dict[int, TokenLogprobs]:
    """The TokenLogprobs of the picked rows (`logits`' rows, in order) whose request asks for them
    and whose call sends the token to the client as text, by index in `ready`."""
    wanted = [(at, index) for at, index in enumerate(picked)
              if ready[index].request.params.logprobs is not None and ready[index].call.sends_text_tokens]
    if not wanted:
        return {}
    rows = [at for at, _ in wanted]
    counts = [ready[index].request.params.logprobs or 0 for _, index in wanted]
    found = token_logprobs(logits[rows], [sampled[at] for at in rows], counts)
    return {index: row_logprobs for (_, index), row_logprobs in zip(wanted, found)}


def _pick_inner(params: SamplingParams, stream: int, first_step: int, k: int, logits: torch.Tensor) -> int:
    """A depth model's token at inner position k: the request's sampling settings, no repetition
    history, draw step `first_step + k` on the depth model's own stream."""
    return sample_tokens(logits, [params], [torch.empty(0, dtype=torch.long)], [stream], [first_step + k])[0]


def _as_int(value: object, default: int) -> int:
    """An integer signal (`time_index`) from an int, a one-element list or tensor; else `default`."""
    if isinstance(value, bool) or value is None:
        return default
    if isinstance(value, int):
        return value
    if isinstance(value, torch.Tensor) and value.numel() >= 1:
        return int(value.reshape(-1)[0])
    if isinstance(value, (list, tuple)) and value and isinstance(value[0], int):
        return int(value[0])
    return default


def _node_stop_tokens(node: NodePlan) -> frozenset[int]:
    """Stop tokens a spec states on the node (`stop_token=…` or a list `stop_tokens=[…]`)."""
    found: set[int] = set()
    for key in ("stop_token", "stop_tokens"):
        value = node.dims.get(key)
        if isinstance(value, int) and not isinstance(value, bool):
            found.add(value)
        elif isinstance(value, list):
            found.update(v for v in value if isinstance(v, int))
    return frozenset(found)
