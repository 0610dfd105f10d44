"""A step's rows -> the flat int32 arrays the device step reads, in one pinned buffer.

In: per row a `RowSpec` (new token ids, or a loop-back token kept on the device; tokens already
cached; page table; the row's slot in the device token table), the page size, the dummy page, and
a padded shape (rows, tokens) when the step replays a captured bucket.
Out: `PackedStep`: one int32 host array laid out as
`ids[T] | positions[T] | write_slots[T] | token_src[T] | last_index[R] | row_slot[R]`
(T tokens, R rows, both padded), which travels to the device in one non-blocking copy, plus
FlashInfer's CSR arrays on the host (`plan()` reads them there).

Padding rows feed one token at position 0 that writes the dummy page and attends over it alone
(FlashInfer's "dummy page" padding), so a padded replay never touches a request's pages.
"""
from __future__ import annotations

from dataclasses import dataclass
from itertools import chain
from typing import Optional

import numpy as np
import torch

NUM_TOKEN_FIELDS = 4  # ids, positions, write slots, token source
NUM_ROW_FIELDS = 2  # last-token index, row slot


def padded(values: np.ndarray, size: int, fill: int) -> np.ndarray:
    """`values` as int32, extended to `size` entries with `fill` (CSR offsets and per-row fields
    widened to a graph's rows: padding rows of zero length)."""
    out = np.full(size, fill, dtype=np.int32)
    out[:values.shape[0]] = values
    return out


def max_row_pages(max_seq_len: int, page_size: int, num_pool_pages: int) -> int:
    """The most pages one row of a step indexes: a sequence of `max_seq_len` tokens, and never more
    than the pool's pages (a row's pages are distinct). A step's page indices number at most its
    rows times this. Not the pool's pages plus the rows: with a prefix cache rows share pages, so
    the sum of their page tables can pass the pool (many rows on one long prefix). At least 1: a
    padding row indexes the dummy page."""
    return max(1, min(-(-max_seq_len // page_size), num_pool_pages))


@dataclass
class RowSpec:
    token_ids: Optional[list[int]]  # None: one loop-back token read from the device token table
    num_cached: int
    page_table: list[int]
    row_slot: int  # the request's entry in the device token table
    is_decode: bool = False  # a row of one of the plan's decode walks (the split route's decode kernel)
    walk_index: int = 0  # the row's walk among its key's walks (`KeyPlan.walks`: the generated glue's order)

    @property
    def num_tokens(self) -> int:
        return 1 if self.token_ids is None else len(self.token_ids)


@dataclass
class PackedStep:
    num_rows: int  # real rows
    num_padded_rows: int
    num_padded_tokens: int
    host: np.ndarray  # int32, layout in the module docstring (the executor stages it in pinned memory)
    qo_indptr: torch.Tensor  # int32 [R + 1], host
    kv_indptr: torch.Tensor  # int32 [R + 1], host
    kv_indices: torch.Tensor  # int32 [pages], host
    last_page_len: torch.Tensor  # int32 [R], host
    seq_lens: Optional[torch.Tensor] = None  # int32 [R], host: the planner derives them when absent

    def field_sizes(self) -> list[int]:
        t, r = self.num_padded_tokens, self.num_padded_rows
        return [t] * NUM_TOKEN_FIELDS + [r] * NUM_ROW_FIELDS


def _row_arrays(rows: list[RowSpec], page_size: int) -> tuple[np.ndarray, ...]:
    counts = np.array([r.num_tokens for r in rows], dtype=np.int64)
    cached = np.array([r.num_cached for r in rows], dtype=np.int64)
    starts = np.repeat(np.cumsum(counts) - counts, counts)
    positions = np.repeat(cached, counts) + np.arange(counts.sum()) - starts
    num_pages = -(-(cached + counts) // page_size)
    # One pass over the page tables (an array per row cost more than the rest of the packing).
    indices = np.fromiter(chain.from_iterable(r.page_table[:n] for r, n in zip(rows, num_pages.tolist())),
                          dtype=np.int64, count=int(num_pages.sum()))
    page_base = np.repeat(np.cumsum(num_pages) - num_pages, counts)
    slots = indices[page_base + positions // page_size] * page_size + positions % page_size
    last_len = cached + counts - (num_pages - 1) * page_size
    return counts, positions, slots, num_pages, indices, last_len


def pack(rows: list[RowSpec], page_size: int, dummy_page: int, padded_rows: int = 0,
         padded_tokens: int = 0) -> PackedStep:
    """The step's arrays (module docstring); `padded_*` 0 means no padding."""
    counts, positions, slots, num_pages, indices, last_len = _row_arrays(rows, page_size)
    num_tokens, num_rows = int(counts.sum()), len(rows)
    r = max(padded_rows, num_rows)
    t = max(padded_tokens, num_tokens + (r - num_rows))
    num_pad_rows = r - num_rows
    ids = np.zeros(t, dtype=np.int64)
    src = np.full(t, -1, dtype=np.int64)
    token_starts = np.cumsum(counts) - counts
    for row, start in zip(rows, token_starts):
        if row.token_ids is None:
            src[start] = row.row_slot
        else:
            ids[start:start + row.num_tokens] = row.token_ids
    pos = np.zeros(t, dtype=np.int64)
    pos[:num_tokens] = positions
    write = np.full(t, dummy_page * page_size, dtype=np.int64)
    write[:num_tokens] = slots
    last_index = np.concatenate([token_starts + counts - 1, num_tokens + np.arange(num_pad_rows)])
    row_slot = np.array([row.row_slot for row in rows] + [0] * num_pad_rows, dtype=np.int64)
    host = np.concatenate([ids, pos, write, src, last_index, row_slot]).astype(np.int32)
    # Padding rows: one query token each (the tokens after the real ones), one dummy page of one key.
    qo = np.concatenate([[0], np.cumsum(counts), num_tokens + np.arange(1, num_pad_rows + 1)])
    kv = np.concatenate([[0], np.cumsum(num_pages), num_pages.sum() + np.arange(1, num_pad_rows + 1)])
    kv_indices = np.concatenate([indices, np.full(num_pad_rows, dummy_page)])
    last = np.concatenate([last_len, np.ones(num_pad_rows, dtype=np.int64)])
    as_int32 = lambda a: torch.from_numpy(np.ascontiguousarray(a, dtype=np.int32))  # noqa: E731
    return PackedStep(num_rows, r, t, host, as_int32(qo), as_int32(kv), as_int32(kv_indices), as_int32(last))


def fed_ids(ids: torch.Tensor, token_src: torch.Tensor, loop_tokens: torch.Tensor) -> torch.Tensor:
    """The step's token ids on the device: a token whose `token_src` names a slot of the device
    token table (a loop-back row) reads it there, the others keep the packed id."""
    return torch.where(token_src >= 0, loop_tokens[token_src.clamp(min=0).long()].long(), ids.long())
