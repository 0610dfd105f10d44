"""TorchEngine: the real engine (torch models, paged KV cache, sampling) on the CPU or a CUDA GPU.

`TorchEngine(plan, dims="tiny", weights_dir=None, seed=0, num_pages=None, runs_partial_steps=True,
device="cpu", attention="auto")` builds one model per plan
node (the kind the spec states, `NodePlan.model_kind`; dims from `mstar.plan.dims`) and implements the
`mstar.runtime.step.Engine` protocol:
- `add_request(id, request)` -> None, or a message when the request can never run (prompt +
  max_tokens past a node's KV pool or max_seq_len, bad sampling settings);
- `run_step(step)` -> `StepResult`: per-row outputs keyed by the output edge names of that row's
  (node, walk) call in `plan.walks`; `allocation_failed` for rows that got no KV pages / slot
  (nothing ran for them; the other rows ran, unless `runs_partial_steps` is off);
- `end_request(id)` frees its pages and slots.
With tiny dims the engine sets torch to one thread (see `__init__`). In one process one engine
serves every worker of the plan (one KV pool per kv node, shared by its walks, so a prefill/decode
split needs no KV transfer there); with ranks as processes each rank's engine builds only its
worker's nodes (`nodes=`) and KV moves between them (serve/ranks, engine/kv/transfer.py).

Start-up refusals (`EngineError`, a clear message): a kind the engine has no model for, bad dims, a
recurrent slot pool too small, a `--weights` checkpoint that does not fit the node, a `--device`
this machine lacks, `--attention flashinfer` where FlashInfer cannot run.

On a GPU (`device="cuda"`) the models run through `placement.OnDevice` (bf16 autocast, host values
at the runner boundary) and kv nodes plan FlashInfer per step where it can run
(`flashinfer_attention.py`); the CPU path is the exact fp32 reference.
"""
from __future__ import annotations

import dataclasses
import logging

import os
import time
from itertools import repeat
from operator import attrgetter, is_not
from types import ModuleType
from typing import Any, Callable, Collection, Mapping, Optional, TypeVar, Union

import numpy as np
import torch

from mstar.arg_types import shown_path
from mstar.plan.guidance_mode import unknown_label_problem
from mstar.plan.schema import NodePlan, Plan
from mstar.plan.stages import default_walks
from mstar.plan.dims import (
    DIMS_MODES, DecoderDims, DimsError, DimsMode, codec_dims, decoder_dims, encoder_dims, image_decoder_dims,
    tp_split_problem,
)
from mstar.runtime.engine import qwen3_asr_setup, whisper_setup
from mstar.runtime.engine.gpu.decode_columns import TokenRows
from mstar.runtime.engine.runners.decoder import DecoderRunner
from mstar.runtime.engine.runners.qwen3_asr import Qwen3AsrEncoderRunner
from mstar.runtime.engine.kv.pool_size import pool_size
from mstar.runtime.engine.media_placeholders import MediaPlaceholders
from mstar.runtime.engine.prompt_limits import EmptyPrompt, takes_text_prompt, token_ids_problem
from mstar.runtime.engine.kv.reserved_pages import ReservedPages
from mstar.runtime.engine.runners.whisper import WhisperDecoderRunner, WhisperEncoderRunner
from mstar.runtime.engine.submodels import build_depth_models, build_submodels, submodel_dims
from mstar.runtime.engine.runners.request_state import RequestState
from mstar.runtime.engine.runners.stateless import CodecRunner, EncoderRunner, ImageDecoderRunner, SnacRunner
from mstar.runtime.engine.attention.flashinfer_paged import FlashInferAttention, unavailable_reason
from mstar.runtime.engine.runners.values import is_out_of_memory
from mstar.runtime.engine.runners.guidance import GuidanceError
from mstar.runtime.engine.kv.slots import SlotPoolError, node_slot_pool
from mstar.runtime.engine.models.codec import CodecDecoder
from mstar.runtime.engine.models.snac_codec import SnacCodec, SnacCodecDims
from mstar.runtime.engine.snac_checkpoint import load_snac_weights, read_snac_config
from mstar.runtime.engine.models.decoder import Decoder
from mstar.runtime.engine.models.encoders import MediaEncoder
from mstar.runtime.engine.models.image_decoder import ImageDecoder
from mstar.runtime.engine.models.kinds import CallInfo, call_table, prompt_logprob_calls
from mstar.runtime.engine.placement import DeviceError, OnDevice, resolve_device
from mstar.runtime.engine.sampling import SamplingError
from mstar.runtime.engine.step_check import StepChecker
from mstar.runtime.engine.tp.build import build_sharded_decoder
from mstar.runtime.engine.tp.comm import SINGLE_RANK, TpComm
from mstar.runtime.engine.tp.layout import ShardLayout
from mstar.runtime.step import AheadChunks, EngineCaps, RowResult, Step, StepHandle, StepResult, StepRow
from mstar.runtime.engine.checkpoint_files import check_layer_count, headers_read_once, tensor_index
from mstar.runtime.engine.weights import (
    WeightsError, init_random, load_decoder, read_checkpoint_config,
)

Runner = Union[DecoderRunner, CodecRunner, SnacRunner, EncoderRunner, ImageDecoderRunner, WhisperDecoderRunner,
               WhisperEncoderRunner, Qwen3AsrEncoderRunner]
ModelT = TypeVar("ModelT", bound=torch.nn.Module)
LOG = logging.getLogger(__name__)

ATTENTION_BACKENDS = ("auto", "torch", "flashinfer")
_walk_of, _request_id_of = attrgetter("walk"), attrgetter("request_id")
MEMORY_FRACTION = 0.6  # of physical memory the weights may take (KV pages and activations need the rest)


