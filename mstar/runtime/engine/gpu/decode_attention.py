"""Paged decode attention in Triton: one query token a row against its paged K/V, grouped-query,
split over the row's tokens, with no host planning.

In: q `[rows, Hq, D]`, one layer's K and V pages `[pages, page_size, Hkv, D]` (the cache's NHD
layout), and FlashInfer's CSR description of each row's pages, the arrays a decode graph's
`staged` buffer already holds: `kv_indptr [rows + 1]`, `kv_indices`, `last_page_len [rows]`
(int32, on the device). Out: `[rows, Hq, D]` in q's dtype, softmax(q k^T * sm_scale) v per query
head over the row's whole KV (a decode row attends to every cached position, itself included); a
row of no positions (the glue's padding rows: indptr repeated, last page length 0) gets zeros.

How: a program per (row, KV head, split) loads its group's query heads once (padded to 16 rows for
the tensor-core product), walks its share of the row's tokens in tiles of `block_n` positions
(each position's page looked up in the row's page list), and keeps an online softmax in fp32. A row's
tokens are cut into `num_splits` equal shares of at least `min_split_tokens`, so a short row uses
fewer programs; with more than one split, the programs write fp32 partial outputs and their
log-sum-exp, and a second kernel merges them per query head. With `set_merge_in_kernel(True)`
(`mstar bench engine --decode-merge-in-kernel`, a what-if: slower on the H200, docs/engine.md)
each program counts itself in its (row, KV head)'s counter after storing, and the program that counts last
merges the group's query heads over the splits (in split order: the result does not depend on
who came last), writes the output and sets the counter back to zero: one launch a layer, where the
merge kernel is a second launch in every layer of a graph of at most 32 rows (each launch costs a
few microseconds there whatever its work). The number of splits is fixed per
batch size (a CUDA graph cannot change its grid), chosen so that rows x KV heads x splits fills the
GPU: `splits_for(rows, kv_heads, sm_count)`; from `2 x SMs` programs without splitting, none.

Why: FlashInfer's tensor-core decode (its prefill kernel) read Llama-3.2-1B's KV (head dim 64, 32
query heads over 8) at 1.54x its bytes at 64 rows of 1024 positions on the H200, plus a merge
kernel per layer, and needs a host `plan()` before every step; this kernel reads the device arrays
the step's packing already wrote, so a decode graph needs no planning at all.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU installs without Triton keep FlashInfer or torch attention
    triton = None

from mstar.runtime.engine.gpu.decode_heads import MAX_GROUP, serves_heads
from mstar.runtime.engine.gpu.kernels import pdl_launch

if triton is not None:
    from mstar.runtime.engine.gpu.kernels import arrivals_before

LOG2E = 1.4426950408889634
MIN_QUERY_ROWS = MAX_GROUP  # tl.dot's smallest M: a KV head's query group is padded to this
# Triton's interpreter multiplies bf16 operands of tl.dot as their raw 16-bit patterns, so under it
# (the CPU tests) the products take fp32 operands; on a GPU they stay bf16 (tensor cores).
DOT_FP32 = os.environ.get("TRITON_INTERPRET") == "1"


_merges_in_kernel = False  # measured slower on the H200: 1.073 against 1.001 ms a 1-row decode step


def set_merge_in_kernel(enabled: bool) -> None:
    """Merge a split shape's partial outputs in the attention kernel's last program (module
    docstring), or in a merge kernel of their own (the default); graphs captured afterwards follow it."""
    global _merges_in_kernel
    _merges_in_kernel = enabled


def merges_in_kernel() -> bool:
    return _merges_in_kernel


@dataclass(frozen=True)
class DecodeShape:
    """A decode graph's attention: heads, head dim, page size, rows (fixed by the graph) and
    splits per row, with the tile of positions each step of a program reads."""
    num_qo_heads: int
    num_kv_heads: int
    head_dim: int
    page_size: int
    num_splits: int = 1
    block_n: int = 64
    min_split_tokens: int = 256
    num_warps: int = 4
    num_stages: int = 3


def graph_shape(num_qo_heads: int, num_kv_heads: int, head_dim: int, page_size: int, rows: int,
                sm_count: int) -> DecodeShape:
    """The shape a decode graph of `rows` rows launches: splits to fill the device, and a tile of
    16 KiB of K (128 positions at head dim 64, 32 at 256), the best of a sweep on the H200
    (docs/engine.md, "Decode attention in Triton")."""
    block_n = 8192 // head_dim
    return DecodeShape(num_qo_heads, num_kv_heads, head_dim, page_size, splits_for(rows, num_kv_heads, sm_count),
                       block_n=block_n, min_split_tokens=max(block_n, 128), num_warps=4, num_stages=2)


def splits_for(rows: int, num_kv_heads: int, sm_count: int, max_splits: int = 32) -> int:
    """Splits a row so that rows x KV heads x splits reaches two programs an SM (module docstring):
    a power of two (the merge reads every split of a head as one block), at most `max_splits`."""
    needed = -(-2 * sm_count // (rows * num_kv_heads))
    return min(max_splits, 1 << (needed - 1).bit_length())


def supports(num_qo_heads: int, num_kv_heads: int, head_dim: int) -> bool:
    """Whether the kernel runs here for these heads: Triton installed and `decode_heads.serves_heads`
    (a power-of-two head dim of 16 to 256, a query group that fits the padded product). Any page
    size: each position of a tile looks its page up."""
    return triton is not None and serves_heads(num_qo_heads, num_kv_heads, head_dim)


def decode_attention(shape: DecodeShape, q: torch.Tensor, k_pages: torch.Tensor, v_pages: torch.Tensor,
                     kv_indptr: torch.Tensor, kv_indices: torch.Tensor, last_page_len: torch.Tensor,
                     partial: torch.Tensor | None = None, out: torch.Tensor | None = None,
                     counts: torch.Tensor | None = None) -> torch.Tensor:
    """The attention of `q`'s rows (module docstring). partial: fp32 scratch of at least
    `partial_numel(shape, rows)` elements for a split shape (allocated here when not given).
    out: a contiguous `[rows, Hq, D]` tensor to write (a new one when not given). counts: a split
    shape's arrival counters, int32 zeros of at least rows x KV heads entries, left zero (new zeros
    when not given)."""
    rows = q.shape[0]
    hq, hkv, d = shape.num_qo_heads, shape.num_kv_heads, shape.head_dim
    group = hq // hkv
    assert k_pages.stride() == v_pages.stride(), "K and V pages share one layout"
    assert q.stride(2) == 1 and k_pages.stride(3) == 1, "a head's dims are contiguous"
    assert k_pages.shape[1] == shape.page_size and tuple(k_pages.shape[2:]) == (hkv, d), "the shape's pages"
    assert tuple(q.shape[1:]) == (hq, d), "the shape's query heads"
    if out is None:
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    assert out.shape == q.shape and out.is_contiguous(), "out: a contiguous tensor of q's shape"
    scale = d ** -0.5 * LOG2E
    is_split = shape.num_splits > 1
    if is_split and partial is None:
        partial = torch.empty(partial_numel(shape, rows), dtype=torch.float32, device=q.device)
    merges_here = is_split and _merges_in_kernel
    if merges_here:
        counts = _checked_counts(counts, rows * hkv, q.device)
    _decode_split_kernel[(rows, hkv, shape.num_splits)](
        q, k_pages, v_pages, kv_indptr, kv_indices, last_page_len, partial if is_split else out, out,
        counts if merges_here else out, scale,
        q.stride(0), q.stride(1), k_pages.stride(1), k_pages.stride(2), k_pages.stride(0),
        GROUP=group, GROUP_PAD=max(MIN_QUERY_ROWS, triton.next_power_of_2(group)), HEAD_DIM=d,
        PAGE=shape.page_size, BLOCK_N=shape.block_n, NUM_SPLITS=shape.num_splits,
        MIN_SPLIT=shape.min_split_tokens, HQ=hq, IS_SPLIT=is_split, MERGE_HERE=merges_here, DOT_FP32=DOT_FP32,
        num_warps=shape.num_warps, num_stages=shape.num_stages, **pdl_launch(q))
    if is_split and not merges_here:
        _merge_kernel[(rows, hq)](partial, out, out.stride(0), out.stride(1), HQ=hq, HEAD_DIM=d,
                                  NUM_SPLITS=shape.num_splits, num_warps=4, **pdl_launch(q))
    return out


def _checked_counts(counts: torch.Tensor | None, needed: int, device: torch.device) -> torch.Tensor:
    """The caller's arrival counters (int32 zeros of at least `needed` entries), or new zeros."""
    if counts is None:
        return torch.zeros(needed, dtype=torch.int32, device=device)
    if counts.dtype != torch.int32 or counts.numel() < needed:
        raise ValueError(f"decode_attention: counts must be int32 zeros of at least {needed} entries")
    return counts


