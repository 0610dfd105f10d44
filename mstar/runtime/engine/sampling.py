"""Token sampling: greedy, or temperature / top-p with a repetition penalty and a per-request seed.

In: one row's logits `[vocab]`, the request's `SamplingParams`, the tokens it has seen so far, and
its own `torch.Generator` (seeded once from the request seed). Out: a token id. Each request draws
from its own generator, so its samples do not depend on which other requests share the step.
`temperature` None or 0 means greedy (argmax after the penalty).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

import torch


class SamplingError(ValueError):
    """A request's sampling settings are out of range."""


@dataclass(frozen=True)
class SamplingParams:
    temperature: Optional[float] = None
    top_p: float = 1.0
    repetition_penalty: float = 1.0
    seed: int = 0
    stop_tokens: frozenset[int] = field(default_factory=frozenset)
    max_tokens: Optional[int] = None

    @property
    def is_greedy(self) -> bool:
        return not self.temperature

    @classmethod
    def from_request(cls, request: Any) -> "SamplingParams":
        """Read the fields of a conductor request (an object or a dict); absent fields keep defaults."""
        def get(*names: str, default: Any = None) -> Any:
            for name in names:
                value = request.get(name) if isinstance(request, dict) else getattr(request, name, None)
                if value is not None:
                    return value
            return default

        stop = get("stop_tokens", "stop_token_ids", "stop", default=())
        params = cls(
            temperature=get("temperature"),
            top_p=float(get("top_p", default=1.0)),
            repetition_penalty=float(get("repetition_penalty", default=1.0)),
            seed=int(get("seed", default=0)),
            stop_tokens=frozenset(int(t) for t in ([stop] if isinstance(stop, int) else stop)),
            max_tokens=get("max_tokens"),
        )
        if params.temperature is not None and params.temperature < 0:
            raise SamplingError(f"temperature must be >= 0, got {params.temperature}")
        if not 0 < params.top_p <= 1:
            raise SamplingError(f"top_p must be in (0, 1], got {params.top_p}")
        if params.repetition_penalty <= 0:
            raise SamplingError(f"repetition_penalty must be > 0, got {params.repetition_penalty}")
        return params


def apply_repetition_penalty(logits: torch.Tensor, history: torch.Tensor, penalty: float) -> torch.Tensor:
    """HF's rule: a seen token's positive logit is divided by `penalty`, a negative one multiplied."""
    if penalty == 1.0 or history.numel() == 0:
        return logits
    seen = torch.unique(history.long() % logits.shape[0])
    picked = logits[seen]
    out = logits.clone()
    out[seen] = torch.where(picked > 0, picked / penalty, picked * penalty)
    return out


def sample_token(logits: torch.Tensor, params: SamplingParams, history: torch.Tensor,
                 generator: torch.Generator) -> int:
    """One token id from `logits` `[vocab]`."""
    logits = apply_repetition_penalty(logits.float(), history, params.repetition_penalty)
    if params.is_greedy:
        return int(torch.argmax(logits))
    probs = torch.softmax(logits / params.temperature, dim=-1)
    sorted_probs, order = torch.sort(probs, descending=True)
    # Keep the smallest prefix whose mass reaches top_p (always at least the top token).
    is_kept = (torch.cumsum(sorted_probs, 0) - sorted_probs) < params.top_p
    kept = sorted_probs * is_kept
    cdf = torch.cumsum(kept / kept.sum(), 0)
    draw = torch.rand(1, generator=generator)
    index = min(int(torch.searchsorted(cdf, draw)), int(is_kept.sum()) - 1)
    return int(order[index])