class EngineError(ValueError):
    """The engine cannot start for this plan and these options (the message says why)."""


def _refuse_dynamic_rope_split(plan: Plan, node: NodePlan, checkpoint: DecoderDims, weights_dir: str) -> None:
    """Dynamic NTK RoPE where a prompt's tokens may run in more than one step (chunks, a prefix
    cache) is refused: its theta follows the length each step sees and the KV keeps keys rotated at
    their own step's, so the tokens changed with the chunking and with which requests ran before."""
    if checkpoint.rope.kind != "dynamic":
        return
    chunked = any(key.chunk_sizes for worker in plan.workers for key in worker.keys if key.node == node.name)
    cached = any(pool.node == node.name and pool.prefix_cache == "pages" for pool in plan.deployment.kv_pools)
    if chunked or cached:
        raise WeightsError(f"--weights {shown_path(weights_dir)}: dynamic NTK RoPE scales by the length each step "
                           "sees and the KV keeps keys rotated at their own step's scale, so "
                           + ("chunked prompts" if chunked else "a prefix cache") + f" on node {node.name} would give "
                           "other tokens than one whole prompt; run it on a plan without "
                           + ("max_prefill_chunk_size or a step token budget" if chunked else "prefix_cache"))


def _check_tiny_splits(node: str, dims: DecoderDims, size: int) -> None:
    """`--dims tiny` keeps at most 2 kv heads and a head ratio of at most 4, which a group the
    spec's own heads split over may not split (Orpheus's 24 query heads over 4 ranks: tiny's 6).
    The shard layout's refusal named those numbers as if they were the spec's."""
    problem = tp_split_problem(dims, size)
    if problem:
        raise DimsError(f"node {node}: the tiny model of --dims tiny cannot be split over {size} tensor-parallel "
                        f"ranks ({problem}; tiny keeps at most 2 kv heads and a head ratio of at most 4): run "
                        f"with --dims spec or --weights")


