"""The host side of KV offload: K/V tensors of `num_pages` host pages, and copies of whole pages
between them and a node's device pages. The pages to copy come from kv/offload.py's bookkeeping.

In: the node's page tensors, each page-major (`[pages, page_size, ...]`: one a layer for keys and
one for values; the torch reference's `KvCache` and the fast path's `PagedKv` both give them as
views, `page_tensors`), device page ids and host page ids (same length, in sequence order). Out:
the pages' contents copied, bit for bit, every full-attention layer, keys and values.
"""
from __future__ import annotations

import torch

from mstar.runtime.engine.kv.cache import KvCache, KvCacheError, gib


def page_tensors(cache: KvCache) -> list[torch.Tensor]:
    """The torch reference cache's keys then values, layer by layer, as `[pages, page_size, ...]`
    views (kv/cache.py layout: position p of page t at flat index t * page_size + p)."""
    size = cache.pool.page_size
    return [t.view(-1, size, *t.shape[1:]) for t in [*cache.k, *cache.v]]


class HostKv:
    def __init__(self, num_pages: int, pages: list[torch.Tensor]):
        """pages: the device page tensors the host pages mirror (module docstring); host memory is
        pinned when they are on a GPU."""
        self.pages = pages
        is_pinned = bool(pages) and pages[0].device.type == "cuda"
        num_bytes = sum(num_pages * t[0].numel() * t.element_size() for t in pages)
        try:
            self.host = [torch.empty((num_pages,) + tuple(t.shape[1:]), dtype=t.dtype, pin_memory=is_pinned)
                         for t in pages]
        except (RuntimeError, MemoryError) as error:  # torch's word for an allocation it cannot make
            raise KvCacheError(
                f"cannot allocate a KV offload host pool of {num_pages} pages ({gib(num_bytes)}"
                f"{' pinned' if is_pinned else ''}): {str(error).splitlines()[0]}; lower "
                "kv_cache.cpu_offload_pages (or kv_pool.nodes.NODE.cpu_offload_pages) in the deployment") from None

    def copy_out(self, device_pages: list[int], host_pages: list[int]) -> None:
        """Device pages -> host pages."""
        if not device_pages or not self.pages:
            return
        src, dst = torch.tensor(device_pages, device=self.pages[0].device), torch.tensor(host_pages)
        for device, host in zip(self.pages, self.host):
            host[dst] = device[src].to("cpu")

    def copy_in(self, host_pages: list[int], device_pages: list[int]) -> None:
        """Host pages -> device pages."""
        if not device_pages or not self.pages:
            return
        target = self.pages[0].device
        src, dst = torch.tensor(host_pages), torch.tensor(device_pages, device=target)
        for device, host in zip(self.pages, self.host):
            device[dst] = host[src].to(target)
