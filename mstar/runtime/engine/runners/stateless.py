"""Runs the rows of a stateless node's step: codec, media encoder, or image decoder.

Rows are computed one by one (these nodes hold no KV and their inputs differ in size per row).
Each returns the same value under every output edge name of its (node, walk) call.

- codec: codes in (a list of ints, or a chunk of per-frame code tensors; grouped into frames of
  `quantizers` codes) -> int16 samples; an empty chunk gives no samples. With a sliding
  `window(size, stride)` stream policy a short window is padded to `size` by repeating its last code
  and the codec keeps frame `keep_frame` (stride codes' worth of samples) of each window, as SNAC does
  in Orpheus; with `left_context(chunk, context)` it drops the samples of the context codes it has
  already decoded; otherwise it keeps everything.
- SNAC (an audio codec node given a SNAC checkpoint): audio tokens in, in whole frames (see
  `SnacRunner`) -> int16 samples.
- encoder: media features `[n, feature_dim]` in (synthesised from the request seed when absent) ->
  one embedding tensor per output, as wide as the node that output feeds.
- image_decoder: latents in -> an RGB image tensor `[3, H, W]` in [0, 1].

Each reads the input of the role its kind takes (`tokens`, `media`, `flow_latents`); stand-in media
are seeded by the node's and the input's positions, never by a name.
"""
from __future__ import annotations

from typing import Any, Mapping, Optional

import torch

from mstar.plan.schema import ChunkPolicyPlan, NodePlan
from mstar.runtime.engine.runners.request_state import RequestState
from mstar.runtime.engine.runners.values import (
    InputError, classify, classify_input, failed_row, input_error, out_of_memory_row, synthesise,
)
from mstar.runtime.engine.models.codec import CodecDecoder
from mstar.runtime.engine.models.snac_codec import SnacCodec
from mstar.runtime.engine.models.encoders import MediaEncoder
from mstar.runtime.engine.models.image_decoder import ImageDecoder
from mstar.runtime.engine.models.kinds import CallInfo
from mstar.runtime.step import RowResult, StepRow

Rows = list[tuple[StepRow, CallInfo, RequestState]]
MAX_FEATURE_ROWS = 4096  # the most feature rows a media encoder takes from one request


class StatelessRunner:
    """Shared row loop: subclasses turn one row's inputs into one output value."""

    def __init__(self, node: NodePlan, position: int = 0):
        """position: the node's index in the plan (what stand-in media are seeded by)."""
        self.node = node
        self.position = position
        self.input_positions = {r.name: i for i, r in enumerate(node.input_roles)}

    def run(self, rows: Rows, is_partial_ok: bool = False) -> tuple[list[RowResult], list[str]]:
        """Each row alone (a row that fails, fails alone: `row_failure`); stateless rows never wait
        for memory (`is_partial_ok` changes nothing)."""
        results = []
        for row, call, request in rows:
            try:
                with torch.no_grad():
                    outputs = self.row_outputs(row, call, request)
            except Exception as error:
                results.append(self.row_failure(row, error))
                continue
            results.append(RowResult(row.request_id, outputs=outputs))
        return results, []

    def row_outputs(self, row: StepRow, call: CallInfo, request: RequestState) -> dict[str, object]:
        """A row's value under each output the call names (the node's one value, by default)."""
        value = self.compute(row, call, request)
        return {name: value for name in call.output_names}

    def compute(self, row: StepRow, call: CallInfo, request: RequestState) -> object:
        raise NotImplementedError

    def row_failure(self, row: StepRow, error: Exception) -> RowResult:
        """The failed result of a row whose input the node cannot take or whose memory could not be
        allocated (that row fails alone); any other error is raised again (it fails the step)."""
        if isinstance(error, InputError):
            return failed_row(row.request_id, self.node.name, error)
        failed = out_of_memory_row(row.request_id, self.node.name, error)
        if failed is None:
            raise error
        return failed

    def refusal(self, request: RequestState) -> Optional[str]:
        return None

    def end_request(self, request_id: str) -> None:
        return None

    def _first_value(self, row: StepRow, call: CallInfo, role: str, kind: str) -> Optional[torch.Tensor]:
        """The first value of `kind` (tokens or embeddings) among the call's inputs of `role`, else None."""
        return self._first_input(row, call, role, kind)[1]

    def _first_input(self, row: StepRow, call: CallInfo, role: str,
                     kind: str) -> tuple[Optional[str], Optional[torch.Tensor]]:
        """`_first_value` and the input it came from (None, None when none has one); a value no
        input's kind takes is the client's fault where the request brought it (`input_error`)."""
        for name in call.inputs:
            if call.input_roles.get(name) != role:
                continue
            value = classify_input(call, name, row.inputs.get(name))
            if value.kind == kind:
                return name, value.tensor
        return None, None

    def _stand_in(self, request: RequestState, call: CallInfo, role: str, shape: tuple[int, ...]) -> torch.Tensor:
        """Deterministic media for the call's input of `role` when the request brought none."""
        position = self.input_positions.get(call.input_with(role) or "", len(self.input_positions))
        return synthesise(request.params.seed, self.position, position, shape)