class TorchEngine:
    def __init__(self, plan: Plan, *, dims: str = "tiny", weights_dir: Optional[str | list[str]] = None, seed: int = 0,
                 num_pages: Optional[int] = None, runs_partial_steps: bool = True, device: str = "cpu",
                 attention: str = "auto", tp_comms: Optional[Mapping[str, TpComm]] = None,
                 nodes: Optional[Collection[str]] = None, run_ahead: bool = True, glue: Optional[ModuleType] = None):
        """runs_partial_steps: when some rows of a step cannot get memory, run the others (their
        results come back beside `allocation_failed`; the driver post-processes them and holds
        only the failed rows). False: all or nothing per step (a step with a failed row runs
        nothing; the driver then puts the whole batch back).
        weights_dir: `--weights` entries, each `DIR` or `NODE=DIR` (weights.weights_by_node).
        device: `cpu` (fp32, the reference path) or `cuda[:N]` (models via placement.OnDevice).
        attention: `torch`, `flashinfer` (a GPU, head_dim 64/128/256, the gpu extra) or `auto`.
        tp_comms: node -> this process's `TpComm` for the kv nodes it runs tensor-parallel
        (`tp.build.tp_comms`): such a node is built as this rank's shard (`engine/tp/`).
        nodes: build only these nodes' models (a rank process builds the nodes its worker runs;
        the others' dims are still read, for the widths and budgets that depend on them); None: all.
        run_ahead: let a GPU fast-path runner launch a decode step before the one before it was
        collected (`launch_ahead`, gpu/runner.py); False: every step waits for the one before.
        glue: the plan's glue module (`load_plan_glue`): the GPU fast path packs with it; None: numpy."""
        if dims not in DIMS_MODES:
            raise EngineError(f"--dims {dims!r}: choose one of {', '.join(DIMS_MODES)}")
        if num_pages is not None and num_pages <= 0:
            raise EngineError(f"--kv-pages {num_pages}: must be a positive number of pages")
        if attention not in ATTENTION_BACKENDS:
            raise EngineError(f"--attention {attention!r}: choose one of {', '.join(ATTENTION_BACKENDS)}")
        try:
            self.placement = resolve_device(device)
        except DeviceError as error:
            raise EngineError(str(error)) from None
        self.attention = attention
        self.tp_comms: Mapping[str, TpComm] = tp_comms or {}
        self.is_tiny = dims == "tiny"
        if dims == "tiny":  # (tiny matrices gain nothing from threads: docs/engine.md "Dims")
            torch.set_num_threads(1)
        self.plan, self.glue, self.run_ahead = plan, glue, run_ahead  # a hybrid's runner sizes its states by run_ahead
        self.runs_partial_steps = runs_partial_steps
        # One engine serves every worker: a TP follower's copy of a step has nothing to run here.
        self.caps = EngineCaps(runs_partial_steps=runs_partial_steps)
        self.checker, self.empty_prompt = StepChecker(plan), EmptyPrompt(plan)  # each step's and request's checks
        self.media_placeholders = MediaPlaceholders()  # filled once the runners are built
        self.calls: dict[tuple[str, str], CallInfo] = call_table(plan)
        # A node's position in the plan seeds its random weights (a name never does).
        self.positions = {node.name: index for index, node in enumerate(plan.nodes)}
        self.requests: dict[str, RequestState] = {}
        self.decoder_dims: dict[str, DecoderDims] = {}
        self.checkpoint_vocabs: dict[str, int] = {}  # node -> the vocabulary of the checkpoint it loaded
        self._num_weight_bytes = 0
        self.runners: dict[str, Runner] = {}
        try:
            self._build_runners(dims, weights_dir, seed, num_pages, nodes)
        except (DimsError, SlotPoolError, WeightsError) as error:
            raise EngineError(str(error)) from None
        planned = {node.name: vocab for node in plan.nodes if isinstance(vocab := node.dims.get("vocab"), int)}
        # a stand-in (tiny dims) samples from fewer ids than the plan's vocabulary
        self.caps = dataclasses.replace(self.caps, image_sizes=self.image_sizes, vocab_sizes={
            name: dims.vocab for name, dims in self.decoder_dims.items() if dims.vocab < planned.get(name, 0)},
            rerun_nodes=_rerun_nodes(self.runners))
        self._set_run_ahead(run_ahead)

    def replace_runner(self, name: str, runner: Runner) -> None:
        """Run node `name` on `runner` from now on (a bench or test puts the GPU fast path's runner
        in place of the reference one on the CPU), the caps that read the runners following it:
        `rerun_nodes` (swapped in after the caps were made, the fast path's node stayed in them, so a
        failed step of its rows ran again alone, each row one token on: its runner rewinds nothing)
        and `can_launch_ahead`."""
        self.runners[name] = runner
        self.caps = dataclasses.replace(self.caps, rerun_nodes=_rerun_nodes(self.runners), can_launch_ahead=any(
            isinstance(each, DecoderRunner) and each.can_run_ahead for each in self.runners.values()))

    def _prompt_logprobs_runner(self) -> tuple[Optional[str], Optional[DecoderRunner]]:
        """(why a request asking for prompt log-probabilities cannot run here, or None; the runner
        that computes them here, told its walks, or None where the node runs on another rank,
        which answers for it). Asked per such request (a few dict lookups), so a runner swapped in
        after start is the one asked."""
        calls = prompt_logprob_calls(self.plan, self.calls)
        if not calls:
            return ("this plan gives no prompt log-probabilities: none of its walks has a call outside loops that "
                    "takes the text prompt and sends text tokens to the client"), None
        node = next(iter(calls))[0]
        runner = self.runners.get(node)
        if runner is None:
            return None, None
        if not isinstance(runner, DecoderRunner) or runner.prompt_logprobs_refusal is not None:
            why = getattr(runner, "prompt_logprobs_refusal", None) or "its runner does not compute them"
            return f"node {node} gives the prompt's log-probabilities, but {why}", None
        runner.prompt_logprob_walks = frozenset(walk for _, walk in calls)
        return None, runner

    def _set_run_ahead(self, run_ahead: bool) -> None:
        """`run_ahead=False`: every step waits for the one before; caps say whether any runner can."""
        for runner in self.runners.values():
            if not run_ahead and isinstance(runner, DecoderRunner):
                runner.can_run_ahead = False
        self.caps = dataclasses.replace(self.caps, can_launch_ahead=any(
            isinstance(runner, DecoderRunner) and runner.can_run_ahead for runner in self.runners.values()))

    def _build_runners(self, mode: DimsMode, weights_dir: Optional[str | list[str]], seed: int,
                       num_pages: Optional[int], nodes: Optional[Collection[str]]) -> None:
        """A runner per node of `nodes` (every node when None); the other decoders' dims only."""
        plan = self.plan
        self.image_sizes: dict[str, tuple[int, int]] = {}  # image decoder node -> (width, height)
        checkpoints = whisper_setup.checkpoints_by_node(plan.nodes, weights_dir)
        # Decoders first: encoders size their heads and image decoders their latents after them. A
        # checkpoint's headers are read once (the layer-count check, then the loader: checkpoint_files.py).
        with headers_read_once():
            for node in sorted(plan.nodes, key=lambda n: n.model_kind != "decoder"):
                if nodes is None or node.name in nodes:
                    self.runners[node.name] = self._build(node, mode, checkpoints.get(node.name), seed, num_pages)
                elif node.model_kind == "decoder":
                    self.decoder_dims[node.name] = self._decoder_dims(node, mode, checkpoints.get(node.name))
        self._count_media_tokens(mode)

    def _count_media_tokens(self, mode: DimsMode) -> None:
        """Tell each decoder how many tokens its encoders may feed a request (for start budgets), and
        which encoders' states fill the placeholders of a decoder with a media_token (checked when a
        request arrives, media_placeholders.py)."""
        kinds = {node.name: node for node in self.plan.nodes if node.model_kind in ("vision_encoder", "audio_encoder")}
        # decoder with a media_token -> the encoders whose states fill its placeholders, counted from a
        # request's media before they run (Qwen3-ASR's: the clip's length says it)
        counters: dict[str, list[Qwen3AsrEncoderRunner]] = {}
        for (name, _), call in self.calls.items():
            if name in kinds:
                num_tokens = encoder_dims(kinds[name], mode, kinds[name].model_kind == "audio_encoder").num_tokens
                fed = {edge.dest for edge in call.edges if edge.dest_kind == "node"}
                for dest in fed:
                    target = self.runners.get(dest)
                    # a node with a media_token holds the states inside its prompt: counted there
                    if isinstance(target, DecoderRunner) and target.media_token is None:
                        target.num_media_tokens += num_tokens
                    elif isinstance(target, DecoderRunner) and isinstance(encoder := self.runners.get(name),
                                                                          Qwen3AsrEncoderRunner):
                        if encoder not in counters.setdefault(dest, []):
                            counters[dest].append(encoder)
        for dest, encoders in counters.items():
            decoder = self.runners[dest]
            assert isinstance(decoder, DecoderRunner) and decoder.media_token is not None
            self.media_placeholders.add(dest, decoder.media_token, encoders)

    # ------------------------------------------------------------------ start-up

    def _build(self, node: NodePlan, mode: DimsMode, weights_dir: Optional[str], seed: int,
               num_pages: Optional[int]) -> Runner:
        kind = node.model_kind
        position = self.positions[node.name]
        if kind in ("decoder", "audio_encoder") and whisper_setup.is_whisper(node):
            if kind == "audio_encoder":
                return whisper_setup.encoder_runner(node, mode, weights_dir, seed, position, self._new)
            size = pool_size(self.plan, node.name, num_pages)
            pages = ReservedPages(node.name, size.num_pages, size.page_size, size.max_seq_len)
            return whisper_setup.decoder_runner(node, mode, weights_dir, seed, position, size.max_seq_len, pages,
                                                self._new)
        if kind == "decoder":
            return self._build_decoder(node, mode, weights_dir, seed, num_pages)
        if qwen3_asr_setup.is_qwen3_asr(node):
            return qwen3_asr_setup.encoder_runner(node, mode, weights_dir, seed, position, self._fed_width(node),
                                                  self._new)
        if kind == "audio_codec" and weights_dir is not None:
            return self._build_snac(node, weights_dir, seed)
        if kind == "audio_codec":
            codec = codec_dims(node, mode)
            model = self._new(node.name, lambda: CodecDecoder(codec))
            init_random(model, seed, self.positions[node.name])
            return CodecRunner(node, self._place(model), self._stream_policy(node.name), self.positions[node.name])
        if kind in ("vision_encoder", "audio_encoder"):
            dims = encoder_dims(node, mode, kind == "audio_encoder")
            widths = {output.name: dims.hidden for output in node.outputs}
            for (name, _), call in self.calls.items():
                if name == node.name:
                    for edge in call.edges:
                        dest = self.decoder_dims.get(edge.dest) if edge.dest_kind == "node" else None
                        widths[edge.name] = dest.hidden if dest else dims.hidden
            encoder = self._new(node.name, lambda: MediaEncoder(dims, list(widths.values())))
            init_random(encoder, seed, self.positions[node.name])
            return EncoderRunner(node, self._place(encoder), self.positions[node.name])
        latent_source = self._latent_source(mode)
        image_dims = image_decoder_dims(node, mode, latent_source)
        self.image_sizes[node.name] = (image_dims.image_side, image_dims.image_side)
        image_decoder = self._new(node.name, lambda: ImageDecoder(image_dims))
        init_random(image_decoder, seed, self.positions[node.name])
        return ImageDecoderRunner(node, self._place(image_decoder), self.positions[node.name])

    def _fed_width(self, node: NodePlan) -> int:
        """The hidden size of the one decoder a node's states feed (a DimsError otherwise)."""
        widths = {self.decoder_dims[edge.dest].hidden for (name, _), call in self.calls.items() if name == node.name
                  for edge in call.edges if edge.dest_kind == "node" and edge.dest in self.decoder_dims}
        if len(widths) != 1:
            raise DimsError(f"node {node.name}: its states must feed decoders of one width, found "
                            f"{sorted(widths) or 'none'}")
        return widths.pop()

    def _build_snac(self, node: NodePlan, weights_dir: str, seed: int) -> SnacRunner:
        """An audio codec node given a SNAC checkpoint: the real SNAC decoder over audio tokens."""
        keep_frame = node.dims.get("keep_frame", 1)
        token_offset = node.dims.get("token_offset", 0)
        if not isinstance(token_offset, int):
            raise DimsError(f"node {node.name}: token_offset {token_offset!r} is not a token id")
        dims = SnacCodecDims(read_snac_config(weights_dir), token_offset=token_offset,
                             keep_frame=keep_frame if isinstance(keep_frame, int) else 1)
        model = self._new(node.name, lambda: SnacCodec(dims, seed)).eval()
        load_snac_weights(model.snac, weights_dir)
        return SnacRunner(node, self._place(model), self._stream_policy(node.name), self.positions[node.name])

    def _build_decoder(self, node: NodePlan, mode: DimsMode, weights_dir: Optional[str], seed: int,
                       num_pages: Optional[int]) -> DecoderRunner:
        dims = self.decoder_dims[node.name] = self._decoder_dims(node, mode, weights_dir)
        comm = self.tp_comms.get(node.name)
        is_sharded = comm is not None and comm.size > 1
        if comm is not None and is_sharded and mode == "tiny" and weights_dir is None:
            _check_tiny_splits(node.name, dims, comm.size)
        if is_sharded and any(sub.samples is not None for sub in node.submodels):
            raise DimsError(f"node {node.name}: a node with a depth model does not run tensor-parallel yet")
        if not node.submodels:  # the GPU fast path runs one model
            fast = self._fast_gpu_runner(node, dims, weights_dir, seed, num_pages, mode)
            if fast is not None:
                return fast
        model, dims = self._decoder_model(node, dims, weights_dir, seed)
        size = pool_size(self.plan, node.name, num_pages)
        pool, page_size, max_seq_len, pages = size.entry, size.page_size, size.max_seq_len, size.num_pages
        slots = None
        if dims.has_linear_layers:
            slots = node_slot_pool(node.name, node.recurrent.num_slots if node.recurrent else None,
                                   self.plan.deployment.max_concurrent_requests)
        runner = DecoderRunner(node, dims, self._place(model), page_size, pages, max_seq_len, slots, seed,
                               self._code_frames(node.name, mode), self.positions[node.name], self.placement,
                               self._flashinfer(node, dims, page_size),
                               prefix_cache=pool is not None and pool.prefix_cache == "pages",
                               host_pages=pool.host_pages if pool else 0)
        runner.models_by_walk = build_submodels(node, mode, seed, self.positions[node.name], self._new, self._place,
                                                self._submodel_shard(node) if is_sharded else None)
        runner.depth_by_walk = build_depth_models(node, mode, seed, self.positions[node.name], dims.hidden,
                                                  self._new, self._place)
        return runner

    def _submodel_shard(self, node: NodePlan) -> Callable[[str, DecoderDims, int], Decoder]:
        """On a tensor-parallel rank: this rank's part of a sub-model, split as the node's model is
        (its KV heads, so its KV cache, are the node's)."""
        comm, position = self.tp_comms[node.name], self.positions[node.name]

        def shard(name: str, dims: DecoderDims, seed: int) -> Decoder:
            self._check_memory(name, lambda: Decoder(ShardLayout(dims, comm.rank, comm.size, name).local_dims))
            return build_sharded_decoder(dims, comm, node=name, seed=seed, position=position,
                                         device=self.placement.device)
        return shard

    def _decoder_dims(self, node: NodePlan, mode: DimsMode, weights_dir: Optional[str]) -> DecoderDims:
        """The spec's dims, or the checkpoint's when `--weights` gives one (of the same style)."""
        dims = decoder_dims(node, mode)
        if weights_dir is None:
            return dims
        checkpoint = read_checkpoint_config(weights_dir)
        if checkpoint.style != dims.style:
            kinds = {"llama": "a plain Llama decoder", "qwen3_5": "a Qwen3.5 gated delta-net hybrid"}
            raise WeightsError(f"--weights {shown_path(weights_dir)}: the checkpoint is {kinds[checkpoint.style]} but "
                               f"node {node.name} is {kinds[dims.style]}")
        # before any model is built: 20,000 layers for a 2-layer checkpoint took 30 s and 1.4 GB to build
        # before the loader refused them
        check_layer_count(weights_dir, set(tensor_index(weights_dir)), checkpoint.num_layers)
        self._note_checkpoint_vocab(node, checkpoint, weights_dir)
        _refuse_dynamic_rope_split(self.plan, node, checkpoint, weights_dir)
        return checkpoint

    def _note_checkpoint_vocab(self, node: NodePlan, checkpoint: DecoderDims, weights_dir: str) -> None:
        """A checkpoint of another vocabulary than the spec's: the plan's stop tokens and prompt check
        are the spec's, so say so once (llama.plan with a Qwen3 checkpoint stopped on Llama's end of
        turn, an ordinary token there, and never on Qwen's own); and keep the checkpoint's size, past
        which a prompt id is refused (`add_request`: it wrapped around the embedding)."""
        vocab = node.dims.get("vocab")
        if isinstance(vocab, int) and vocab != checkpoint.vocab:
            LOG.warning("--weights %s: the checkpoint's vocabulary is %d tokens, node %s's spec says %d: the plan's "
                        "stop tokens and prompt checks are the spec's; for this checkpoint's own, write its spec "
                        "with `mstarc init`", shown_path(weights_dir), checkpoint.vocab, node.name, vocab)
        self.checkpoint_vocabs[node.name] = checkpoint.vocab

    def _decoder_model(self, node: NodePlan, dims: DecoderDims, weights_dir: Optional[str],
                       seed: int) -> tuple[Decoder, DecoderDims]:
        """The node's decoder and the dims its runner sizes the KV cache and states by: the whole
        model, or on a tensor-parallel rank its shard (`engine/tp/`) and the rank's local dims."""
        position = self.positions[node.name]
        comm = self.tp_comms.get(node.name)
        if comm is not None and comm.size > 1:
            layout = ShardLayout(dims, comm.rank, comm.size, node.name)
            self._check_memory(node.name, lambda: Decoder(layout.local_dims))
            shard = build_sharded_decoder(dims, comm, node=node.name, weights_dir=weights_dir, seed=seed,
                                          position=position, device=self.placement.device)
            return shard, layout.local_dims
        if weights_dir is None:
            model = self._new(node.name, lambda: Decoder(dims))
            init_random(model, seed, position)
            return model, dims
        self._check_memory(node.name, lambda: Decoder(dims))
        return load_decoder(lambda: Decoder(dims), weights_dir, dims.is_tied_embeddings, self.placement.device,
                            seed=seed, position=position), dims

    def _fast_gpu_runner(self, node: NodePlan, dims: DecoderDims, weights_dir: Optional[str], seed: int,
                         num_pages: Optional[int], mode: DimsMode) -> Optional[DecoderRunner]:
        """On a GPU, a plain decoder runs on the device fast path (engine/gpu/), unless
        `--attention torch` or the node needs the general runner (its reasons in gpu/runner.py)."""
        if self.placement.is_cpu or self.attention == "torch":
            return None
        from mstar.runtime.engine.gpu import setup

        try:
            return setup.fast_runner(self.plan, node, dims, self.calls, self.placement, weights_dir, seed, num_pages,
                                     self._code_frames(node.name, mode), self.positions[node.name],
                                     self.tp_comms.get(node.name, SINGLE_RANK), self.glue,
                                     can_run_ahead=None if self.run_ahead else False)
        except RuntimeError as error:  # FlashInfer's kernel build, CUDA out of memory at capture, ...
            detail = " ".join(str(error).split())[:400]
            raise EngineError(f"node {node.name}: the GPU fast path could not start (building FlashInfer's kernels "
                              f"or capturing the decode graphs failed): {detail}") from None

    def _place(self, model: torch.nn.Module) -> Any:
        """The model itself on the CPU; on a GPU, wrapped so that its runner stays device-free."""
        return model if self.placement.is_cpu else OnDevice(model, self.placement)

    def _flashinfer(self, node: NodePlan, dims: DecoderDims, page_size: int) -> Optional[FlashInferAttention]:
        """The node's FlashInfer backend, None for the torch path (`attention` rules in __init__)."""
        if self.attention == "torch" or dims.num_full_layers == 0:
            return None
        reason = unavailable_reason(self.placement.device, dims.head_dim)
        if any(sub.dims.get("qo_heads", dims.num_qo_heads) != dims.num_qo_heads
               for sub in node.submodels if sub.samples is None):  # a depth model attends over its own KV
            reason = "a sub-model has other query heads than the node (the backend is planned for one count)"
        if reason is not None:
            if self.attention == "flashinfer":
                raise EngineError(f"--attention flashinfer: node {node.name}: {reason}")
            return None
        return FlashInferAttention(self.placement.device, dims.num_qo_heads, dims.num_kv_heads, dims.head_dim,
                                   page_size)

    def offload_figures(self) -> dict[str, dict[str, int]]:
        """Per kv node with a host pool: the KV pages moved to it and back so far (for the report)."""
        return {name: runner.offload.figures() for name, runner in self.runners.items()
                if isinstance(runner, DecoderRunner) and runner.offload}

    def attention_backends(self) -> dict[str, str]:
        """kv node -> the attention backend its steps use where they can (for the report)."""
        return {name: runner.attention_backend()
                for name, runner in self.runners.items() if isinstance(runner, DecoderRunner)}

    def _code_frames(self, node: str, mode: DimsMode) -> dict[str, tuple[int, int]]:
        """Token edges of `node` that feed a multi-quantizer codec -> (quantizers, codebook)."""
        codecs = {n.name: n for n in self.plan.nodes if n.model_kind == "audio_codec"}
        frames = {}
        for (name, _), call in self.calls.items():
            if name == node:
                for edge in call.edges:
                    if edge.dest in codecs and edge.dest_kind in ("node", "stream"):
                        dims = codec_dims(codecs[edge.dest], mode)
                        if dims.num_quantizers > 1:  # one code per item needs no frames
                            frames[edge.name] = (dims.num_quantizers, dims.codebook)
        return frames

    def _new(self, node: str, factory: Callable[[], ModelT]) -> ModelT:
        """Build a model after checking that every model so far fits in memory: on the meta device
        for spec dims, where building could exhaust memory; tiny models are built, then counted
        (initialising parameters on the meta device imports torch's compiler stack, seconds of
        start-up that a tiny run should not pay)."""
        if not self.is_tiny:
            self._check_memory(node, factory)
            return factory()
        try:
            model = factory()
        except (RuntimeError, MemoryError) as error:  # dims tiny mode does not shrink (a conv kernel)
            if not is_out_of_memory(error):
                raise
            raise EngineError(f"node {node}: its model cannot be allocated at tiny dims ({type(error).__name__}: "
                              f"{str(error).splitlines()[0]}); the plan's dims ask more than this machine "
                              "holds") from None
        self._count_weights(node, model)
        return model

    def _check_memory(self, node: str, factory: Callable[[], torch.nn.Module]) -> None:
        with torch.device("meta"):
            probe = factory()
        self._count_weights(node, probe)

    def _count_weights(self, node: str, model: torch.nn.Module) -> None:
        self._num_weight_bytes += sum(p.numel() * p.element_size() for p in model.parameters())
        limit = int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") * MEMORY_FRACTION)
        if self._num_weight_bytes > limit:
            raise EngineError(
                f"node {node}: the models' weights need {self._num_weight_bytes / 2**30:.1f} GiB but this "
                f"machine allows {limit / 2**30:.1f} GiB; use --dims tiny (or a smaller checkpoint)"
            )

    def _stream_policy(self, node: str):
        for partition in self.plan.partitions:
            for stream in partition.streams:
                if stream.consumer_node == node:
                    return stream.policy
        return None

    def _latent_source(self, mode: DimsMode) -> Optional[DecoderDims]:
        """Dims of the model that runs an image flow (a call taking `latents`), if any: the node's
        sub-model for that walk where it has one (Cosmos 3's generation tower, whose latents are its
        own: 1024 tokens where the node's default is 4096, and every image request failed on a VAE
        decoder sized by the node's), else the node's decoder."""
        nodes = {node.name: node for node in self.plan.nodes}
        for (name, walk), call in self.calls.items():
            if call.is_image_flow and name in self.decoder_dims:
                node = nodes[name]
                sub = next((sub for sub in node.submodels if walk in sub.walks and sub.samples is None), None)
                return submodel_dims(node, sub, mode) if sub is not None else self.decoder_dims[name]
        return None

    # ------------------------------------------------------------------ Engine protocol

    def add_request(self, request_id: str, request: Any) -> Optional[str]:
        """None, or why the request can never run. The reason names no request id, as the simulated
        engine's: the caller has it (outputs.jsonl's `id`), and a server's client saw the run
        loop's internal one ("request req-0 cannot run: ...")."""
        try:
            state = RequestState.from_request(request_id, request)
        except (SamplingError, GuidanceError, TypeError, ValueError, ArithmeticError) as error:
            return str(error)
        unknown = unknown_label_problem(self.plan, state.guidance.scales)
        if unknown:
            return unknown
        empty = self.empty_prompt.problem(request)
        if empty:
            return f"cannot run: {empty}"
        media = request.get("media") if isinstance(request, dict) else getattr(request, "media", None)
        media = media if isinstance(media, Mapping) else {}
        misplaced = self.media_placeholders.problem(state.prompt_tokens, media) or self._media_refusal(request, media)
        if misplaced:
            return f"cannot run: {misplaced}"
        problem, scorer = self._prompt_logprobs_runner() if state.params.prompt_logprobs is not None else (None, None)
        if problem:
            return f"cannot run: prompt_logprobs: {problem}"
        for runner in self.runners.values():
            reason = runner.refusal(state)
            if reason:
                return f"cannot run: {reason}"  # the reason says why (memory: "can never fit")
        reason = self._checkpoint_vocab_refusal(state)
        if reason:
            return f"cannot run: {reason}"
        if scorer is not None:
            scorer.scoring.add(request_id)
        self.requests[request_id] = state
        return None

    def _media_refusal(self, request: Any, media: Mapping[str, Any]) -> Optional[str]:
        """The request's prompt media that an encoder on its route (the walks it names in a
        partition, the plan's default elsewhere) cannot take as features, said with what it takes
        (`EncoderRunner.media_refusal`); an image of another shape failed the request at its first
        encoder step, after it had taken KV pages."""
        if not media:
            return None
        route = request.get("route") if isinstance(request, dict) else getattr(request, "route", None)
        route = route if isinstance(route, Mapping) else {}
        walks = {name for part in self.plan.partitions for name in route.get(part.name, default_walks(part))}
        nodes = {call.node for walk in self.plan.walks if walk.name in walks for call in walk.calls}
        for node in sorted(nodes):
            runner = self.runners.get(node)
            problem = runner.media_refusal(media) if isinstance(runner, EncoderRunner) else None
            if problem:
                return problem
        return None

    def _checkpoint_vocab_refusal(self, state: RequestState) -> Optional[str]:
        """A prompt id past the vocabulary of a checkpoint that a node taking the text prompt loaded
        (the plan's check is the spec's vocabulary; the embedding took ids modulo the checkpoint's)."""
        tokens = state.prompt_tokens
        if not self.checkpoint_vocabs or not tokens:
            return None
        for node in self.plan.nodes:
            vocab = self.checkpoint_vocabs.get(node.name)
            if vocab is not None and takes_text_prompt(node):
                problem = token_ids_problem(node.name, vocab, tokens, "the checkpoint's vocabulary")
                if problem is not None:
                    return problem
        return None

    def run_step(self, step: Step) -> StepResult:
        return self.wait(self.launch(step))

    def launch(self, step: Step) -> StepHandle:
        """Runs the step as the plan row it names (`step_check.py`): a step that disagrees with
        its row is a StepContractError, and kv rows attend by the row's attention route. A kv
        node's device may still run it on return (its runner's `start`); `wait` collects."""
        started = time.perf_counter()
        plan_row = self.checker.check(step)
        if plan_row.is_guidance_keyed:
            self.checker.check_mode(step, self.requires_guidance)
        runner = self.runners.get(step.node)
        results: list[RowResult] = []
        node, calls, requests = step.node, self.calls, self.requests
        # The rows' calls and requests looked up in C; row by row only when some lookup misses.
        row_calls: list[Any] = list(map(calls.get, zip(repeat(node), map(_walk_of, step.rows))))
        row_requests: list[Any] = list(map(requests.get, map(_request_id_of, step.rows)))
        rows = list(zip(step.rows, row_calls, row_requests))
        # (`is_not` in C: `None in row_calls` would run the dataclasses' `__eq__` per row)
        if runner is not None and all(map(is_not, row_calls, repeat(None))) and all(map(is_not, row_requests,
                                                                                         repeat(None))):
            step_rows: list[StepRow] = []  # every row found: the loop below has nothing to do
        else:
            step_rows, rows = step.rows, []
        for row in step_rows:
            call = calls.get((node, row.walk))
            request = requests.get(row.request_id)
            if runner is None or call is None:
                error = f"the plan has no call of node {step.node} in walk {row.walk}"
                results.append(RowResult(row.request_id, error=error))
            elif request is None:
                error = f"request {row.request_id} was never added to the engine"
                results.append(RowResult(row.request_id, error=error))
            else:
                rows.append((row, call, request))
        failed: list[str] = []
        finish: Callable[[], list[RowResult]] = list
        if rows and runner is not None:  # rows only when the runner exists (above)
            if isinstance(runner, DecoderRunner):
                known, failed, finish = runner.start(rows, self.runs_partial_steps, step.attention,
                                                     plan_row.decode_walks, step.worker,
                                                     (step.capture, step.token_bucket))
            else:
                known, failed = runner.run(rows, self.runs_partial_steps)
            results.extend(known)
        return StepHandle(step, pending=(results, failed, finish, started))

    def wait(self, handle: StepHandle) -> StepResult:
        if handle.pending is None:
            raise RuntimeError("wait on a step handle this engine never launched")
        results, failed, finish, started = handle.pending
        ran = finish()
        rows = results + ran
        if results or failed:
            token_ids, stop_rows = None, []
        elif isinstance(ran, TokenRows):  # the runner answered in columns too (gpu/decode_columns.py)
            token_ids, stop_rows = ran.token_ids, ran.stop_rows
        else:
            token_ids, stop_rows = _token_columns(handle.step.rows, rows)
        return StepResult(rows=rows, allocation_failed=failed, elapsed_s=time.perf_counter() - started,
                          token_ids=token_ids, stop_rows=stop_rows)

    def launch_ahead(self, worker: int, node: str, rows: list[tuple[str, str]],
                     chunks: Optional[AheadChunks] = None) -> None:
        """The run loop speculates that `worker`'s next step of `node` runs these (request id,
        walk) rows: a runner whose device runs ahead of the host launches it now (gpu/runner.py).
        chunks: its rows that feed a prompt's next chunk, and the step's shape."""
        runner = self.runners.get(node)
        if not isinstance(runner, DecoderRunner):
            return
        if not rows:
            runner.prelaunch(worker, [])
            return
        calls, requests = self.calls, self.requests
        ids, walks = zip(*rows)  # the lookups in C; the rows some lookup misses are left out
        row_calls: list[Any] = list(map(calls.get, zip(repeat(node), walks)))
        row_requests: list[Any] = list(map(requests.get, ids))
        entries = list(zip(ids, walks, row_calls, row_requests))
        if not (all(map(is_not, row_calls, repeat(None))) and all(map(is_not, row_requests, repeat(None)))):
            entries = [entry for entry in entries if entry[2] is not None and entry[3] is not None]
        if chunks is None:
            runner.prelaunch(worker, entries)
        else:
            runner.prelaunch(worker, entries, chunks, self.checker.decode_walks.get((worker, chunks.key), frozenset()))

    def claim_prefix(self, request_id: str, node: str, tokens: list[int]) -> int:
        """Start the request's KV on `node` on its prompt's cached prefix (runners/decoder.py)."""
        runner, request = self.runners.get(node), self.requests.get(request_id)
        if not isinstance(runner, DecoderRunner) or request is None:
            return 0
        return runner.claim_prefix(request, tokens)

    def requires_guidance(self, request_id: str, node: str) -> bool:
        """Whether the request requires guidance on `node` (plan/guidance_mode.py's rule, over the
        scales and the explicit route it was added with); False for one never added."""
        rule, request = self.checker.guidance_rules.get(node), self.requests.get(request_id)
        return rule is not None and request is not None and rule.requires(request.guidance.scales,
                                                                          request.route_walks)

    def end_request(self, request_id: str) -> None:
        for runner in self.runners.values():
            runner.end_request(request_id)
        self.requests.pop(request_id, None)

    def end_node(self, request_id: str, node: str) -> None:
        runner = self.runners.get(node)
        if runner is not None:
            runner.end_request(request_id)  # its pages, slots and claim on this node only

    def kv_pages(self) -> dict[str, tuple[int, int]]:
        """Per kv node: (pages in use, pages in its pool), for a server's metrics."""
        pages = {}
        for name, runner in self.runners.items():
            if isinstance(runner, DecoderRunner):
                pages[name] = (runner.pool.num_pages - runner.pool.num_free_pages, runner.pool.num_pages)
            elif isinstance(runner, WhisperDecoderRunner):  # reserved, not paged (kv/reserved_pages.py)
                pages[name] = (runner.pages.num_held, runner.pages.num_pages)
        return pages


