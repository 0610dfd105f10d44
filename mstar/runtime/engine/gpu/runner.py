"""The kv-node runner of the GPU fast path: a `DecoderRunner` whose step runs on the device.

In and out as `DecoderRunner` (rows of one step -> `RowResult`s and the rows that got no memory);
page admission, budgets and lengths are the parent's. What changes: the model is the bf16 one of
`device_model`, the KV cache is `PagedKv` (with its dummy page), a hybrid decoder's recurrent
states are the parent's slots allocated on the device (a row's slot in the device token table is
then its state slot), and a step is packed, run
(graph replay for decode buckets, eager otherwise), sampled and copied back by `StepExecutor`.
A decode row whose token the engine kept (an on-device loop-back) is fed from the device token
table: its token never crosses to the device from the host.

Running ahead (`prelaunch`): right after a decode step N is launched, the run loop names the rows
the plan lets it speculate on (its next step N+1, `SpeculationCover`); this runner then launches
N+1 for those of them that loop their token back on the device, before N's tokens reach the host,
so the device runs N+1 while the host post-processes N and composes N+1. N+1's positions are one
past N's (N's tokens were committed at its launch), its pages are reserved now, its sampling
counters are one past N's. When the run loop then launches N+1 for real, each of its rows that the
prelaunched step holds takes that result (`_claim`); the other rows run in a step of their own.
A prelaunched row nobody claims (its request stopped, or its rows were held) was not committed:
its KV write one past the sequence is overwritten when the row runs again, and the token it wrote
into the device token table is put back from the host (its request's last token), unless the
request ended and its slot is gone. A row is only prelaunched when its next token fits in pages
its request may take (the admission policy), never with KV offload (moving pages on a guess).

Past a chunk step (`prelaunch` with `AheadChunks`): N+1 also holds the next chunk of each prompt
cut in N with chunks left. Such a row is launched ahead beside the decode rows when its prompt was
classified by an earlier chunk (`RequestState.cut_inputs`), its chunk starts where its KV ends
(N's chunk was committed at N's launch) and stays within max_seq_len, and the admission policy
lets it reserve the chunk's pages; its `RowSpec` carries the chunk's token ids, and the step runs
on the speculated step's capture family, token bucket and attention route (the real N+1's). Its
sampling counter is its request's (N sampled nothing for it), the decode rows' one past. At N+1's
launch `_claim` takes it when the row feeds exactly that chunk (same start, same tokens); its KV
commit (with the token ids, for the prefix cache) happens there, as for any row. Unclaimed, it
wrote KV past its sequence into pages its request holds, overwritten when the chunk runs. A prompt
new to N+1 (`AheadChunks.fresh`, the conductor's row of its first chunk) is prepared and admitted
as the real launch would (`_fresh_chunk`) and launched with the decode rows the same way; left to
the real launch, it would run in a launch of its own after theirs.

With the plan's generated glue (`glue`: this node's `KeyGlue` per worker and walk), the executor
packs each step on the device (`glue_packing.py`); a hybrid decoder keeps the numpy packing.

`fast_path_reason(...)` says why a node cannot take this path (the engine then keeps the general
path). A request with a repetition, presence or frequency penalty samples with it
(`gpu/penalties.py`, from a table on the device of its sampled and seen tokens, sent what the
host collected since its last step; a step launched ahead counts the token not yet collected from
the device token table). Log-probabilities, a logit
bias, min_tokens and ignore_eos go through the decode columns too (their rows' call says where
they apply); the executor computes log-probabilities on the device from the step's logits and
copies them back with its tokens (`StepExecutor.collect_logprobs`), for steps launched ahead too
(`_Ahead.logprobs`), and the columns place them (`decode_columns._logprobs`).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from operator import attrgetter, itemgetter
from typing import Any, Callable, Iterable, Mapping, Optional

import numpy as np
import torch

from mstar.plan.schema import CaptureFamily, NodePlan, Plan
from mstar.runtime.engine.glue_reference import KeyGlue
from mstar.plan.dims import DecoderDims
from mstar.runtime.engine.gpu.decode_columns import prelaunch_steady, start_steady, steady_rows
from mstar.runtime.engine.gpu.executor import PackedFamilies, Pending, SamplingRows, StepExecutor, WholePacked
from mstar.runtime.engine.gpu.forward import DecoderForward, PagedKv
from mstar.runtime.engine.gpu.packing import RowSpec
from mstar.runtime.engine.kv.admission import PageNeed
from mstar.runtime.engine.kv.slots import SlotPool
from mstar.runtime.engine.models.decoder import Decoder
from mstar.runtime.engine.models.kinds import CallInfo
from mstar.runtime.engine.placement import Placement
from mstar.runtime.engine.runners.decoder import DecoderRunner, _Prepared
from mstar.runtime.engine.runners.request_state import RequestState
from mstar.runtime.engine.sampling import SamplingParams, bias_pairs, row_biases
from mstar.runtime.engine.runners.values import (InputError, chunk_of, classify_for_row, held_token_chunk,
                                                 token_list_chunk)
from mstar.runtime.engine.prompt_logprobs import score_row
from mstar.runtime.step import AheadChunks, RowResult, StepRow, row_stop


def fast_path_reason(node: NodePlan, calls: dict[tuple[str, str], CallInfo]) -> Optional[str]:
    """Why the node's calls need the general runner (the dims are checked by device_model)."""
    own = [call for (name, _), call in calls.items() if name == node.name]
    if len(node.inputs) != 1 or node.stream_inputs:
        return "the fast path feeds one token input"
    if node.bidirectional_walks or node.guidance:
        return "bidirectional walks and guidance sequences are not on the fast path"
    if node.cross_kv or any(set(a.writes).isdisjoint(node.kv_sequences) for a in node.kv_access):
        return "cross-attention pools and read-only KV walks are not on the fast path"
    for call in own:
        if call.is_image_flow:
            return "image-flow steps are not on the fast path"
        if any(call.output_roles.get(name, "tokens") not in ("tokens", "mask") for name in call.output_names):
            return "outputs other than sampled tokens are not on the fast path"
    return None


