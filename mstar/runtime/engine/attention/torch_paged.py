"""Attention over the paged KV cache on the CPU, one packed step at a time.

A step packs its rows along one token axis: a prompt chunk is a segment of many tokens, a decode
row a segment of one token; both kinds may sit side by side in one call (routes.py calls this
once per path of the step's attention route). Each segment first writes its new K/V at its
positions (unless it only reads, like an image-flow step), then attends over its whole sequence:
causally for text, bidirectionally within the segment for image tokens.

Every segment is computed on its own, so a row's numbers do not depend on which rows share its step
(the batch-invariance the tests check). A long segment's queries go in blocks whose scores hold at
most SCORES_BLOCK_ELEMENTS values: a whole 100k-token prompt's scores were 24 heads x 100k x 100k
fp32 (about a terabyte) in one tensor, and the allocation failed the step of every request in it.
The blocks follow from the segment's own shape, so they keep the batch invariance; they equal one
piece up to the products' rounding, and a segment below the bound is one piece as before.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

SCORES_BLOCK_ELEMENTS = 1 << 26  # 256 MB of fp32 scores; a segment below it is computed in one piece


@dataclass
class Segment:
    """One row's tokens in a packed step.

    `flat_index` holds the cache indices of positions `0 .. num_cached + num_tokens - 1` for a row
    that writes, or `0 .. num_cached - 1` for a read-only row.
    """

    start: int
    num_tokens: int
    num_cached: int
    flat_index: torch.Tensor
    is_causal: bool = True
    is_write: bool = True
    is_decode: bool = False  # the row's walk runs on decode kernels (a `split` step's decode part)

    @property
    def end(self) -> int:
        return self.start + self.num_tokens


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    cache_k: torch.Tensor, cache_v: torch.Tensor,
                    segments: list[Segment], scale: float, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """q `[N, Hq, D]`, k/v `[N, Hkv, D]` for the step's N tokens; cache_k/v `[S, Hkv, D]` (one layer).

    Writes the step's K/V into the cache for writing segments and returns `[N, Hq, D]`: `out`
    (filled at these segments' tokens only) when given, else a new tensor.
    """
    out = torch.empty_like(q) if out is None else out
    group = q.shape[1] // k.shape[1]
    for seg in segments:
        q_seg, k_seg, v_seg = q[seg.start:seg.end], k[seg.start:seg.end], v[seg.start:seg.end]
        if seg.is_write:
            new_index = seg.flat_index[seg.num_cached:]
            cache_k[new_index] = k_seg
            cache_v[new_index] = v_seg
            keys, values = cache_k[seg.flat_index], cache_v[seg.flat_index]
        else:
            old_index = seg.flat_index[:seg.num_cached]
            keys = torch.cat([cache_k[old_index], k_seg])
            values = torch.cat([cache_v[old_index], v_seg])
        keys = keys.repeat_interleave(group, dim=1)
        values = values.repeat_interleave(group, dim=1)
        block = max(1, SCORES_BLOCK_ELEMENTS // (q.shape[1] * keys.shape[0]))
        for first in range(0, seg.num_tokens, block):
            last = min(first + block, seg.num_tokens)
            out[seg.start + first:seg.start + last] = _attend(q_seg[first:last], keys, values, scale,
                                                              seg.num_cached + first if seg.is_causal else None)
    return out


def _attend(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float,
            first_position: Optional[int]) -> torch.Tensor:
    """Queries `[T, H, D]` over keys and values `[S, H, D]`; causal with the first query at
    `first_position` (None: every query sees every key)."""
    scores = torch.einsum("thd,shd->hts", q, keys) * scale
    if first_position is not None:
        query_pos = torch.arange(q.shape[0]).unsqueeze(1) + first_position
        key_pos = torch.arange(keys.shape[0]).unsqueeze(0)
        scores = scores.masked_fill(key_pos > query_pos, float("-inf"))
    probs = torch.softmax(scores.float(), dim=-1).to(values.dtype)
    return torch.einsum("hts,shd->thd", probs, values)