def _rerun_nodes(runners: Mapping[str, Any]) -> frozenset[str]:
    """EngineCaps.rerun_nodes of an engine running `runners` (node -> runner)."""
    return frozenset(name for name, runner in runners.items() if _reruns_failed_steps(runner))


def _reruns_failed_steps(runner: Any) -> bool:
    """Whether the run loop may run the rows of a step of the runner's node that raised again
    (EngineCaps.rerun_nodes): a decoder that puts its requests back as they were (DecoderRunner
    `rewinds_failed_steps`; not the GPU fast path's) and keeps no recurrent state, whose state
    moves a token a run; or an encoder or an image decoder, whose rows change nothing of their
    requests. Not a codec (its requests count the stream items it decoded, row by row) nor
    Whisper's decoder (its windows' state)."""
    if isinstance(runner, DecoderRunner):
        return runner.rewinds_failed_steps and runner.slots is None and runner.node.recurrent is None
    return isinstance(runner, (EncoderRunner, ImageDecoderRunner, WhisperEncoderRunner, Qwen3AsrEncoderRunner))


def _token_columns(step_rows: list[StepRow], rows: list[RowResult]) -> tuple[Optional[np.ndarray], list[int]]:
    """The step's answer in columns (`StepResult.token_ids`, `stop_rows`), so the conductor moves
    its decode rows at once (conductor/lane_pass.py), when the contract holds: every row of the step
    answered, in step order, with no error, and every output of each row is the one token it
    sampled (`[token]`) and carries no log-probabilities; else (None, []) and the conductor reads
    the rows."""
    if len(rows) != len(step_rows):
        return None, []
    tokens = []
    for step_row, result in zip(step_rows, rows):
        outputs = result.outputs
        if (result.error is not None or result.request_id != step_row.request_id or not outputs
                or result.logprobs is not None):  # (the columns carry no log-probabilities)
            return None, []
        token = None
        for value in outputs.values():
            if type(value) is not list or len(value) != 1 or type(value[0]) is not int or (
                    token is not None and value[0] != token):
                return None, []  # a mask, hidden states, several tokens: not a one-token answer
            token = value[0]
        tokens.append(token)
    return np.array(tokens, dtype=np.int64), [index for index, result in enumerate(rows) if result.is_stop]


