"""KV tensors of one kv node: per full-attention layer, K and V over every page's positions.

Layout: `k[layer]` is `[num_pages * page_size, num_kv_heads, head_dim]`, so position p of a sequence
with page table `pt` lives at flat index `pt[p // page_size] * page_size + p % page_size`. The
tensors are allocated with `torch.empty` (untouched memory costs nothing until written), and only
positions a sequence has written are ever read.
"""
from __future__ import annotations

import torch

from mstar.runtime.kv.pages import PagePool


class KvCache:
    def __init__(self, pool: PagePool, num_layers: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype = torch.float32):
        size = pool.num_pages * pool.page_size
        self.pool = pool
        self.k = [torch.empty(size, num_kv_heads, head_dim, dtype=dtype) for _ in range(num_layers)]
        self.v = [torch.empty(size, num_kv_heads, head_dim, dtype=dtype) for _ in range(num_layers)]

    def flat_positions(self, page_table: list[int], num_tokens: int) -> torch.Tensor:
        """Flat cache indices of positions 0..num_tokens-1 of a sequence with this page table."""
        page_size = self.pool.page_size
        positions = torch.arange(num_tokens)
        pages = torch.tensor(page_table, dtype=torch.long)
        return pages[positions // page_size] * page_size + positions % page_size
