"""What the torch engine keeps per request: sampling settings, token history, counters."""
from __future__ import annotations

from array import array
from dataclasses import dataclass, field
from typing import Any, Optional

import numpy as np

from mstar.runtime.engine.runners.guidance import GuidanceParams
from mstar.runtime.engine.sampling import SamplingParams


def token_ids(values: Any) -> list[int]:
    """A prompt's token ids as Python ints (`prompt_token_ids` without the bounds)."""
    return prompt_token_ids(values)[0]


def prompt_token_ids(values: Any) -> tuple[list[int], Optional[tuple[int, int]]]:
    """A prompt's token ids as Python ints, and their (min, max) (None for an empty prompt), which
    the runners' vocabulary check reads instead of scanning the prompt again. An 8,192-token prompt
    is admitted between two steps of running decode rows, on the host's path to their next step
    (docs/runtime.md, "A prompt arriving beside a decode chain"), so this takes C passes only:
    integers (numpy's and torch's too, through `__index__`) fill a 64-bit array in C, numpy reads
    its bounds without a copy, and `tolist` makes the ints (on a 2-core host 0.19 against 0.31 ms
    for the map of `operator.index` and Python's `min` and `max`). Other values (strings of digits,
    floats, ints past 64 bits, bytes) take `int` one by one as before."""
    try:
        if isinstance(values, (bytes, bytearray, memoryview)):
            raise TypeError("an array would read bytes as raw 64-bit words")
        packed = array("q", values)
    except (TypeError, OverflowError):
        ids = [int(t) for t in values]
        return ids, ((min(ids), max(ids)) if ids else None)
    if not packed:
        return [], None
    view = np.frombuffer(packed, dtype=np.int64)
    return packed.tolist(), (int(view.min()), int(view.max()))


@dataclass
class RequestState:
    request_id: str
    params: SamplingParams
    prompt_tokens: list[int]
    guidance: GuidanceParams = field(default_factory=GuidanceParams)
    route_walks: frozenset[str] = frozenset()  # every walk the request's explicit route names
    history: dict[str, list[int]] = field(default_factory=dict)  # node -> token ids fed so far
    num_sampled: dict[str, int] = field(default_factory=dict)  # node -> tokens sampled so far
    num_items_seen: dict[str, int] = field(default_factory=dict)  # codec node -> stream items decoded
    last_token: dict[str, list[int]] = field(default_factory=dict)  # node -> its latest sampled token
    # (node, input) -> (the value, its classification) of a prompt cut into chunks (values.classify_for_row)
    cut_inputs: dict[tuple[str, str], tuple[Any, Any]] = field(default_factory=dict)
    # (min, max) of prompt_tokens when known (`prompt_token_ids`); None: the check scans them
    prompt_bounds: Optional[tuple[int, int]] = None

    @classmethod
    def from_request(cls, request_id: str, request: Any) -> "RequestState":
        get = request.get if isinstance(request, dict) else (lambda name, default=None: getattr(request, name, default))
        prompt, bounds = prompt_token_ids(get("prompt_tokens") or [])
        return cls(
            request_id=request_id,
            params=SamplingParams.from_request(request),
            prompt_tokens=prompt,
            prompt_bounds=bounds,
            guidance=GuidanceParams.from_request(request),
            route_walks=frozenset(walk for walks in (get("route") or {}).values() for walk in walks),
        )
