"""The plan's attention routes on the torch reference: which attention path a step's rows take.

In: the step's route (`MixtureEntry.attention`: decode, prefill, split or packed), the step's
q/k/v and the layer's paged cache, the step's segments. Out: the attention output `[N, Hq, D]`.

    decode   one query token a row (decode kernels); a row of more tokens is a RouteError
    prefill  prompt rows of any length (prefill kernels)
    split    a mixed step in two calls: rows whose walk runs on decode kernels (`Segment.is_decode`)
             through `decode_attention`, the others through `prefill_attention`
    packed   a mixed step as one packed call (decode rows are one-token segments)

Every path computes each segment on its own (`paged_attention`), so a row's numbers are the same
whichever route runs it and whichever rows share its step (batch invariance); the route decides
which calls are made, as the GPU kernels would. `none` (no attention: stateless nodes) has no
path here: the engine refuses such a step on a kv node before it gets this far.
"""
from __future__ import annotations

import torch

from mstar.runtime.engine.attention.torch_paged import Segment, paged_attention

ROUTES = ("decode", "prefill", "split", "packed")


class RouteError(ValueError):
    """A step whose rows do not fit its attention route."""


def decode_attention(q, k, v, cache_k, cache_v, segments: list[Segment], scale: float,
                     out: torch.Tensor) -> torch.Tensor:
    long = next((s for s in segments if s.num_tokens != 1), None)
    if long is not None:
        raise RouteError(f"attention route decode takes one token a row, but a row feeds {long.num_tokens}")
    return paged_attention(q, k, v, cache_k, cache_v, segments, scale, out)


def prefill_attention(q, k, v, cache_k, cache_v, segments: list[Segment], scale: float,
                      out: torch.Tensor) -> torch.Tensor:
    return paged_attention(q, k, v, cache_k, cache_v, segments, scale, out)


def packed_attention(q, k, v, cache_k, cache_v, segments: list[Segment], scale: float,
                     out: torch.Tensor) -> torch.Tensor:
    return paged_attention(q, k, v, cache_k, cache_v, segments, scale, out)


def split_attention(q, k, v, cache_k, cache_v, segments: list[Segment], scale: float,
                    out: torch.Tensor) -> torch.Tensor:
    decode = [s for s in segments if s.is_decode]
    prompt = [s for s in segments if not s.is_decode]
    if decode:
        decode_attention(q, k, v, cache_k, cache_v, decode, scale, out)
    if prompt:
        prefill_attention(q, k, v, cache_k, cache_v, prompt, scale, out)
    return out


def attend(route: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache_k: torch.Tensor,
           cache_v: torch.Tensor, segments: list[Segment], scale: float) -> torch.Tensor:
    """The step's attention by its route (looked up at call time, so a test may spy on a path)."""
    paths = {"decode": decode_attention, "prefill": prefill_attention, "split": split_attention,
             "packed": packed_attention}
    path = paths.get(route)
    if path is None:
        raise RouteError(f"attention route {route!r} has no attention path (one of {', '.join(ROUTES)})")
    return path(q, k, v, cache_k, cache_v, segments, scale, torch.empty_like(q))
