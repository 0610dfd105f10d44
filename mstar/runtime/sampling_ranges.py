"""The ranges of the sampling settings, checked in one place by the Python API (`serve/api.py`,
before a request is queued) and by the engine (`engine/sampling.py`, for requests that come another
way). Loads no torch: `from mstar import LLM` must stay light."""
from __future__ import annotations

from typing import Optional

# The seeds an engine takes: 64-bit (the device sampler holds them in int64; a seed of 10**30 failed
# its whole step).
SEED_RANGE = (-(2**63), 2**63)


def range_problem(temperature: Optional[float], top_k: Optional[int], top_p: Optional[float], seed: Optional[int],
                  repetition_penalty: Optional[float]) -> Optional[str]:
    """The first setting outside its range, said as the error to raise; None when all are in range
    (None for a setting: left at its default)."""
    infinity = float("inf")
    problems = [
        (temperature is not None and not 0 <= temperature < infinity, f"temperature must be >= 0, got {temperature}"),
        (top_k is not None and top_k < 0, f"top_k must be >= 0 (0: no limit), got {top_k}"),
        (top_p is not None and not 0 < top_p <= 1, f"top_p must be in (0, 1], got {top_p}"),
        (seed is not None and not SEED_RANGE[0] <= seed < SEED_RANGE[1], f"seed must be a 64-bit integer, got {seed}"),
        (repetition_penalty is not None and not 0 < repetition_penalty < infinity,
         f"repetition_penalty must be > 0, got {repetition_penalty}"),
    ]
    return next((message for is_bad, message in problems if is_bad), None)