def decode_family(plan: Plan, node: str) -> Optional[CaptureFamily]:
    """The batched one-token capture family of the node's decode mixture, if the plan has one."""
    for worker in plan.workers:
        for key in worker.keys:
            if key.node != node:
                continue
            for entry in key.mixtures:
                family = next((f for f in key.captures if f.name == entry.capture), None)
                if entry.attention == "decode" and family and family.kind == "batched" and family.tokens_per_row == 1:
                    return family
    return None


def packed_families(plan: Plan, node: str, keeps_hidden: bool = False) -> Optional[PackedFamilies]:
    """The node's packed capture families, None when it has none: those the plan captures
    piecewise (`CaptureFamily.is_piecewise`: attention eager between the pieces) and those it
    captures whole (a graph per batch size and token bucket, attention inside). keeps_hidden:
    `PackedFamilies.keeps_hidden`."""
    packed = {f.name: f for worker in plan.workers for key in worker.keys if key.node == node
              for f in key.captures if f.kind == "packed"}
    if not packed:
        return None
    pieces = {name: f for name, f in packed.items() if f.is_piecewise}
    # A whole family's graphs hold one prefill call, or the split route's decode and prefill calls;
    # a split family's step of one kind of row (prompt chunks alone, say) takes one prefill call.
    routes: dict[str, set[str]] = {}
    for worker in plan.workers:
        for key in worker.keys:
            for entry in key.mixtures if key.node == node else ():
                for name in ([entry.capture] if entry.capture else []) + list(entry.also_captures):
                    routes.setdefault(name, {"packed"}).add("split" if entry.attention == "split" else "packed")
    whole = tuple(WholePacked(f.name, tuple(f.batch_pad), tuple(f.batch_sizes), tuple(f.token_buckets),
                              frozenset(routes.get(f.name, {"packed"})))
                  for f in packed.values() if not f.is_piecewise)
    return PackedFamilies(frozenset(pieces), sorted({t for f in pieces.values() for t in f.token_buckets}),
                          max((max(f.batch_sizes) for f in pieces.values()), default=0), whole,
                          keeps_hidden=keeps_hidden)


def node_glue(glue_by_worker: dict[int, dict[str, KeyGlue]], node: str) -> dict[int, dict[str, KeyGlue]]:
    """A glue module's `GLUE_BY_WORKER` narrowed to one node: worker -> walk -> its key's glue."""
    return {rank: {walk: key_glue for key_glue in keys.values() if key_glue.constants.node == node
                   for walk in key_glue.constants.walks}
            for rank, keys in glue_by_worker.items()}


def _no_embeds(num_tokens: int) -> torch.Tensor:
    """The fast path embeds on the device: the host item carries only its token count (`[T, 0]`)."""
    return _ONE_TOKEN if num_tokens == 1 else torch.empty(num_tokens, 0)


_ONE_TOKEN = torch.empty(1, 0)  # shared by every one-token row (nothing writes it)


@dataclass(frozen=True)
class _CallFacts:
    """What a step reads of a call for each of its rows, worked out once per call."""

    loop_backs: frozenset[str]  # inputs the node feeds itself on the device
    outputs: tuple[tuple[str, bool], ...]  # (output name, is a token output; else a mask)
    # (input name, is an on-device loop-back, is read by no model: a mask or signal), in call order
    inputs: tuple[tuple[str, bool, bool], ...]
    is_image_flow: bool


@dataclass(init=False)
class _Item(_Prepared):
    """A fast-path row: the fields a fast-path step reads (the others keep `_Prepared`'s class
    defaults: no flow, no latents, no read-only sequences), set by a plain `__init__` because a
    decode step builds one per row."""

    is_loop_back: bool = False
    facts: Optional[_CallFacts] = None

    def __init__(self, row: StepRow, call: CallInfo, request: RequestState, embeds: torch.Tensor,
                 tokens_fed: list[int], writes: tuple[str, ...], facts: _CallFacts, is_loop_back: bool = False):
        self.row, self.call, self.request, self.embeds, self.tokens_fed = row, call, request, embeds, tokens_fed
        self.writes, self.facts, self.is_loop_back = writes, facts, is_loop_back


@dataclass
class _Ahead:
    """A step launched ahead for a worker: which row sits where in it."""

    pending: Pending
    rows: dict[str, tuple[str, int]] = field(default_factory=dict)  # request id -> (walk, index)
    slots: dict[str, int] = field(default_factory=dict)  # request id -> its device token table slot
    requests: dict[str, RequestState] = field(default_factory=dict)
    tokens: Optional[list[int]] = None  # collected once
    chunks: dict[str, tuple[int, list[int]]] = field(default_factory=dict)  # prompt rows: (start, token ids)
    logprobs: dict[int, Any] = field(default_factory=dict)  # by index in the step, collected with the tokens

    def holds(self, item: "_Item", pool_start: int) -> bool:
        """The step launched ahead ran this row of the step being launched: a decode row fed from
        the device, or a prompt chunk with the same start (`pool_start`: its KV length now) and
        tokens."""
        row = item.row
        place = self.rows.get(row.request_id)
        if place is None or place[0] != row.walk:
            return False
        chunk = self.chunks.get(row.request_id)
        if chunk is None:
            return item.is_loop_back and not row.is_partial
        return (not item.is_loop_back and chunk[0] == row.chunk_start == pool_start
                and chunk[1] == item.tokens_fed)

    def collect(self, executor: StepExecutor) -> list[int]:
        if self.tokens is None:
            self.tokens = executor.collect(self.pending).tolist()
            self.logprobs = executor.collect_logprobs(self.pending)
        return self.tokens


