"""The host side of KV offload: K/V tensors of `num_pages` host pages, and copies of whole pages
between them and a node's `KvCache` (kv/cache.py layout: position p of page t at flat index
t * page_size + p). The pages to copy come from kv/offload.py's bookkeeping.

In: the device cache, device page ids and host page ids (same length, in sequence order). Out:
the pages' contents copied, bit for bit, every full-attention layer, keys and values.
"""
from __future__ import annotations

import torch

from mstar.runtime.engine.kv.cache import KvCache


class HostKv:
    def __init__(self, num_pages: int, cache: KvCache):
        page_size = cache.pool.page_size
        self.page_size = page_size
        shape = (num_pages, page_size) + tuple(cache.k[0].shape[1:]) if cache.k else (num_pages, page_size)
        is_pinned = bool(cache.k) and cache.k[0].device.type == "cuda"
        dtype = cache.k[0].dtype if cache.k else torch.float32
        self.k = [torch.empty(shape, dtype=dtype, pin_memory=is_pinned) for _ in cache.k]
        self.v = [torch.empty(shape, dtype=dtype, pin_memory=is_pinned) for _ in cache.v]

    def _pages(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor.view(-1, self.page_size, *tensor.shape[1:])

    def copy_out(self, cache: KvCache, device_pages: list[int], host_pages: list[int]) -> None:
        """Device pages -> host pages."""
        if not device_pages:
            return
        src, dst = torch.tensor(device_pages, device=cache.k[0].device if cache.k else "cpu"), torch.tensor(host_pages)
        for layer in range(len(cache.k)):
            self.k[layer][dst] = self._pages(cache.k[layer])[src].to("cpu")
            self.v[layer][dst] = self._pages(cache.v[layer])[src].to("cpu")

    def copy_in(self, cache: KvCache, host_pages: list[int], device_pages: list[int]) -> None:
        """Host pages -> device pages."""
        if not device_pages:
            return
        device = cache.k[0].device if cache.k else torch.device("cpu")
        src, dst = torch.tensor(host_pages), torch.tensor(device_pages, device=device)
        for layer in range(len(cache.k)):
            self._pages(cache.k[layer])[dst] = self.k[layer][src].to(device)
            self._pages(cache.v[layer])[dst] = self.v[layer][src].to(device)
