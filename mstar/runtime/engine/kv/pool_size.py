"""A kv node's pool as the plan sizes it: its plan entry, pages (`--kv-pages` overrides the count),
page size and max_seq_len. A compiled plan has an entry for every kv node; the defaults serve
hand-built plans. One reading for the torch engine's decoders, the GPU fast path's and Whisper's
reserved pages, which each spelled it out.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from mstar.plan.schema import KvPoolPlan, Plan

DEFAULT_PAGE_SIZE = 16
DEFAULT_NUM_PAGES = 1024


@dataclass(frozen=True)
class PoolSize:
    entry: Optional[KvPoolPlan]  # the plan's entry for the node; None in a hand-built plan without one
    num_pages: int
    page_size: int
    max_seq_len: int


def pool_size(plan: Plan, node: str, num_pages: Optional[int] = None) -> PoolSize:
    entry = next((p for p in plan.deployment.kv_pools if p.node == node), None)
    if entry is None:
        return PoolSize(None, num_pages or DEFAULT_NUM_PAGES, DEFAULT_PAGE_SIZE, plan.deployment.max_seq_len)
    return PoolSize(entry, num_pages or entry.num_pages, entry.page_size, entry.max_seq_len)