class GpuDecoderRunner(DecoderRunner):
    # The fast path lays the KV pages out its own way (`_new_cache`) and overrides every base
    # method that touches them; the base's single-KvCache typing cannot say so.
    cache: PagedKv  # type: ignore[assignment]
    # its steps run ahead on the device and keep state there (lanes, the step launched ahead): a
    # failed step is not run again (EngineCaps.rerun_nodes leaves its node out)
    rewinds_failed_steps = False

    def __init__(self, node: NodePlan, dims: DecoderDims, model: Decoder, page_size: int, num_pages: int,
                 max_seq_len: int, seed: int, placement: Placement, family: Optional[CaptureFamily],
                 is_flashinfer: bool, position: int = 0, prefix_cache: bool = False,
                 can_run_ahead: Optional[bool] = None, slots: Optional[SlotPool] = None,
                 packed: Optional[PackedFamilies] = None, glue: Optional[dict[int, dict[str, KeyGlue]]] = None,
                 host_pages: int = 0):
        """can_run_ahead: launch decode steps ahead (`prelaunch`); None: on a GPU with decode graphs.
        slots: the recurrent state slots of a hybrid decoder (gated delta-net layers); its requests'
        row slots are then their state slots (slot 0, the sink, is for padding rows). packed: the
        node's packed capture families, whose steps replay piecewise graphs (`packed_families`).
        glue: the plan's generated glue for this node (`node_glue`): worker -> walk -> KeyGlue;
        the steps are then packed by it (not for a hybrid decoder). host_pages: the host pool KV
        offload moves pages to (KvPoolPlan.host_pages; 0: none); only a real launch moves pages
        (`_fresh_chunk`), and a step with a row on the host takes the per-row path (`steady_rows`)."""
        is_default = can_run_ahead is None
        if can_run_ahead is None:  # on a GPU with decode graphs (known once captured: below)
            can_run_ahead = placement.device.type == "cuda" and family is not None and is_flashinfer
        # A hybrid decoder that runs ahead keeps two copies of each state slot: a step launched ahead
        # that nobody claims has moved its rows' states one token on, which, unlike a KV write past
        # the sequence, nothing overwrites later; with two copies it wrote the one nobody reads.
        super().__init__(node, dims, model, page_size, num_pages, max_seq_len, slots, seed, position=position,
                         placement=placement, prefix_cache=prefix_cache, host_pages=host_pages,
                         state_versions=2 if can_run_ahead and slots is not None else 1)
        forward = DecoderForward(model, dims, self.cache, max_seq_len + 1, self.states)
        # a row slot a live request: each holds a device page, or host pages while offloaded
        max_rows = max(num_pages + host_pages + 1, slots.num_slots if slots else 0)
        self.glue = glue if glue and slots is None else None
        sizes = {key_glue.constants.page_size for by_walk in (self.glue or {}).values()
                 for key_glue in by_walk.values()}
        if sizes - {page_size}:
            raise ValueError(f"node {node.name}: the plan's glue packs pages of {sorted(sizes)} tokens, the KV pool "
                             f"has {page_size}; regenerate the glue (`mstarc regen`)")
        self.executor = StepExecutor(forward, self.cache, placement.device, max_rows,
                                     family.batch_pad if family else None, is_flashinfer, packed=packed,
                                     glue_pages_per_seq=-(-max_seq_len // page_size) if self.glue else None,
                                     unroll_prompts=family.unroll_prompts if family else 0)
        self.family = family
        self.capture_bytes = self.executor.capture() if (family or packed) and is_flashinfer else 0
        self._row_slots: dict[str, int] = {}
        self._free_slots = list(range(max_rows - 1, -1, -1))
        # request id -> its device token table slot while it holds one; a hybrid's row slot is its
        # state slot (`_row_slot`), so its pool's owners are that table
        self.held_row_slots: Mapping[str, int] = slots.owners if slots is not None else self._row_slots
        if is_default:
            can_run_ahead = can_run_ahead and self.executor.graphs is not None
        self.can_run_ahead = can_run_ahead
        self._facts: dict[int, _CallFacts] = {}  # id of a call of the engine's call table -> its facts
        self._ahead: dict[int, _Ahead] = {}  # worker -> its step launched ahead
        self._last_rows: dict[int, set[str]] = {}  # worker -> rows of its latest step that sampled
        self.num_ahead_rows = self.num_claimed_rows = 0
        self.num_ahead_chunks = self.num_claimed_chunks = 0  # prompt chunks launched ahead, and taken
        self.num_ahead_first_chunks = 0  # of those, prompts' first chunks (AheadChunks.fresh)
        self._writes = (self.guidance.first,)  # the one KV sequence a fast-path row extends
        self._last_facts: Optional[tuple[CallInfo, _CallFacts]] = None
        # steps of steady decode rows in columns (decode_columns.py); False: every step row by row
        self.is_columnar = True

    def _new_cache(self, dims: DecoderDims, placement: Placement) -> PagedKv:  # type: ignore[override]
        return PagedKv(dims.num_full_layers, self.pool.num_pages, self.pool.page_size, dims.num_kv_heads,
                       dims.head_dim, placement.kv_dtype, placement.device)

    def _move_back(self, ready: list[_Prepared]) -> list[str]:
        """The base's move back; the glue's page-table mirror forgets each restored request's slot
        (its pages are fresh ones: the mirror sends only pages past those it holds)."""
        assert self.offload is not None
        offloaded = [item.row.request_id for item in ready if self.offload.is_offloaded(item.row.request_id)]
        on_host = super()._move_back(ready)
        packer = self.executor.packer
        if packer is not None:
            for request_id in offloaded:
                slot = self.held_row_slots.get(request_id)
                if request_id not in on_host and slot is not None:
                    packer.forget(slot)
        return on_host

    def _page_tensors(self) -> list[torch.Tensor]:
        """Each layer's keys then values as `[pages, page_size, heads, dim]` views of `PagedKv.data`
        (the dummy page last, never offloaded)."""
        data = self.cache.data
        return [data[layer, part] for part in (0, 1) for layer in range(data.shape[0])]

    def attention_backend(self) -> str:
        return "flashinfer+graphs" if self.executor.graphs is not None else "device"

    def _key_glue(self, worker: int, walks: list[str]) -> Optional[KeyGlue]:
        """The generated glue of the key the step's walks belong to on `worker`; None without glue."""
        if self.glue is None:
            return None
        by_walk = self.glue.get(worker, {})
        key_glue = by_walk.get(walks[0]) if walks else None
        if key_glue is None or any(by_walk.get(walk) is not key_glue for walk in walks):
            raise RuntimeError(f"node {self.node.name}: the plan's glue has no key of worker {worker} holding the "
                               f"walks {sorted(set(walks))}; regenerate it (`mstarc regen`)")
        return key_glue

    def end_request(self, request_id: str) -> None:
        super().end_request(request_id)
        self.executor.penalty_table.forget(request_id)
        slot = self._row_slots.pop(request_id, None)
        if slot is not None:
            self._free_slots.append(slot)
            if self.executor.packer is not None:
                self.executor.packer.forget(slot)  # the slot's next owner has other pages

    def _facts_of(self, call: CallInfo) -> _CallFacts:
        facts = self._facts.get(id(call))
        if facts is None:
            loop_backs = frozenset(self._device_loop_backs(call))
            outputs = tuple((name, call.output_roles.get(name, "tokens") == "tokens") for name in call.output_names)
            inputs = tuple((name, name in loop_backs, call.input_roles.get(name) in ("mask", "signal"))
                           for name in call.inputs)
            facts = self._facts[id(call)] = _CallFacts(loop_backs, outputs, inputs, call.is_image_flow)
        return facts

    def _prepare(self, row: StepRow, call: CallInfo, request: RequestState) -> _Item:
        last = self._last_facts  # a step's rows mostly share one call
        if last is not None and last[0] is call:
            facts = last[1]
        else:
            facts = self._facts_of(call)
            self._last_facts = (call, facts)
        if facts.is_image_flow:
            raise InputError("image-flow steps are not on the GPU fast path")
        node = self.node.name
        writes = self._writes  # the fast path has no guidance sequences (fast_path_reason)
        for name, is_loop_back, is_unread in facts.inputs:
            raw = row.inputs.get(name)
            if raw is None and is_loop_back and node in request.last_token:
                return _Item(row, call, request, _ONE_TOKEN, list(request.last_token[node]), writes, facts, True)
            if is_unread:
                continue  # a mask or signal: read by no model here
            ids = token_list_chunk(raw, row, request.cut_inputs, node, name)
            if ids is not None:
                return _Item(row, call, request, _no_embeds(len(ids)), ids, writes, facts)
            value = classify_for_row(row, request.cut_inputs, node, name, raw)
            if value.kind == "tokens" and value.tensor is not None:
                tokens = chunk_of(value.tensor, row)  # a chunk after the KV earlier chunks wrote
                return _Item(row, call, request, _no_embeds(tokens.numel()), tokens.tolist(), writes, facts)
            if value.kind == "embeddings":
                raise InputError(f"input {name}: embeddings are not on the GPU fast path")
        raise InputError("a row with no token to feed is not on the GPU fast path")

    def _num_new(self, item: _Prepared) -> int:
        return len(item.tokens_fed)

    # The base's per-row bookkeeping, for the one KV sequence a fast-path row writes (no guidance
    # sequences, no read-only rows): the same rules without the per-row generators of keys.
    def _length_problem(self, item: _Prepared) -> Optional[str]:
        length = self.pool.num_tokens((item.row.request_id, self.guidance.first)) + len(item.tokens_fed)
        if length > self.max_seq_len:
            return (f"node {self.node.name}: sequence {self.guidance.first} would grow to {length} tokens, past "
                    f"max_seq_len {self.max_seq_len}")
        if item.request.has_penalty:  # its table row made before the step launches (penalties.py `reserve`)
            problem = self.executor.penalty_table.reserve(item.row.request_id, self.dims.vocab)
            return f"node {self.node.name}: {problem}" if problem else None
        return None

    def _admit(self, ready: list[_Prepared], on_host: list[str],
               is_partial_ok: bool) -> tuple[list[_Prepared], list[str]]:
        """The base's admission, asked only about the rows that need something: a row of a started
        request whose sequence has room for its tokens (a decode row between page boundaries) and
        that holds its state slot needs no page and no slot, so the policy would pass it and its
        grant would change nothing. That holds while the pool's free pages cover what the started
        requests may still claim (`Admission.shortfall` then never refuses such a row, and it
        leaves the running counts untouched for the rows after it); when they do not, every row
        goes through the policy as before. (KV offload, asked about the rest only, still moves none
        of the step's requests out: `step_rows`.)"""
        pool, admission, label = self.pool, self.admission, self.guidance.first
        if on_host or pool.num_free_pages < admission.num_outstanding:
            return super()._admit(ready, on_host, is_partial_ok)
        budgets, slots, has_room = admission.budgets, self.slots, pool.has_room
        rest = [item for item in ready
                if (request_id := item.row.request_id) not in budgets
                or not has_room((request_id, label), len(item.tokens_fed))
                or (slots is not None and slots.slot_of(request_id) is None)]
        if not rest:
            return ready, []
        granted, failed = super()._admit(rest, on_host, is_partial_ok)
        if failed and not is_partial_ok:
            return [], failed
        if len(rest) == len(ready):
            return granted, failed
        dropped = {id(item) for item in rest} - {id(item) for item in granted}
        return [item for item in ready if id(item) not in dropped], failed

    def _page_needs(self, ready: list[_Prepared]) -> list[PageNeed]:
        pool, admission, label = self.pool, self.admission, self.guidance.first
        needs = []
        for item in ready:
            request_id = item.row.request_id
            num_pages = pool.num_new_pages((request_id, label), len(item.tokens_fed))
            budget = 0 if admission.is_started(request_id) else self.start_budget_pages(item.request)
            needs.append(PageNeed(request_id, num_pages, budget, self.slots is not None
                                  and self.slots.slot_of(request_id) is None))
        return needs

    def _grant(self, granted: list[tuple[_Prepared, PageNeed]]) -> None:
        if self.slots is not None:  # recurrent state slots: the base's grant acquires them
            super()._grant(granted)
            return
        label = self.guidance.first
        for item, need in granted:
            self.admission.grant(need)
            if need.num_pages and not self.pool.reserve((item.row.request_id, label), len(item.tokens_fed)):
                raise RuntimeError(f"KV pages vanished between the check and the grant for {item.row.request_id}")

    def _row_slot(self, request_id: str) -> int:
        if self.slots is not None:  # a hybrid decoder: the state slot its grant took
            slot = self.slots.slot_of(request_id)
            assert slot is not None, "a row runs only after its grant took a state slot"
            return slot
        if request_id not in self._row_slots:
            self._row_slots[request_id] = self._free_slots.pop()
        return self._row_slots[request_id]

    def _sampling(self, requests: list[RequestState], num_uncollected: int = 0,
                  fed: Optional[list[list[int]]] = None, calls: Optional[list[CallInfo]] = None,
                  uncollected: Optional[list[int]] = None,
                  pending_slots: Optional[list[int]] = None) -> Optional[SamplingRows]:
        """The rows' sampling arrays, None when all are greedy without a penalty, log-probabilities
        or logit additions.
        num_uncollected: steps of these rows launched but not yet collected, whose samples the
        per-row counters and min_tokens' masks must count, and whose tokens a penalised row's
        penalties count from its device token table slot in `pending_slots` (`prelaunch`; a step
        past a chunk step holds no penalised row); `uncollected`: the same a row (a step past a
        chunk step). fed: each row's tokens fed this
        step, which a prompt row's repetition penalty counts (a decode row's fed token is among
        its samples). calls: each row's call, whose `sends_text_tokens` says whether the
        log-probabilities its request asks for are given there and its logit additions apply
        (None: nowhere; no steady row of the decode columns has any)."""
        params = [request.params for request in requests]
        is_penalised = any(map(_has_penalty, requests))
        wants_logprobs = calls is not None and any(map(_wants_logprobs, requests))
        is_biased = calls is not None and any(map(_has_biases, requests))
        if not is_penalised and not wants_logprobs and not is_biased and all(p.is_greedy for p in params):
            return None
        node = self.node.name
        penalties = None
        if is_penalised:
            penalised = [index for index, r in enumerate(requests) if r.has_penalty]
            penalties = self.executor.penalty_table.rows(
                [(index, requests[index], fed[index] if fed else ()) for index in penalised], node,
                [pending_slots[index] for index in penalised] if pending_slots else None)
        counts = [r.num_sampled.get(node, 0) + num_uncollected for r in requests] if uncollected is None else [
            r.num_sampled.get(node, 0) + extra for r, extra in zip(requests, uncollected)]
        return SamplingRows(np.array([p.temperature or 0.0 for p in params], dtype=np.float32),
                            np.array([p.top_p for p in params], dtype=np.float32),
                            np.array([p.seed for p in params], dtype=np.int64),
                            np.array(counts, dtype=np.int64),
                            np.array([p.top_k for p in params], dtype=np.int64), penalties,
                            _logprob_counts(params, calls) if wants_logprobs and calls is not None else None,
                            self._bias_columns(requests, calls, counts) if is_biased and calls is not None else None)

    def _bias_columns(self, requests: list[RequestState], calls: list[CallInfo], counts: list[int]
                      ) -> Optional[tuple[np.ndarray, np.ndarray, np.ndarray]]:
        """SamplingRows.bias: the rows' additions to their logits (`sampling.row_biases`, min_tokens'
        masks by `counts`: each row's tokens sampled before this step's) where their calls send the
        token as text."""
        found = bias_pairs([row_biases(r.params, count, self.stop_tokens) if call.sends_text_tokens else ()
                            for r, call, count in zip(requests, calls, counts)])
        if found is None:
            return None
        rows, tokens, values = found
        return np.array(rows, dtype=np.int64), np.array(tokens, dtype=np.int64), np.array(values, dtype=np.float32)

    def start(self, rows: list[tuple[StepRow, CallInfo, RequestState]], is_partial_ok: bool = False,
              route: str = "packed", decode_walks: frozenset[str] = frozenset(), worker: int = 0,
              bucket: tuple[Optional[str], int] = (None, 0),
              ) -> tuple[list[RowResult], list[str], Callable[[], list[RowResult]]]:
        """The base's `start`; a step's steady decode rows (`decode_columns.py`) are done in columns,
        beside its other rows (prompt chunks) done row by row."""
        # a step scoring a prompt (its log-probabilities) runs its rows one by one, on graphs that keep
        # every position's hidden state or eagerly (`StepExecutor.launch(scoring=...)`, `_scored`)
        is_scoring = self._scores_any((row.walk, request) for row, _, request in rows)
        steady = (steady_rows(self, rows, is_partial_ok and route != "decode")
                  if self.is_columnar and not is_scoring else None)
        if steady is None:
            return super().start(rows, is_partial_ok, route, decode_walks, worker, bucket)
        self.step_rows = rows
        self._route, self._decode_walks, self._step_bucket = route, decode_walks, bucket
        if self.offload is not None:
            self.note_step(rows)
        return start_steady(self, steady, rows, is_partial_ok, worker)

    def _forward(self, ready: list[_Item]) -> list[RowResult]:  # type: ignore[override]
        return self._start_forward(ready)()

    # The base passes back only what this class's `_prepare` built (all `_Item`s).
    def _start_forward(self, ready: list[_Item], worker: int = 0  # type: ignore[override]
                       ) -> Callable[[], list[RowResult]]:
        """Launch the rows (claiming what a step launched ahead holds); commit their KV lengths now,
        so a step launched ahead of this one packs the right positions; return what collects."""
        pool, label = self.pool, self.guidance.first
        ahead = self._ahead.pop(worker, None)
        claimed = self._claim(ahead, ready) if ahead is not None else {}
        fresh = [item for index, item in enumerate(ready) if index not in claimed] if claimed else ready
        pending = None
        scoring: list[int] = []  # fresh rows whose prompt's log-probabilities are asked for
        if fresh:
            decode_walks = self._decode_walks  # the split route's rows for the decode kernel
            key_glue = self._key_glue(worker, [item.row.walk for item in fresh])
            walk_index = {walk: index for index, walk in enumerate(key_glue.constants.walks)} if key_glue else {}
            specs = [RowSpec(None if item.is_loop_back else item.tokens_fed,
                             pool.num_tokens((item.row.request_id, label)),
                             pool.page_table((item.row.request_id, label)),
                             self._row_slot(item.row.request_id), item.row.walk in decode_walks,
                             walk_index.get(item.row.walk, 0)) for item in fresh]
            if self.scoring:
                scoring = [index for index, item in enumerate(fresh) if self._scores(item.row.walk, item.request)]
            pending = self.executor.launch(specs, self._sampling([item.request for item in fresh],
                                                                 fed=[item.tokens_fed for item in fresh],
                                                                 calls=[item.call for item in fresh]),
                                           *self._step_bucket, route=self._route, glue=key_glue, scoring=scoring)
        sampled: set[str] = set()
        for item in ready:
            row = item.row
            pool.commit((row.request_id, label), len(item.tokens_fed), None if item.is_loop_back else item.tokens_fed)
            if not row.is_partial:
                sampled.add(row.request_id)
        self._last_rows[worker] = sampled

        def finish() -> list[RowResult]:
            fresh_tokens = iter(self.executor.collect(pending).tolist() if pending is not None else [])
            logprobs = self.executor.collect_logprobs(pending) if pending is not None else {}  # by index in `fresh`
            ahead_tokens = ahead.collect(self.executor) if claimed and ahead is not None else []
            results = []
            num_fresh = 0
            for index, item in enumerate(ready):
                if index in claimed:
                    token = ahead_tokens[claimed[index]]
                else:
                    token, num_fresh = next(fresh_tokens), num_fresh + 1
                if item.row.is_partial:  # a chunk before the last: its KV is written, its token unused
                    item.request.history.setdefault(self.node.name, []).extend(item.tokens_fed)
                    results.append(RowResult(item.row.request_id))
                else:
                    results.append(self._token_outputs(item, token))
                    if index in claimed:
                        if ahead is not None and ahead.logprobs:
                            results[-1].logprobs = ahead.logprobs.get(claimed[index])
                    elif logprobs:
                        results[-1].logprobs = logprobs.get(num_fresh - 1)
                if scoring and index not in claimed:
                    self._scored(item, pending, num_fresh - 1, results[-1])
            return results
        return finish

    def _scores(self, walk: str, request: RequestState) -> bool:
        """Whether a row of `walk` feeds a prompt whose log-probabilities its request asks for."""
        return request.request_id in self.scoring and walk in self.prompt_logprob_walks

    def _scores_any(self, rows: Iterable[tuple[str, RequestState]]) -> bool:
        """Whether any of the (walk, request) rows is scored (`_scores`); no look while no live
        request asks."""
        return bool(self.scoring) and any(self._scores(walk, request) for walk, request in rows)

    def _scored(self, item: _Item, pending: Any, fresh_index: int, result: RowResult) -> None:
        """A scored row's prompt log-probabilities from its step's kept hidden states, over the
        executor's LM head (`score_row`, as the base's `_prompt_logprobs`)."""
        span = pending.spans.get(fresh_index)
        if span is not None:
            result.prompt_logprobs = score_row(self.executor.forward.lm_logits, pending.hidden[slice(*span)],
                                               item.tokens_fed, item.request, self.node.name, item.row.is_partial)

    def _claim(self, ahead: _Ahead, ready: list[_Item]) -> dict[int, int]:
        """Rows of this step the step launched ahead already ran: index here -> index there. The
        rows it ran that nobody claims get their device loop-back token back (module docstring)."""
        claimed = {}
        placed = ahead.rows
        pool, label = self.pool, self.guidance.first
        for index, item in enumerate(ready):
            request_id = item.row.request_id
            if request_id in placed and ahead.holds(item, pool.num_tokens((request_id, label))):
                claimed[index] = placed[request_id][1]
        self.num_claimed_rows += len(claimed)
        if ahead.chunks:
            self.num_claimed_chunks += sum(ready[index].row.request_id in ahead.chunks for index in claimed)
        if len(set(claimed.values())) != len(ahead.slots):  # some rows it ran are nobody's now
            self._restore_unclaimed(ahead, {ready[index].row.request_id for index in claimed})
        return claimed

    def _restore_unclaimed(self, ahead: _Ahead, taken: set[str]) -> None:
        """Put back the device loop-back tokens of the rows `ahead` ran that no step took, and a
        hybrid decoder's state copies of those whose requests still hold their slots."""
        node = self.node.name
        held = [(request_id, slot) for request_id, slot in ahead.slots.items()
                if request_id not in taken and self.held_row_slots.get(request_id) == slot]
        restore = [(slot, ahead.requests[request_id].last_token[node][0]) for request_id, slot in held
                   if ahead.requests[request_id].last_token.get(node)]
        if restore:
            slots, tokens = zip(*restore)
            self.executor.restore_loop_tokens(list(slots), list(tokens))
        if self.states is not None and held:
            self.states.revert([slot for _, slot in held])

    def prelaunch(self, worker: int, rows: list[tuple[str, str, CallInfo, RequestState]],
                  chunks: Optional[AheadChunks] = None, decode_walks: frozenset[str] = frozenset()) -> None:
        """Launch the worker's next decode step ahead for `rows` (the run loop's speculation of
        it), those of them whose latest step sampled a token that loops back on the device; with
        `chunks`, also the prompt rows' next chunks (module docstring; decode_walks: the key's
        walks the split route runs on the decode kernel)."""
        if not self.can_run_ahead or worker in self._ahead:
            return
        if chunks is not None:
            # (a penalised row's uncollected sample is counted from the device token table, by
            # `_sampling`'s pending_slots, on the per-row path and the columns, not past a chunk step)
            # (nor a prompt scored for its log-probabilities: its step keeps every position's hidden
            # state, which a step launched ahead does not, `_scored`)
            if not any(map(_has_penalty, map(_fourth, rows))) and not self._scores_any(
                    (walk, request) for _, walk, _, request in rows):
                self._prelaunch_chunks(worker, rows, chunks, decode_walks)
            return
        if self.is_columnar and prelaunch_steady(self, worker, rows):
            return
        last = self._last_rows.get(worker, set())
        specs: list[RowSpec] = []
        placed: dict[str, tuple[str, int]] = {}  # request id -> (walk, index in the step)
        slots: dict[str, int] = {}
        requests: dict[str, RequestState] = {}
        calls: dict[str, CallInfo] = {}
        pool, label = self.pool, self.guidance.first
        row_slots = self.held_row_slots
        last_call, is_loop_back = None, False  # the rows mostly share one call
        for request_id, walk, call, request in rows:
            key = (request_id, label)
            if request_id not in last or request_id in placed:
                continue
            if call is not last_call:
                last_call, is_loop_back = call, bool(self._facts_of(call).loop_backs)
            num_cached, num_held = pool.extent(key)  # num_held: positions its pages hold
            if not is_loop_back or not self._next_token_fits(request_id, key, num_cached, num_held):
                continue
            slot = row_slots.get(request_id)
            if slot is None:
                slot = self._row_slot(request_id)
            placed[request_id] = (walk, len(specs))
            slots[request_id] = slot
            requests[request_id] = request
            calls[request_id] = call
            specs.append(RowSpec(None, num_cached, pool.page_table(key), slot))
        if not specs:
            return
        key_glue = self._glue_for_ahead(worker, specs, placed)
        # the step launched last samples first: its sample is not counted yet
        pending = self.executor.launch(specs, self._sampling(list(requests.values()), num_uncollected=1,
                                                             calls=list(calls.values()),
                                                             pending_slots=list(slots.values())), glue=key_glue)
        self._launched_ahead(worker, pending, placed, slots, requests)

    def _glue_for_ahead(self, worker: int, specs: list[RowSpec], placed: dict[str, tuple[str, int]]):
        """The key glue of a step launched ahead (None: numpy packing), with each spec's walk index
        in it set from the walk its row was placed under."""
        key_glue = self._key_glue(worker, [placed_walk for placed_walk, _ in placed.values()])
        if key_glue is not None:
            walk_index = {walk: index for index, walk in enumerate(key_glue.constants.walks)}
            for spec, (placed_walk, _) in zip(specs, placed.values()):
                spec.walk_index = walk_index[placed_walk]
        return key_glue

    def _prelaunch_chunks(self, worker: int, rows: list[tuple[str, str, CallInfo, RequestState]],
                          chunks: AheadChunks, decode_walks: frozenset[str]) -> None:
        """`prelaunch` of a step past a chunk step, row by row in step order: the decode rows as
        the per-row path takes them, the prompt rows' next chunks (module docstring)."""
        last = self._last_rows.get(worker, set())
        pool, label = self.pool, self.guidance.first
        specs: list[RowSpec] = []
        placed: dict[str, tuple[str, int]] = {}
        slots: dict[str, int] = {}
        requests: dict[str, RequestState] = {}
        cut: dict[str, tuple[int, list[int]]] = {}
        calls: dict[str, CallInfo] = {}
        uncollected: list[int] = []
        fresh = {row.request_id: row for row in chunks.fresh}
        for request_id, walk, call, request in rows:
            key = (request_id, label)
            if request_id in placed:
                continue
            num_cached, num_held = pool.extent(key)
            chunk = chunks.chunks.get(request_id)
            tokens: Optional[list[int]] = None  # None: a decode row fed from the device
            if request_id in fresh:  # a prompt new to the step: its first chunk
                tokens = self._fresh_chunk(fresh[request_id], call, request, num_cached)
                if tokens is None:
                    continue  # it waits for the real launch
                self.num_ahead_first_chunks += 1
            elif chunk is not None:  # a prompt cut in the step launched last: its next chunk
                tokens = self._cut_chunk(request_id, key, call, request, num_cached, chunk, last)
                if tokens is None:
                    continue
            elif (request_id not in last or not self._facts_of(call).loop_backs
                  or not self._next_token_fits(request_id, key, num_cached, num_held)):
                continue  # a decode row, as `prelaunch` takes it, or none
            spec = RowSpec(tokens, num_cached, pool.page_table(key), self._row_slot(request_id), walk in decode_walks)
            if tokens is not None:
                cut[request_id] = (num_cached, tokens)
            # the step launched last samples a decode row first (its sample is not counted yet), a
            # prompt's chunk not at all
            uncollected.append(1 if tokens is None else 0)
            placed[request_id] = (walk, len(specs))
            slots[request_id] = spec.row_slot
            requests[request_id] = request
            calls[request_id] = call
            specs.append(spec)
        if not specs:
            return
        key_glue = self._glue_for_ahead(worker, specs, placed)
        sampling = self._sampling(list(requests.values()), calls=list(calls.values()), uncollected=uncollected)
        if cut:  # the real N+1's shape: its capture family, token bucket and attention route
            pending = self.executor.launch(specs, sampling, chunks.capture, chunks.token_bucket,
                                           route=chunks.attention, glue=key_glue)
        else:
            pending = self.executor.launch(specs, sampling, glue=key_glue)
        self._launched_ahead(worker, pending, placed, slots, requests, cut)

    def _cut_chunk(self, request_id: str, key: tuple[str, str], call: CallInfo, request: RequestState,
                   num_cached: int, num: int, last: set[str]) -> Optional[list[int]]:
        """The token ids of a cut prompt's next chunk launched ahead, its pages reserved; None when
        it must wait for the real launch: no classified prompt, sampled by the step launched last,
        past max_seq_len, its request not started or its pages refused."""
        tokens = self._next_chunk(request, call, num_cached, num)
        if (tokens is None or request_id in last or num_cached + num > self.max_seq_len
                or not self.admission.is_started(request_id) or not self._reserve_tokens(request_id, key, num)):
            return None
        return tokens

    def _fresh_chunk(self, row: StepRow, call: CallInfo, request: RequestState, num_cached: int
                     ) -> Optional[list[int]]:
        """The token ids of a new prompt row's chunk launched ahead, prepared and admitted as the
        real launch would (its input classified, its request's budget and pages granted); None when
        it must wait for the real launch: inputs the fast path cannot take (the real launch says
        why), a chunk past max_seq_len, a start other than where its KV ends, the policy's no, or
        with KV offload a shortfall (only a real launch moves pages out: a step launched ahead
        holds rows the real one may not)."""
        try:
            item = self._prepare(row, call, request)
        except InputError:
            return None
        if item.is_loop_back or row.chunk_start != num_cached or self._length_problem(item) is not None:
            return None
        if self.offload is not None and self.refused(self._page_needs([item])):
            return None
        granted, _ = self._admit([item], [], True)
        return item.tokens_fed if granted else None

    def _next_chunk(self, request: RequestState, call: CallInfo, start: int, num: int) -> Optional[list[int]]:
        """The token ids of a prompt's chunk [start, start + num) from its prompt (the memo an
        earlier chunk left: `values.token_list_chunk`, `values.classify_for_row`); None when it has
        none."""
        node = self.node.name
        for name, is_loop_back, is_unread in self._facts_of(call).inputs:
            if is_loop_back or is_unread:
                continue
            held = request.cut_inputs.get((node, name))
            if held is not None and held[1] is None:  # a flat token list (`values.token_list_chunk`)
                return held_token_chunk(held[0], start, num)
            if held is None or held[1].kind != "tokens" or held[1].tensor is None:
                return None
            tokens = held[1].tensor[start:start + num]
            return tokens.tolist() if tokens.numel() == num else None
        return None

    def _next_token_fits(self, request_id: str, key: tuple[str, str], num_cached: int, num_held: int) -> bool:
        """A decode row launched ahead: its next token stays within max_seq_len, in the pages it
        holds (`num_held` positions) or in a page the admission policy lets it reserve now."""
        return num_cached + 1 <= self.max_seq_len and (num_cached < num_held
                                                       or self._reserve_tokens(request_id, key, 1))

    def _reserve_tokens(self, request_id: str, key: tuple[str, str], num: int) -> bool:
        """Reserve the pages `num` more tokens of the row need (a decode row's next token, a
        prompt's next chunk), when the admission policy lets it."""
        num_pages = self.pool.num_new_pages(key, num)
        if num_pages:
            need = PageNeed(request_id, num_pages, 0)
            if self.admission.shortfall([need], self.pool.num_free_pages):
                return False
            self.admission.grant(need)
            if not self.pool.reserve(key, num):
                raise RuntimeError(f"KV pages vanished between the check and the grant for {request_id}")
        return True

    def _launched_ahead(self, worker: int, pending: Pending, placed: dict[str, tuple[str, int]],
                        slots: dict[str, int], requests: dict[str, RequestState],
                        chunks: Optional[dict[str, tuple[int, list[int]]]] = None) -> None:
        self._ahead[worker] = _Ahead(pending, placed, slots, requests, chunks=chunks or {})
        self.num_ahead_rows += len(placed)
        self.num_ahead_chunks += len(chunks or ())

    def _token_outputs(self, item: _Item, token: int) -> RowResult:
        node, request, params = self.node.name, item.request, item.request.params
        request.history.setdefault(node, []).extend(item.tokens_fed)
        num_sampled = request.count_sampled(node, token)
        request.last_token[node] = [token]
        node_stops = frozenset() if params.ignore_eos and item.call.sends_text_tokens else self.stop_tokens
        is_stop, is_length = row_stop(token, params.stop_tokens, node_stops, num_sampled, params.max_tokens)
        outputs: dict[str, object] = {}
        # a mask has a value per position of the call's input: a cut prompt's last chunk covers the
        # chunks before it too (as the reference runner's `_whole_prompt`)
        num_positions = item.row.chunk_start + len(item.tokens_fed)
        for name, is_token in (item.facts or self._facts_of(item.call)).outputs:
            outputs[name] = [token] if is_token else torch.ones(num_positions, dtype=torch.bool)
        return RowResult(item.row.request_id, outputs, is_stop, is_length=is_length)


_has_penalty, _fourth = attrgetter("has_penalty"), itemgetter(3)
_wants_logprobs = attrgetter("wants_logprobs")
_has_biases = attrgetter("has_biases")


def _logprob_counts(params: list[SamplingParams], calls: list[CallInfo]) -> np.ndarray:
    """SamplingRows.logprobs: each row's count where its call sends its token as text, else -1."""
    return np.array([-1 if p.logprobs is None or not call.sends_text_tokens else p.logprobs
                     for p, call in zip(params, calls)], dtype=np.int64)


