"""What the torch engine keeps per request: sampling settings, token history, counters."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


from mstar.runtime.engine.runners.guidance import GuidanceParams
from mstar.runtime.engine.sampling import SamplingParams


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

    @classmethod
    def from_request(cls, request_id: str, request: Any) -> "RequestState":
        get = request.get if isinstance(request, dict) else (lambda name, default=None: getattr(request, name, default))
        return cls(
            request_id=request_id,
            params=SamplingParams.from_request(request),
            prompt_tokens=[int(t) for t in (get("prompt_tokens") or [])],
            guidance=GuidanceParams.from_request(request),
            route_walks=frozenset(walk for walks in (get("route") or {}).values() for walk in walks),
        )
