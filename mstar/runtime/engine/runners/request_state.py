"""What the torch engine keeps per request: sampling settings, token history, counters."""
from __future__ import annotations

import operator
from dataclasses import dataclass, field
from typing import Any, Optional

import torch

from mstar.runtime.engine.runners.guidance import GuidanceParams
from mstar.runtime.engine.sampling import SamplingParams


def token_ids(values: Any) -> list[int]:
    """A prompt's token ids as Python ints. Integers (numpy's and torch's too) take the C loop of
    `operator.index`, 3x the comprehension's speed: an 8,192-token prompt arrives beside running
    decode rows, and its admission is host time before their next step (docs/runtime.md). Other
    values (strings of digits, floats) take `int` as before."""
    try:
        return list(map(operator.index, values))
    except TypeError:
        return [int(t) for t in values]


@dataclass
class RequestState:
    request_id: str
    params: SamplingParams
    prompt_tokens: list[int]
    guidance: GuidanceParams = field(default_factory=GuidanceParams)
    route_walks: frozenset[str] = frozenset()  # every walk the request's explicit route names
    history: dict[str, list[int]] = field(default_factory=dict)  # node -> token ids fed so far
    num_sampled: dict[str, int] = field(default_factory=dict)  # node -> tokens sampled so far
    # node -> the tokens sampled there so far, kept for a request with a penalty only
    # (`output_tokens`; the GPU fast path's penalties read them, gpu/penalties.py)
    sampled: dict[str, list[int]] = field(default_factory=dict)
    num_items_seen: dict[str, int] = field(default_factory=dict)  # codec node -> stream items decoded
    last_token: dict[str, list[int]] = field(default_factory=dict)  # node -> its latest sampled token
    # (node, input) -> (the value, its classification) of a prompt cut into chunks (values.classify_for_row)
    cut_inputs: dict[tuple[str, str], tuple[Any, Any]] = field(default_factory=dict)
    # node -> the hidden states of a cut prompt's chunks so far, where its call sends a value per
    # position (runners/decoder.py `_whole_prompt`: the last chunk sends them all)
    cut_hidden: dict[str, list[Any]] = field(default_factory=dict)
    # node -> the log-probabilities of a cut prompt's last fed position so far, which predict its
    # next chunk's first token (engine/prompt_logprobs.py)
    prompt_tails: dict[str, Any] = field(default_factory=dict)
    # set from params (fields, not properties: the GPU fast path reads them a row a step)
    has_output_penalty: bool = field(init=False)  # a presence or frequency penalty
    has_penalty: bool = field(init=False)  # those, or a repetition penalty
    wants_logprobs: bool = field(init=False)  # params.logprobs is set (RowResult.logprobs)
    # a logit_bias or a min_tokens: its rows' logits take additions (sampling.row_biases)
    has_biases: bool = field(init=False)

    def __post_init__(self) -> None:
        params = self.params
        self.has_output_penalty = params.presence_penalty != 0.0 or params.frequency_penalty != 0.0
        self.has_penalty = self.has_output_penalty or params.repetition_penalty != 1.0
        self.wants_logprobs = params.logprobs is not None
        self.has_biases = bool(params.logit_bias) or params.min_tokens > 0

    def count_sampled(self, node: str, token: int) -> int:
        """One more token sampled on `node`; the count so far."""
        num_sampled = self.num_sampled[node] = self.num_sampled.get(node, 0) + 1
        if self.has_penalty:
            self.sampled.setdefault(node, []).append(token)
        return num_sampled

    def mark(self, node: str) -> tuple[Any, ...]:
        """What a step of `node` may change of this request, before it runs (`rewind` puts it back)."""
        return (len(self.history.get(node, ())), self.num_sampled.get(node), len(self.sampled.get(node, ())),
                self.last_token.get(node), len(self.cut_hidden.get(node, ())), self.prompt_tails.get(node))

    def rewind(self, node: str, mark: tuple[Any, ...]) -> None:
        """Back to `mark`: a step of `node` that raised part-way left the request as before it, so
        the run loop may run its row again (EngineCaps.rerun_nodes) with its history, counts and
        draws as if the step had never run (a retried row saw its fed tokens twice)."""
        num_fed, num_sampled, num_kept, last_token, num_hidden, tail = mark
        for lists, length in ((self.history, num_fed), (self.sampled, num_kept), (self.cut_hidden, num_hidden)):
            if node in lists:
                del lists[node][length:]
        for values, value in ((self.num_sampled, num_sampled), (self.last_token, last_token),
                              (self.prompt_tails, tail)):
            if value is None:
                values.pop(node, None)
            else:
                values[node] = value

    @classmethod
    def from_request(cls, request_id: str, request: Any) -> "RequestState":
        get = request.get if isinstance(request, dict) else (lambda name, default=None: getattr(request, name, default))
        return cls(
            request_id=request_id,
            params=SamplingParams.from_request(request),
            prompt_tokens=token_ids(get("prompt_tokens") or []),
            guidance=GuidanceParams.from_request(request),
            route_walks=frozenset(walk for walks in (get("route") or {}).values() for walk in walks),
        )


def output_tokens(requests: list[RequestState], node: str) -> Optional[list[torch.Tensor]]:
    """`sample_tokens`' outputs for these rows: the tokens each request sampled on `node`, or None
    when no request has a presence or frequency penalty (nothing is built on the common path)."""
    if not any(request.has_output_penalty for request in requests):
        return None
    return [torch.tensor(request.sampled.get(node, []), dtype=torch.long) for request in requests]
