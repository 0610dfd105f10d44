"""Runs Qwen3-ASR's audio encoder (a stateless `audio_encoder` node with `style=qwen3_asr`).

Per row: the request's 16 kHz samples (its `media prompt audio` input) -> the front end and the
encoder (models/qwen3_asr.py) -> `[num_states(len), decoder hidden]` states under every output
edge; the decoder puts them in place of its prompt's audio placeholders (its `media_token`). A
request without audio fails alone: its prompt was laid out for the states of a real clip
(serve/audio_prompt.py), so stand-in noise could not match it. At most the node's `num_tokens`
states (the spec's bound, 390 for 30 s) per request.
"""
from __future__ import annotations

from typing import Any, Mapping, Optional

import torch

from mstar.plan.schema import NodePlan
from mstar.runtime.engine.models.kinds import CallInfo
from mstar.runtime.engine.models.qwen3_asr import Qwen3AsrEncoder, num_states
from mstar.runtime.engine.runners.request_state import RequestState
from mstar.runtime.engine.runners.stateless import StatelessRunner
from mstar.runtime.engine.runners.values import input_error
from mstar.runtime.step import StepRow


class Qwen3AsrEncoderRunner(StatelessRunner):
    def __init__(self, node: NodePlan, model: Qwen3AsrEncoder, position: int = 0):
        super().__init__(node, position)
        self.model = model
        bound = node.dims.get("num_tokens")
        self.max_states = bound if isinstance(bound, int) and not isinstance(bound, bool) else None

    def compute(self, row: StepRow, call: CallInfo, request: RequestState) -> torch.Tensor:
        name = call.input_with("media")
        raw = row.inputs.get(name) if name is not None else None
        if raw is None:
            raise input_error(call, name, "this encoder needs the request's audio (a prompts line's `audio` WAV file)")
        samples = torch.as_tensor(raw, dtype=torch.float32)
        if samples.dim() != 1 or samples.numel() == 0:
            raise input_error(call, name, f"audio must be a non-empty 1-D tensor of 16 kHz samples, got shape "
                                          f"{tuple(samples.shape)}")
        too_long = self.media_problem({"audio": samples})  # refused at admission (media_placeholders.py)
        if too_long is not None:
            raise input_error(call, name, too_long)
        return self.model(samples)

    def states_of(self, media: Mapping[str, Any]) -> Optional[int]:
        """The states this encoder makes of a request's media (its audio clip), None without a clip it
        could take: the engine checks at admission that the prompt holds that many placeholders."""
        audio = media.get("audio")
        shape = getattr(audio, "shape", None)
        if shape is None or len(shape) != 1 or not shape[0]:
            return None  # `compute` says what is wrong with it, as before
        return num_states(int(shape[0]))

    def media_problem(self, media: Mapping[str, Any]) -> Optional[str]:
        """Why the request's clip can never run here (longer than the node's bound), or None."""
        count = self.states_of(media)
        if count is None or self.max_states is None or count <= self.max_states:
            return None
        seconds = int(media["audio"].shape[0]) / 16000
        return f"{seconds:.2f} s of audio gives {count} states, past the node's num_tokens={self.max_states}"
