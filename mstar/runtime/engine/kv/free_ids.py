"""Free ids of a pool (host pages, recurrent-state slots): the ids given back, reused last given
first, then the never-used ids in increasing order, kept as a counter. A list of every free id
made a pool cost memory up front: a deployment's 2**31 host pages were a 17 GB list at start-up.
(`PagePool` keeps its device pages the same way, beside its prefix cache's evictable pages.)"""
from __future__ import annotations

from typing import Iterable, Optional


class FreeIds:
    """Ids `first..end-1`, all free at the start; the order a list `range(end - 1, first - 1, -1)`
    popped from its end and appended to gave."""

    def __init__(self, first: int, end: int):
        self._given_back: list[int] = []
        self._next_fresh = first
        self._end = end

    def __len__(self) -> int:
        return len(self._given_back) + self._end - self._next_fresh

    def take(self) -> Optional[int]:
        """A free id, or None when none is left."""
        if self._given_back:
            return self._given_back.pop()
        if self._next_fresh < self._end:
            self._next_fresh += 1
            return self._next_fresh - 1
        return None

    def give_back(self, ids: Iterable[int]) -> None:
        """Free `ids`; the last of them is taken first."""
        self._given_back.extend(ids)
