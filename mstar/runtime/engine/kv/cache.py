"""KV tensors of one kv node: per full-attention layer, K and V over every page's positions.

Layout: `k[layer]` is `[num_pages * page_size, num_kv_heads, head_dim]`, so position p of a sequence
with page table `pt` lives at flat index `pt[p // page_size] * page_size + p % page_size`. The
tensors are allocated with `torch.empty` (untouched memory costs nothing until written), and only
positions a sequence has written are ever read.
"""
from __future__ import annotations

import torch

from mstar.arg_types import shown
from mstar.runtime.engine.kv.pages import PagePool


# torch sizes are signed 64-bit: a larger tensor cannot even be asked for (an overflow, not a
# clean out-of-memory error)
MAX_TENSOR_BYTES = 2**63 - 1


def gib(num_bytes: int) -> str:
    """GiB, written without float overflow for any page count."""
    return f"{num_bytes / 2**30:.1f} GiB" if num_bytes < 2**100 else f"about 2^{num_bytes.bit_length() - 30} GiB"


_CPU = torch.device("cpu")  # the default device (a module constant, not a call per signature)


class KvCacheError(ValueError):
    """The KV tensors of a pool cannot be allocated: the message names the pool (its page count
    clipped by `shown`: `--kv-pages` of 4000 digits was echoed whole), then a way out. `problem` is
    the message without the way out, for a command that sizes the pool from options of its own
    (`mstar bench runner` has no deployment or --kv-pages to lower)."""

    def __init__(self, problem: str, way_out: str = ""):
        super().__init__(f"{problem}; {way_out}" if way_out else problem)
        self.problem = problem


class KvCache:
    def __init__(self, pool: PagePool, num_layers: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype = torch.float32, device: torch.device = _CPU):
        size = pool.num_pages * pool.page_size
        self.pool = pool
        num_bytes = 2 * num_layers * size * num_kv_heads * head_dim * dtype.itemsize
        try:
            if size * num_kv_heads * head_dim * dtype.itemsize > MAX_TENSOR_BYTES:
                raise MemoryError("more bytes than one tensor can address")
            self.k = [torch.empty(size, num_kv_heads, head_dim, dtype=dtype, device=device) for _ in range(num_layers)]
            self.v = [torch.empty(size, num_kv_heads, head_dim, dtype=dtype, device=device) for _ in range(num_layers)]
        # torch reports an impossible allocation (CPU or GPU) as RuntimeError
        except (RuntimeError, MemoryError) as error:
            raise KvCacheError(
                f"cannot allocate a KV cache of {shown(pool.num_pages)} pages x {pool.page_size} positions "
                f"({gib(num_bytes)} for {num_layers} layers): {str(error).splitlines()[0]}",
                "lower kv_pool.num_pages in the deployment or pass --kv-pages N") from None

    def flat_positions(self, page_table: list[int], num_tokens: int) -> torch.Tensor:
        """Flat cache indices of positions 0..num_tokens-1 of a sequence with this page table."""
        page_size = self.pool.page_size
        positions = torch.arange(num_tokens)
        pages = torch.tensor(page_table, dtype=torch.long)
        return pages[positions // page_size] * page_size + positions % page_size
