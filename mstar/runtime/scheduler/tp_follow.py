"""TP follower queue: a leader's batches, run here in order, each with all its rows or none.

A follower never composes steps for a TP node it does not lead; the leader's batches arrive
through `push` and only the head is considered. The head runs when every row it names is ready
on this worker; otherwise the follower waits (nothing is taken from it). After
`max_consecutive` follower batches in a row, the next one is deferred while other local work is
ready; the scheduler resets the run count whenever it returns anything else.
"""
from __future__ import annotations

from collections import Counter, deque

from mstar.runtime.scheduler.batch import Batch


class FollowQueue:
    def __init__(self, max_consecutive: int) -> None:
        self.max_consecutive = max(1, max_consecutive)
        self.num_consecutive = 0
        self._batches: deque[Batch] = deque()
        self._named: Counter[str] = Counter()  # request id -> queued batches naming it

    def __bool__(self) -> bool:
        return bool(self._batches)

    def __len__(self) -> int:
        return len(self._batches)

    def push(self, batch: Batch) -> None:
        self._batches.append(batch)
        self._named.update(batch.request_ids)

    def head(self) -> Batch | None:
        """The leader batch to run next, or None when none is queued."""
        return self._batches[0] if self._batches else None

    def pop(self) -> Batch:
        batch = self._batches.popleft()
        self._named.subtract(batch.request_ids)
        for rid in batch.request_ids:
            if self._named[rid] <= 0:
                del self._named[rid]
        return batch

    def num_named(self) -> int:
        """Requests named by queued leader batches."""
        return len(self._named)

    def names(self, request_id: str) -> bool:
        """Whether a queued leader batch still needs this request's row."""
        return request_id in self._named

    def is_deferred(self, has_local_work: bool) -> bool:
        """Whether the head must wait because followers ran max_consecutive times in a row."""
        return has_local_work and self.num_consecutive >= self.max_consecutive


def rows_by_walk(batch: Batch) -> dict[str, list[str]]:
    """The batch's request ids grouped by walk, each group in batch order."""
    groups: dict[str, list[str]] = {}
    for rid, walk in zip(batch.request_ids, batch.walks):
        groups.setdefault(walk, []).append(rid)
    return groups
