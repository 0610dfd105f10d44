"""Capture bucket lookups, shared by the compiler (which writes them) and load_plan (which rebuilds
and compares them).

    batch_pad_table(batch_sizes, max_rows) -> table   table[b] = smallest captured batch size >= b,
                                                      0 above every size (eager); table[0] = 0;
                                                      one entry per b up to max(max_rows, largest size)
    family_max_rows(key, family_name) -> int          the largest cap of a mixture replaying it
"""
from __future__ import annotations

from bisect import bisect_left

from mstar.plan.schema import KeyPlan


def batch_pad_table(batch_sizes: list[int], max_rows: int) -> list[int]:
    sizes = sorted(batch_sizes)
    table = [0]
    for b in range(1, max(max_rows, sizes[-1] if sizes else 0) + 1):
        i = bisect_left(sizes, b)
        table.append(sizes[i] if i < len(sizes) else 0)
    return table


def family_max_rows(key: KeyPlan, family_name: str) -> int:
    return max((entry.cap for entry in key.mixtures
                if entry.capture == family_name or family_name in entry.also_captures), default=0)
