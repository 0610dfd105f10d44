"""Token sampling on the device for a whole step: greedy, or temperature with top-k and top-p,
per-row seeds.

In: logits `[R, vocab]` (any float dtype; the arithmetic is fp32), per row a temperature (0, or
below `sampling.MIN_TEMPERATURE` = greedy), top_p (the top token is always kept), seed and counter
(the number of tokens the request has sampled on the node), and top_k (0: no limit), kept together
with top_p as the CPU sampler (`sampling.sample_tokens`) keeps them: the top_k most likely tokens
and, of those, the smallest prefix whose mass reaches top_p of the top k's mass (top_k first, then
top_p over its renormalised distribution, as vLLM and transformers).
Out: token ids `[R]` (int64), on the device.

A step whose rows all limit nothing (top_p 1, no top_k) skips the sort: `is_whole`. On a GPU the
draws are Triton kernels (`sampling_kernels.py`: the noise computed where it is used, the same
numbers; a nucleus by torch's sort, or by a search with its ties all kept: NUCLEUS); elsewhere the
torch ops below.

Random draws come from a counter-based hash of (seed, counter, token id), so a row's draw depends
on its own request only (not on its neighbours, nor on a generator's state that a CUDA graph could
freeze), and the same seed gives the same tokens again. A draw is Gumbel-max over the tokens top-p
keeps, which samples softmax(logits / temperature) restricted to that nucleus.
"""
from __future__ import annotations

from typing import Optional

import torch

from mstar.runtime.engine.gpu import kernels, sampling_kernels
from mstar.runtime.engine.gpu_switches import NUCLEUS_CHOICES
from mstar.runtime.engine.sampling import MIN_TEMPERATURE

_GOLDEN = 0x9E3779B97F4A7C15 - (1 << 64)
_MIX_1 = 0xBF58476D1CE4E5B9 - (1 << 64)
_MIX_2 = 0x94D049BB133111EB - (1 << 64)


def _shift(z: torch.Tensor, bits: int) -> torch.Tensor:
    """Logical right shift of int64 (torch's >> is arithmetic)."""
    return (z >> bits) & ((1 << (64 - bits)) - 1)


def _mix(z: torch.Tensor) -> torch.Tensor:
    """splitmix64's finaliser in wrapping int64 arithmetic."""
    z = (z ^ _shift(z, 30)) * _MIX_1
    z = (z ^ _shift(z, 27)) * _MIX_2
    return z ^ _shift(z, 31)


def hashed_uniform(seeds: torch.Tensor, counters: torch.Tensor, vocab: int) -> torch.Tensor:
    """`[R, vocab]` float64 uniforms in (0, 1), a pure function of (seed, counter, token id)."""
    row = _mix(seeds.long() * _GOLDEN + counters.long())
    token = torch.arange(vocab, device=seeds.device, dtype=torch.long) * _GOLDEN
    bits = _shift(_mix(row.unsqueeze(1) + token.unsqueeze(0)), 11)
    return (bits.double() + 0.5) * 2.0 ** -53


# How the kernels find a nucleus: "search" (`sampling_kernels.nucleus_draw`, no sort) or "sort"
# (torch's sort of every row's vocabulary, the kernels' noise). The search is the default since an
# H100 measured it (docs/engine.md "A nucleus without the sort": 0.83 ms a 64-row top_p step
# against the sort's 1.54, a top_p workload's inter-token p50 2.18 ms against 2.94); `mstar run
# --nucleus sort` keeps the sort, whose ties at the nucleus' edge are a prefix in its own order.
NUCLEUS = "search"


def set_nucleus(name: str) -> None:
    """How every later `sample` call finds a nucleus (NUCLEUS_CHOICES), process-wide."""
    global NUCLEUS
    if name not in NUCLEUS_CHOICES:
        raise ValueError(f"a nucleus is found by one of {', '.join(NUCLEUS_CHOICES)}, got {name!r}")
    NUCLEUS = name


def sample(logits: torch.Tensor, temperature: torch.Tensor, top_p: torch.Tensor, seeds: torch.Tensor,
           counters: torch.Tensor, top_k: Optional[torch.Tensor] = None, is_whole: bool = False,
           is_fused: Optional[bool] = None, nucleus: Optional[str] = None,
           has_both: Optional[bool] = None) -> torch.Tensor:
    """Token ids `[R]` (module docstring); rows with temperature 0 take the argmax. top_k: `[R]`
    int64, 0 for no limit (None: no row has one). is_whole: no row limits its tokens (every top_p
    1, no top_k; the caller knows it on the host): the draw is Gumbel-max over the whole
    vocabulary, without the sort a nucleus needs (what the sort keeps then is every token, but
    those whose probability the cumulative sum's rounding loses past 1, a few ulps). is_fused:
    draw with `sampling_kernels` (None: where they run, a GPU with Triton; False: the torch ops,
    `mstar bench sampler`'s baseline). nucleus: how the kernels find a nucleus (None: NUCLEUS).
    has_both: whether some row has both a top_k and a top_p below 1 (the host knows it; False spares
    the nucleus search its count-only search first; None: assume so wherever a top_k is given)."""
    if is_fused is None:
        is_fused = kernels.available(logits.device)
    if is_fused and is_whole:
        return sampling_kernels.draw_rows(logits, temperature, seeds, counters)
    if is_fused and (nucleus or NUCLEUS) == "search":
        return sampling_kernels.nucleus_draw(logits, temperature, top_p, top_k, seeds, counters, has_both)
    logits = logits.float()  # bf16 from a GPU step (forward.py): exact, and a no-op on fp32
    greedy = logits.argmax(-1)
    is_sampled = temperature >= MIN_TEMPERATURE
    scaled = logits / torch.where(is_sampled, temperature, torch.ones_like(temperature)).unsqueeze(1)
    gumbel = (sampling_kernels.gumbel_noise(seeds, counters, logits.shape[1]) if is_fused
              else -torch.log(-torch.log(hashed_uniform(seeds, counters, logits.shape[1]))).float())
    if is_whole:
        return torch.where(is_sampled, (scaled + gumbel).argmax(-1), greedy)
    probs = torch.softmax(scaled, dim=-1)
    sorted_probs, order = torch.sort(probs, dim=-1, descending=True)
    # Keep the top_k and, of those, the smallest prefix whose mass reaches top_p of the top k's mass
    # (top_k first, then top_p over its renormalised distribution, as the CPU sampler), and always
    # the top token (a top_p that is 0 in fp32 kept nothing).
    limit = top_p.unsqueeze(1)
    in_top_k = None
    if top_k is not None:  # (a top_k was ignored here: the GPU sampled the whole nucleus)
        vocab = logits.shape[1]
        in_top_k = (torch.arange(vocab, device=logits.device).unsqueeze(0)
                    < torch.where(top_k > 0, top_k, torch.full_like(top_k, vocab)).unsqueeze(1))
        top_k_mass = torch.where(top_k.unsqueeze(1) > 0, (sorted_probs * in_top_k).sum(-1, keepdim=True), 1.0)
        limit = limit * top_k_mass
    is_kept_sorted = (torch.cumsum(sorted_probs, -1) - sorted_probs) < limit
    if in_top_k is not None:
        is_kept_sorted &= in_top_k
    is_kept_sorted[:, 0] = True
    is_kept = torch.zeros_like(is_kept_sorted).scatter_(1, order, is_kept_sorted)
    drawn = torch.where(is_kept, scaled + gumbel, torch.full_like(scaled, float("-inf"))).argmax(-1)
    return torch.where(is_sampled, drawn, greedy)