def plan_glue(plan: Plan, plan_path: Optional[str], device: str) -> Optional[ModuleType]:
    """The plan's generated glue (named in its header, beside the plan at `plan_path`), which packs
    the GPU fast path's steps; None on the CPU (the CPU path never packs) or without a path (a plan
    built in memory): the fast path then packs with numpy. `mstar run`, `mstar serve` and every
    rank process load it the same way."""
    if device == "cpu" or plan_path is None:
        return None
    from mstar.runtime.engine.glue_loader import GlueLoadError, load_plan_glue

    try:
        return load_plan_glue(plan_path, plan)
    except GlueLoadError as error:
        raise EngineError(str(error)) from None


def build(plan: Plan, args: Any) -> TorchEngine:
    """The engine the CLI asks for: reads `args.dims`, `args.weights`, `args.seed`, `args.kv_pages`,
    `args.device`, `args.attention`, `args.no_run_ahead` and, off the CPU, `args.plan` (the plan's
    path: its generated glue, named in the plan's header, packs the GPU fast path's steps)."""
    device = getattr(args, "device", None)
    device = "cpu" if device is None else device  # an empty --device is refused, not read as the CPU
    plan_path = getattr(args, "plan", None)
    glue = plan_glue(plan, plan_path if isinstance(plan_path, str) else None, device)
    return TorchEngine(
        plan,
        dims=getattr(args, "dims", None) or "tiny",
        weights_dir=getattr(args, "weights", None),
        seed=getattr(args, "seed", None) or 0,
        num_pages=getattr(args, "kv_pages", None),
        device=device,
        attention=getattr(args, "attention", None) or "auto",
        run_ahead=not getattr(args, "no_run_ahead", False),
        glue=glue,
    )