class CodecRunner(StatelessRunner):
    def __init__(self, node: NodePlan, model: CodecDecoder, policy: Optional[ChunkPolicyPlan], position: int = 0):
        super().__init__(node, position)
        self.model = model
        self.policy = policy

    def compute(self, row: StepRow, call: CallInfo, request: RequestState) -> torch.Tensor:
        codes = self._first_value(row, call, "tokens", "tokens")
        if codes is None:  # an empty chunk decodes to no audio
            return torch.zeros(0, dtype=torch.int16)
        frames = self.model.frames(codes)
        spf = self.model.dims.samples_per_token
        policy = self.policy
        if policy is not None and policy.kind == "window":
            stride = policy.stride or policy.size
            if frames.shape[0] < policy.size:
                frames = torch.cat([frames, frames[-1:].expand(policy.size - frames.shape[0], -1)])
            start = self.model.dims.keep_frame * stride * spf
            return self.model(frames)[start:start + stride * spf]
        if policy is not None and policy.kind == "left_context":
            seen = request.num_items_seen.get(self.node.name, 0)
            num_context = min(policy.context or 0, seen, frames.shape[0])
            request.num_items_seen[self.node.name] = seen + frames.shape[0] - num_context
            return self.model(frames)[num_context * spf:]
        return self.model(frames)