def partial_numel(shape: DecodeShape, rows: int) -> int:
    """fp32 elements of a split step's scratch: each (row, query head, split) holds its partial
    output and, after all of those, its log-sum-exp."""
    per_split = rows * shape.num_qo_heads * shape.num_splits
    return per_split * (shape.head_dim + 1)


if triton is not None:
    @triton.jit
    def split_range(end, split, NUM_SPLITS: tl.constexpr, MIN_SPLIT: tl.constexpr, BLOCK_N: tl.constexpr):
        """Positions [lo, hi) of `split` among positions [0, end): equal shares in whole tiles, at
        least MIN_SPLIT positions each (a short row uses fewer splits; the rest get none). The
        decode kernel and `prefill_attention`'s share it."""
        share = tl.maximum(tl.cdiv(end, NUM_SPLITS), MIN_SPLIT)
        share = tl.cdiv(share, BLOCK_N) * BLOCK_N
        lo = split * share
        return lo, tl.minimum(end, lo + share)

    @triton.jit
    def walk_positions(q, k_ptr, v_ptr, indices_ptr, first_page, lo, hi, own, kv_head, scale, stride_kt, stride_kh,
                       stride_kp, M: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE: tl.constexpr, BLOCK_N: tl.constexpr,
                       DOT_FP32: tl.constexpr):
        """The online softmax of `M` query rows over positions [lo, hi) of a row's pages (its page
        list from `first_page` in `indices_ptr`), each query row masked past its own position `own`
        (a decode row's is past every position): (unnormalised output, running max, denominator),
        base 2. The decode kernel and `prefill_attention`'s share it."""
        mx = tl.full([M], float("-inf"), tl.float32)
        denom = tl.zeros([M], tl.float32)
        acc = tl.zeros([M, HEAD_DIM], tl.float32)
        d = tl.arange(0, HEAD_DIM)
        n = tl.arange(0, BLOCK_N)
        for start in range(lo, hi, BLOCK_N):
            pos = start + n
            is_pos = pos < hi
            page = tl.load(indices_ptr + first_page + pos // PAGE, mask=is_pos, other=0).to(tl.int64)
            base = page * stride_kp + (pos % PAGE) * stride_kt + kv_head * stride_kh
            k = tl.load(k_ptr + base[:, None] + d[None, :], mask=is_pos[:, None], other=0.0)
            if DOT_FP32:
                k = k.to(tl.float32)
            s = tl.dot(q, tl.trans(k)) * scale
            s = tl.where(is_pos[None, :] & (pos[None, :] <= own[:, None]), s, float("-inf"))
            new_mx = tl.maximum(mx, tl.max(s, 1))
            # a query token whose positions all lie past this tile's start keeps -inf: no NaN from it
            base_mx = tl.where(new_mx == float("-inf"), 0.0, new_mx)
            alpha = tl.exp2(mx - base_mx)
            p = tl.exp2(s - base_mx[:, None])
            denom = denom * alpha + tl.sum(p, 1)
            v = tl.load(v_ptr + base[:, None] + d[None, :], mask=is_pos[:, None], other=0.0)
            if DOT_FP32:
                acc = acc * alpha[:, None] + tl.dot(p, v.to(tl.float32))
            else:
                acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
            mx = new_mx
        return acc, mx, denom

    @triton.jit
    def _decode_split_kernel(q_ptr, k_ptr, v_ptr, indptr_ptr, indices_ptr, last_ptr, part_ptr, out_ptr, count_ptr,
                             scale, stride_qr, stride_qh, stride_kt, stride_kh, stride_kp,
                             GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr,
                             PAGE: tl.constexpr, BLOCK_N: tl.constexpr, NUM_SPLITS: tl.constexpr,
                             MIN_SPLIT: tl.constexpr, HQ: tl.constexpr, IS_SPLIT: tl.constexpr,
                             MERGE_HERE: tl.constexpr, DOT_FP32: tl.constexpr, PDL: tl.constexpr):
        row = tl.program_id(0)
        kv_head = tl.program_id(1)
        split = tl.program_id(2)
        g = tl.arange(0, GROUP_PAD)
        d = tl.arange(0, HEAD_DIM)
        is_query = g < GROUP
        if PDL:
            tl.extra.cuda.gdc_wait()
        first_page = tl.load(indptr_ptr + row)
        num_pages = tl.load(indptr_ptr + row + 1) - first_page
        seq_len = (num_pages - 1) * PAGE + tl.load(last_ptr + row)
        lo, hi = split_range(seq_len, split, NUM_SPLITS, MIN_SPLIT, BLOCK_N)
        heads = kv_head * GROUP + g
        q = tl.load(q_ptr + row.to(tl.int64) * stride_qr + heads[:, None] * stride_qh + d[None, :],
                    mask=is_query[:, None], other=0.0)
        if DOT_FP32:
            q = q.to(tl.float32)
        own = tl.full([GROUP_PAD], 2 ** 30, tl.int32)  # a decode row attends to every position
        acc, m, denom = walk_positions(q, k_ptr, v_ptr, indices_ptr, first_page, lo, hi, own, kv_head, scale,
                                       stride_kt, stride_kh, stride_kp, GROUP_PAD, HEAD_DIM, PAGE, BLOCK_N, DOT_FP32)
        if PDL:
            tl.extra.cuda.gdc_launch_dependents()
        is_empty = denom == 0.0  # a share without positions (a padding row, a split past a short row's end)
        o = acc / tl.where(is_empty, 1.0, denom)[:, None]
        if IS_SPLIT:
            lse = tl.where(is_empty, float("-inf"), m + tl.log2(tl.where(is_empty, 1.0, denom)))
            _store_split(part_ptr, out_ptr, count_ptr, o, lse, row, kv_head, heads, is_query, split, HQ, HEAD_DIM,
                         NUM_SPLITS, MERGE_HERE)
        else:
            tl.store(out_ptr + row.to(tl.int64) * (HQ * HEAD_DIM) + heads[:, None] * HEAD_DIM + d[None, :],
                     o.to(out_ptr.dtype.element_ty), mask=is_query[:, None])

    @triton.jit
    def _store_split(part_ptr, out_ptr, count_ptr, o, lse, row, kv_head, heads, is_query, split, HQ: tl.constexpr,
                     HEAD_DIM: tl.constexpr, NUM_SPLITS: tl.constexpr, MERGE_HERE: tl.constexpr):
        """A split's partial output and log-sum-exp (base 2) into the scratch (outputs [row, head,
        split, D], then the log-sum-exp [row, head, split]); with MERGE_HERE the last split of the
        (row, KV head) to count merges its group (module docstring)."""
        d = tl.arange(0, HEAD_DIM)
        first = (row * HQ + heads) * NUM_SPLITS  # each query head's split 0
        lse_base = tl.num_programs(0) * HQ * NUM_SPLITS * HEAD_DIM
        tl.store(part_ptr + (first + split)[:, None].to(tl.int64) * HEAD_DIM + d[None, :], o, mask=is_query[:, None])
        tl.store(part_ptr + lse_base + first + split, lse, mask=is_query)
        if MERGE_HERE:
            _merge_if_last(part_ptr, out_ptr, count_ptr, o, row, kv_head, heads, is_query, first, lse_base, HQ,
                           HEAD_DIM, NUM_SPLITS)

    @triton.jit
    def _merge_if_last(part_ptr, out_ptr, count_ptr, o, row, kv_head, heads, is_query, first, lse_base,
                       HQ: tl.constexpr, HEAD_DIM: tl.constexpr, NUM_SPLITS: tl.constexpr):
        """Counts this split in; the last of its (row, KV head) merges the group's heads over the
        splits and sets the counter back to zero."""
        d = tl.arange(0, HEAD_DIM)
        counter = count_ptr + row * tl.num_programs(1) + kv_head
        if arrivals_before(counter, NUM_SPLITS) == NUM_SPLITS - 1:
            s = tl.arange(0, NUM_SPLITS)
            lses = tl.load(part_ptr + lse_base + first[:, None] + s[None, :], mask=is_query[:, None],
                           other=float("-inf"), cache_modifier=".cg")
            weights, total = _split_weights(lses, 1)
            merged = o * 0.0
            for other in range(0, NUM_SPLITS):  # in split order
                part = tl.load(part_ptr + (first + other)[:, None].to(tl.int64) * HEAD_DIM + d[None, :],
                               mask=is_query[:, None], other=0.0, cache_modifier=".cg")
                merged += part * tl.sum(tl.where(s[None, :] == other, weights, 0.0), 1)[:, None]
            merged = merged / tl.where(total == 0.0, 1.0, total)[:, None]  # a padding row: zeros
            tl.store(out_ptr + row.to(tl.int64) * (HQ * HEAD_DIM) + heads[:, None] * HEAD_DIM + d[None, :],
                     merged.to(out_ptr.dtype.element_ty), mask=is_query[:, None])
            tl.atomic_xchg(counter, 0)

    @triton.jit
    def _split_weights(lses, AXIS: tl.constexpr):
        """Each split's weight in the merge, 2^(lse - the largest) along AXIS (0 for a split without
        positions, whose lse is -inf), and their sum (0 for a padding row: every split empty)."""
        top = tl.max(lses, axis=AXIS, keep_dims=True)
        top = tl.where(top == float("-inf"), 0.0, top)
        weights = tl.where(lses == float("-inf"), 0.0, tl.exp2(lses - top))
        return weights, tl.sum(weights, axis=AXIS)

    @triton.jit
    def _merge_kernel(partial_ptr, out_ptr, stride_or, stride_oh, HQ: tl.constexpr, HEAD_DIM: tl.constexpr,
                      NUM_SPLITS: tl.constexpr, PDL: tl.constexpr):
        row = tl.program_id(0)
        head = tl.program_id(1)
        s = tl.arange(0, NUM_SPLITS)
        d = tl.arange(0, HEAD_DIM)
        slot = (row * HQ + head) * NUM_SPLITS + s
        lse_base = tl.num_programs(0) * HQ * NUM_SPLITS * HEAD_DIM
        if PDL:
            tl.extra.cuda.gdc_wait()
        lse = tl.load(partial_ptr + lse_base + slot)
        o = tl.load(partial_ptr + slot[:, None].to(tl.int64) * HEAD_DIM + d[None, :])
        if PDL:
            tl.extra.cuda.gdc_launch_dependents()
        w, total = _split_weights(lse, 0)
        merged = tl.sum(o * w[:, None], 0) / tl.where(total == 0.0, 1.0, total)  # a padding row: zeros
        tl.store(out_ptr + row.to(tl.int64) * stride_or + head * stride_oh + d, merged.to(out_ptr.dtype.element_ty))
