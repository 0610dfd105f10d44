"""Paged prefill attention in Triton: the prompt rows of a whole packed graph's split route, each
query token against its row's paged K/V up to its own position, grouped-query, split over the
row's positions, with no host planning and no separate merge pass per row.

In: q `[T, Hq, D]` (the step's tokens, any token and head stride), one layer's K and V pages
`[pages, page_size, Hkv, D]` (the cache's NHD layout), and FlashInfer's CSR description of the
rows, device int32 arrays at fixed addresses (a graph's): `qo_indptr [R + 1]` (each row's tokens in
q), `kv_indptr [R + 1]`, `kv_indices`, `last_page_len [R]`; rows before `first_row` are skipped
(the split route's row 0 holds the decode rows' tokens, which the decode kernel attends). A row's
query tokens are the last of its KV positions (its new tokens, already written into the pages), so
token i of a row of n tokens and L positions attends to positions 0..L - n + i. Out: each such
token's output written into `out [T, Hq, D]`; other tokens are left as they were.

How: a program per (query block, KV head, split). A block is `block_t` consecutive tokens of one row
times the KV head's group of query heads, the rows of one tensor-core product (`block_t x
group_pad` = 64); the program finds its row from the rows' block counts (a prefix sum over the
CSR array, no host schedule), walks its split's share of the positions the block needs in tiles of
`block_n` (each position's page looked up in the row's page list), masking each query token's
later positions, with an online softmax in fp32. With more than one split the programs write fp32
partial outputs and their log-sum-exp and a second kernel merges each token's heads over the splits.
The grid is fixed per graph (`graph_shape`: a CUDA graph cannot change it); programs past the
step's blocks find no tokens and store nothing. It serves the heads the decode kernel serves
(`decode_attention.supports`), whose tile and padded group it shares.

Why: in a whole split graph FlashInfer's graph-mode fa2 prefill always splits the KV and merges
the splits with a persistent kernel that took 29 us a layer on the H200 whatever the context (468 us
of a 40-row + 216-token chunk step's 2.85 ms of kernels at context 0), the step's decode rows'
outputs then replace its own by a `torch.where`, and it needs a host plan before every replay.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU installs without Triton keep FlashInfer or torch attention
    triton = None

from mstar.runtime.engine.gpu.decode_attention import DOT_FP32, LOG2E, split_range, walk_positions
from mstar.runtime.engine.gpu.kernels import pdl_launch

QUERY_ROWS = 64  # rows of a program's product: block_t tokens x the group's padded query heads


@dataclass(frozen=True)
class PrefillShape:
    """A graph's prompt-row attention: heads, head dim, page size, the CSR arrays' rows and the
    first row attended, the step's token bucket (all fixed by the graph), splits per block and
    the tiles a program reads."""
    num_qo_heads: int
    num_kv_heads: int
    head_dim: int
    page_size: int
    num_rows: int
    num_tokens: int
    first_row: int = 0
    num_splits: int = 1
    block_n: int = 64
    min_split_tokens: int = 256
    num_warps: int = 4
    num_stages: int = 2
    query_rows: int = QUERY_ROWS
    blocks_last: bool = False  # the token blocks on the grid's slowest axis (`graph_shape`)

    @property
    def group_pad(self) -> int:
        return triton.next_power_of_2(self.num_qo_heads // self.num_kv_heads)

    @property
    def block_t(self) -> int:
        return max(1, self.query_rows // self.group_pad)

    @property
    def num_blocks(self) -> int:
        """Programs along the tokens: every row's tokens in whole blocks, each row of the step
        wasting at most one partial block."""
        return -(-self.num_tokens // self.block_t) + self.num_rows - self.first_row


def graph_shape(num_qo_heads: int, num_kv_heads: int, head_dim: int, page_size: int, num_rows: int,
                num_tokens: int, first_row: int, sm_count: int) -> PrefillShape:
    """The shape a graph of `num_tokens` tokens over `num_rows` CSR rows launches: splits so the
    token blocks x KV heads x splits reach two programs an SM (a power of two, at most 8), tiles of
    16 KiB of K as the decode kernel's.

    The grid's order: the token blocks vary fastest (the programs dispatched together share a KV
    head and split, so their keys stay in L2) unless the blocks past the step's tokens, one a
    possible row (a graph's grid is fixed for its bucket), outnumber the bucket's own: then the
    blocks go on the slowest axis, so those programs are dispatched after every real one instead of
    between them, and the tiles hold 8 KiB of K instead of 16 (more programs resident, so the idle
    ones drain sooner). On the H200, 16 calls in a graph, Llama heads, 216 tokens after 0 / 4,096 /
    7,936 in a 256 bucket over 64 CSR rows: 17.8 / 42.6 / 71.4 us a call, against 25.7 / 53.5 / 79.5
    with 16 KiB tiles and 25.8 / 62.8 / 95.8 with the blocks first; over 2 rows the blocks first and
    16 KiB tiles stay the quickest (docs/engine.md, "The split route on Triton")."""
    shape = PrefillShape(num_qo_heads, num_kv_heads, head_dim, page_size, num_rows, num_tokens, first_row)
    token_blocks = -(-num_tokens // shape.block_t)
    needed = -(-2 * sm_count // (token_blocks * num_kv_heads))
    splits = min(8, 1 << (needed - 1).bit_length())
    blocks_last = num_rows - first_row > token_blocks
    block_n = (4096 if blocks_last else 8192) // head_dim
    return PrefillShape(num_qo_heads, num_kv_heads, head_dim, page_size, num_rows, num_tokens, first_row,
                        num_splits=splits, block_n=block_n, min_split_tokens=max(block_n, 256), blocks_last=blocks_last)


def partial_numel(shape: PrefillShape) -> int:
    """fp32 elements of a split shape's scratch: each (token, query head, split) holds its partial
    output and, after all of those, its log-sum-exp; none without splits."""
    if shape.num_splits == 1:
        return 0
    return shape.num_tokens * shape.num_qo_heads * shape.num_splits * (shape.head_dim + 1)


def prefill_attention(shape: PrefillShape, q: torch.Tensor, k_pages: torch.Tensor, v_pages: torch.Tensor,
                      qo_indptr: torch.Tensor, kv_indptr: torch.Tensor, kv_indices: torch.Tensor,
                      last_page_len: torch.Tensor, out: torch.Tensor, partial: torch.Tensor | None = None) -> None:
    """Attend the rows' tokens from `shape.first_row` on (module docstring) into `out`. partial:
    fp32 scratch of at least `partial_numel(shape)` elements (allocated here when not given)."""
    hq, hkv, d = shape.num_qo_heads, shape.num_kv_heads, shape.head_dim
    assert q.shape[0] == shape.num_tokens and tuple(q.shape[1:]) == (hq, d), "the shape's tokens and heads"
    assert out.shape == q.shape and out.stride(2) == 1, "out: a [T, Hq, D] tensor of contiguous head dims"
    assert k_pages.stride() == v_pages.stride(), "K and V pages share one layout"
    assert q.stride(2) == 1 and k_pages.stride(3) == 1, "a head's dims are contiguous"
    assert k_pages.shape[1] == shape.page_size and tuple(k_pages.shape[2:]) == (hkv, d), "the shape's pages"
    assert qo_indptr.shape[0] >= shape.num_rows + 1 and last_page_len.shape[0] >= shape.num_rows, "the CSR rows"
    is_split = shape.num_splits > 1
    if is_split and partial is None:
        partial = torch.empty(partial_numel(shape), dtype=torch.float32, device=q.device)
    group = hq // hkv
    grid = ((hkv, shape.num_splits, shape.num_blocks) if shape.blocks_last
            else (shape.num_blocks, hkv, shape.num_splits))
    _prefill_kernel[grid](
        q, k_pages, v_pages, qo_indptr, kv_indptr, kv_indices, last_page_len, partial if is_split else out,
        d ** -0.5 * LOG2E, q.stride(0), q.stride(1), out.stride(0), out.stride(1), k_pages.stride(1),
        k_pages.stride(2), k_pages.stride(0), shape.num_tokens,
        NUM_ROWS=shape.num_rows, ROWS_PAD=triton.next_power_of_2(shape.num_rows + 1), FIRST_ROW=shape.first_row,
        GROUP=group, GROUP_PAD=shape.group_pad, BLOCK_T=shape.block_t, HEAD_DIM=d, PAGE=shape.page_size,
        BLOCK_N=shape.block_n, NUM_SPLITS=shape.num_splits, MIN_SPLIT=shape.min_split_tokens, HQ=hq,
        IS_SPLIT=is_split, BLOCKS_LAST=shape.blocks_last, DOT_FP32=DOT_FP32, num_warps=shape.num_warps,
        num_stages=shape.num_stages, **pdl_launch(q))
    if is_split:
        heads = min(triton.next_power_of_2(hq), max(1, 4096 // (shape.num_splits * d)))
        _merge_kernel[(shape.num_tokens, triton.cdiv(hq, heads))](
            partial, out, qo_indptr, out.stride(0), out.stride(1), shape.num_tokens, NUM_ROWS=shape.num_rows,
            FIRST_ROW=shape.first_row, HQ=hq, HEADS=heads, HEAD_DIM=d, NUM_SPLITS=shape.num_splits, num_warps=4,
            **pdl_launch(q))


if triton is not None:
    @triton.jit
    def _block_row(qo_ptr, block, NUM_ROWS: tl.constexpr, ROWS_PAD: tl.constexpr, FIRST_ROW: tl.constexpr,
                   BLOCK_T: tl.constexpr):
        """(row, the block's first token within the row, the row's first token in q, its token
        count) of token block `block`; a block past the step's finds a token count of 0."""
        r = tl.arange(0, ROWS_PAD)
        starts = tl.load(qo_ptr + r, mask=r < NUM_ROWS, other=0)
        ends = tl.load(qo_ptr + r + 1, mask=r < NUM_ROWS, other=0)
        blocks = tl.where((r >= FIRST_ROW) & (r < NUM_ROWS), tl.cdiv(ends - starts, BLOCK_T), 0)
        ends_at = tl.cumsum(blocks, 0)
        row = tl.sum((ends_at <= block).to(tl.int32), 0)  # rows wholly before the block
        is_row = r == row
        first_block = tl.sum(tl.where(is_row, ends_at - blocks, 0), 0)
        q_start = tl.sum(tl.where(is_row, starts, 0), 0)
        q_len = tl.sum(tl.where(is_row, ends - starts, 0), 0)
        return tl.minimum(row, NUM_ROWS - 1), (block - first_block) * BLOCK_T, q_start, q_len

    @triton.jit
    def _prefill_kernel(q_ptr, k_ptr, v_ptr, qo_ptr, indptr_ptr, indices_ptr, last_ptr, target_ptr, scale,
                        stride_qt, stride_qh, stride_ot, stride_oh, stride_kt, stride_kh, stride_kp, num_tokens,
                        NUM_ROWS: tl.constexpr, ROWS_PAD: tl.constexpr, FIRST_ROW: tl.constexpr,
                        GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, BLOCK_T: tl.constexpr,
                        HEAD_DIM: tl.constexpr, PAGE: tl.constexpr, BLOCK_N: tl.constexpr,
                        NUM_SPLITS: tl.constexpr, MIN_SPLIT: tl.constexpr, HQ: tl.constexpr,
                        IS_SPLIT: tl.constexpr, BLOCKS_LAST: tl.constexpr, DOT_FP32: tl.constexpr,
                        PDL: tl.constexpr):
        if BLOCKS_LAST:  # the grid's order (`graph_shape`)
            block, kv_head, split = tl.program_id(2), tl.program_id(0), tl.program_id(1)
        else:
            block, kv_head, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        if PDL:
            tl.extra.cuda.gdc_wait()
        row, first, q_start, q_len = _block_row(qo_ptr, block, NUM_ROWS, ROWS_PAD, FIRST_ROW, BLOCK_T)
        first_page = tl.load(indptr_ptr + row)
        num_pages = tl.load(indptr_ptr + row + 1) - first_page
        kv_len = tl.where(num_pages > 0, (num_pages - 1) * PAGE + tl.load(last_ptr + row), 0)
        # the product's rows: token m // GROUP_PAD of the block, query head m % GROUP_PAD of the group
        m = tl.arange(0, BLOCK_T * GROUP_PAD)
        in_row = first + m // GROUP_PAD
        g = m % GROUP_PAD
        is_query = (in_row < q_len) & (g < GROUP)
        token = (q_start + in_row).to(tl.int64)
        heads = kv_head * GROUP + g
        own = kv_len - q_len + in_row  # each query token's own position: it attends up to it
        d = tl.arange(0, HEAD_DIM)
        q = tl.load(q_ptr + token[:, None] * stride_qt + heads[:, None] * stride_qh + d[None, :],
                    mask=is_query[:, None], other=0.0)
        if DOT_FP32:
            q = q.to(tl.float32)
        # the positions some token of the block needs, cut into equal shares in whole tiles
        end = tl.where(first < q_len, kv_len - q_len + tl.minimum(first + BLOCK_T, q_len), 0)
        lo, hi = split_range(end, split, NUM_SPLITS, MIN_SPLIT, BLOCK_N)
        acc, mx, denom = walk_positions(q, k_ptr, v_ptr, indices_ptr, first_page, lo, hi, own, kv_head, scale,
                                        stride_kt, stride_kh, stride_kp, BLOCK_T * GROUP_PAD, HEAD_DIM, PAGE,
                                        BLOCK_N, DOT_FP32)
        if PDL:
            tl.extra.cuda.gdc_launch_dependents()
        is_empty = denom == 0.0
        o = acc / tl.where(is_empty, 1.0, denom)[:, None]
        if IS_SPLIT:
            # partial outputs [token, head, split, D], then the log-sum-exps [token, head, split]
            slot = (token * HQ + heads) * NUM_SPLITS + split
            tl.store(target_ptr + slot[:, None] * HEAD_DIM + d[None, :], o, mask=is_query[:, None])
            lse = tl.where(is_empty, float("-inf"), mx + tl.log2(tl.where(is_empty, 1.0, denom)))
            tl.store(target_ptr + num_tokens * HQ * NUM_SPLITS * HEAD_DIM + slot, lse, mask=is_query)
        else:
            tl.store(target_ptr + token[:, None] * stride_ot + heads[:, None] * stride_oh + d[None, :],
                     o.to(target_ptr.dtype.element_ty), mask=is_query[:, None])

    @triton.jit
    def _merge_kernel(partial_ptr, out_ptr, qo_ptr, stride_ot, stride_oh, num_tokens, NUM_ROWS: tl.constexpr,
                      FIRST_ROW: tl.constexpr, HQ: tl.constexpr, HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
                      NUM_SPLITS: tl.constexpr, PDL: tl.constexpr):
        """A token's heads (HEADS of them) merged over the splits by their log-sum-exps; only the
        tokens of the attended rows (the others' partials were never written)."""
        token = tl.program_id(0).to(tl.int64)
        h = tl.program_id(1) * HEADS + tl.arange(0, HEADS)
        s = tl.arange(0, NUM_SPLITS)
        d = tl.arange(0, HEAD_DIM)
        if PDL:
            tl.extra.cuda.gdc_wait()
        first_token = tl.load(qo_ptr + FIRST_ROW).to(tl.int64)
        end_token = tl.load(qo_ptr + NUM_ROWS).to(tl.int64)
        tokens = token + tl.zeros([HEADS], tl.int64)  # a block: the interpreter's `&` of a block and a scalar fails
        is_head = (h < HQ) & (tokens >= first_token) & (tokens < end_token)
        slot = (token * HQ + h[:, None]) * NUM_SPLITS + s[None, :]  # [HEADS, NUM_SPLITS]
        is_slot = is_head[:, None] & (s[None, :] < NUM_SPLITS)
        lse = tl.load(partial_ptr + num_tokens * HQ * NUM_SPLITS * HEAD_DIM + slot, mask=is_slot,
                      other=float("-inf"))
        o = tl.load(partial_ptr + slot[:, :, None] * HEAD_DIM + d[None, None, :],
                    mask=is_slot[:, :, None] & (d[None, None, :] < HEAD_DIM), other=0.0)
        if PDL:
            tl.extra.cuda.gdc_launch_dependents()
        top = tl.max(lse, 1)
        w = tl.where(lse == float("-inf"), 0.0, tl.exp2(lse - tl.where(top == float("-inf"), 0.0, top)[:, None]))
        total = tl.sum(w, 1)
        merged = tl.sum(o * w[:, :, None], 1) / tl.where(total == 0.0, 1.0, total)[:, None]
        tl.store(out_ptr + token * stride_ot + h[:, None] * stride_oh + d[None, :],
                 merged.to(out_ptr.dtype.element_ty), mask=is_head[:, None])