class SnacRunner(StatelessRunner):
    """The SNAC codec over a stream of audio tokens (Orpheus): stream policies count tokens, the
    codec decodes whole frames of `tokens_per_frame` (a trailing partial frame gives no audio).
    A window short of its size is padded by repeating its last frame, and the runner keeps frame
    `keep_frame` of it (`stride` tokens' worth), as Orpheus keeps samples 2048:4096 of each
    28-token window."""

    def __init__(self, node: NodePlan, model: SnacCodec, policy: Optional[ChunkPolicyPlan], position: int = 0):
        super().__init__(node, position)
        self.model = model
        self.policy = policy

    def compute(self, row: StepRow, call: CallInfo, request: RequestState) -> torch.Tensor:
        dims = self.model.dims
        per_frame, spf = dims.tokens_per_frame, dims.samples_per_frame
        tokens = self._first_value(row, call, "tokens", "tokens")
        num_frames = 0 if tokens is None else tokens.shape[0] // per_frame
        if tokens is None or num_frames == 0:
            return torch.zeros(0, dtype=torch.int16)
        frames = self.model.codes(tokens[:num_frames * per_frame])
        policy = self.policy
        if policy is not None and policy.kind == "window":
            size = max(policy.size // per_frame, 1)
            stride = max((policy.stride or policy.size) // per_frame, 1)
            if frames.shape[0] < size:
                frames = torch.cat([frames, frames[-1:].expand(size - frames.shape[0], -1)])
            start = dims.keep_frame * stride * spf
            return self.model(frames)[start:start + stride * spf]
        if policy is not None and policy.kind == "left_context":
            seen = request.num_items_seen.get(self.node.name, 0)
            num_context = min((policy.context or 0) // per_frame, seen, frames.shape[0])
            request.num_items_seen[self.node.name] = seen + frames.shape[0] - num_context
            return self.model(frames)[num_context * spf:]
        return self.model(frames)


class EncoderRunner(StatelessRunner):
    def __init__(self, node: NodePlan, model: MediaEncoder, position: int = 0):
        super().__init__(node, position)
        self.model = model
        self.output_positions = {o.name: i for i, o in enumerate(node.outputs)}

    def row_outputs(self, row: StepRow, call: CallInfo, request: RequestState) -> dict[str, object]:
        """The encoder's one output a head: each under the output the call names."""
        outputs = self.model(self._features(row, call, request))
        return {name: outputs[self.output_positions[name]] for name in call.output_names
                if name in self.output_positions}

    def _features(self, row: StepRow, call: CallInfo, request: RequestState) -> torch.Tensor:
        dims = self.model.dims
        name, features = self._first_input(row, call, "media", "embeddings")
        if features is None:
            return self._stand_in(request, call, "media", (dims.num_tokens, dims.feature_dim))
        if features.shape[1] != dims.feature_dim or features.shape[0] > MAX_FEATURE_ROWS:
            # the request's own media (a 400), or a value another node made (the deployment's fault)
            raise input_error(call, name, f"media features of shape {tuple(features.shape)}; the encoder takes "
                                          f"[n <= {MAX_FEATURE_ROWS}, {dims.feature_dim}]")
        return features

    def media_refusal(self, media: Mapping[str, Any]) -> Optional[str]:
        """Why the request's own media for an input of this encoder that the spec marks `prompt
        image` (or `audio`) cannot be its features, else None: the step's rule (`_features`), at
        admission (such media failed the request at its encoder step, after it took KV pages)."""
        width = self.model.dims.feature_dim
        for role in self.node.input_roles:
            value = media.get(role.prompt) if role.role == "media" and role.prompt is not None else None
            if value is None:
                continue
            shape = tuple(getattr(value, "shape", ()))
            try:
                kind = classify(role.name, value).kind
            except InputError:
                kind = None
            if kind != "embeddings" or len(shape) not in (1, 2) or shape[-1] != width or (
                    len(shape) == 2 and not 1 <= shape[0] <= MAX_FEATURE_ROWS):
                got = f"shape {list(shape)}" if shape else type(value).__name__
                return (f"node {self.node.name}: the request's {role.prompt} media ({got}) are not features this "
                        f"encoder takes: give a float array [n, {width}] of n <= {MAX_FEATURE_ROWS} feature rows")
        return None


class ImageDecoderRunner(StatelessRunner):
    def __init__(self, node: NodePlan, model: ImageDecoder, position: int = 0):
        super().__init__(node, position)
        self.model = model

    def compute(self, row: StepRow, call: CallInfo, request: RequestState) -> torch.Tensor:
        dims = self.model.dims
        shape = (dims.latent_tokens, dims.latent_channels)
        latents = self._first_value(row, call, "flow_latents", "embeddings")
        if latents is None:
            latents = self._stand_in(request, call, "flow_latents", shape)
        if tuple(latents.shape) != shape:
            raise InputError(f"latents of shape {tuple(latents.shape)}; the decoder takes {shape}")
        if not bool(torch.isfinite(latents).all()):  # (a guidance scale of 1e39: a garbage PNG, `stop`)
            raise InputError("the flow's latents are not finite (a guidance scale too large for them?), so no "
                             "image can be drawn from them")
        return self.model(latents)
