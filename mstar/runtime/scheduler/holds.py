"""Out-of-memory holds: rows kept out of the ready queues until a deadline (the backlog).

Held rows are not checked for readiness while they wait; when the clock passes their deadline
they go back to the end of their ready queue in the order they were held. Holds that expire at
the same time come back in the order they were made.
"""
from __future__ import annotations

import heapq
from dataclasses import dataclass, field


@dataclass(order=True)
class Hold:
    """Rows of one (key, walk) held until `deadline`; `order` breaks ties by creation order."""

    deadline: float
    order: int
    key: int = field(compare=False)
    walk: int = field(compare=False)
    request_ids: list[str] = field(compare=False)
    tokens: list[int] = field(compare=False)


class Holds:
    """A deadline-ordered heap of holds."""

    def __init__(self) -> None:
        self._heap: list[Hold] = []
        self._num_made = 0
        self.num_rows = 0

    def __bool__(self) -> bool:
        return bool(self._heap)

    def add(self, deadline: float, key: int, walk: int, request_ids: list[str], tokens: list[int]) -> None:
        heapq.heappush(self._heap, Hold(deadline, self._num_made, key, walk, request_ids, tokens))
        self._num_made += 1
        self.num_rows += len(request_ids)

    def next_deadline(self) -> float | None:
        """The earliest deadline, or None when nothing is held."""
        return self._heap[0].deadline if self._heap else None

    def pop_expired(self, now: float) -> list[Hold]:
        """Remove and return the holds whose deadline is at or before `now`, earliest first."""
        expired: list[Hold] = []
        heap = self._heap
        while heap and heap[0].deadline <= now:
            hold = heapq.heappop(heap)
            self.num_rows -= len(hold.request_ids)
            expired.append(hold)
        return expired

    def drop_request(self, request_id: str) -> list[int]:
        """Remove the request's held rows; return the keys they were held under."""
        keys: list[int] = []
        for hold in self._heap:
            if request_id in hold.request_ids:
                at = hold.request_ids.index(request_id)
                del hold.request_ids[at]
                del hold.tokens[at]
                self.num_rows -= 1
                keys.append(hold.key)
        if keys:
            # Emptied holds go, so deadlines and emptiness speak only of rows still held.
            self._heap = [hold for hold in self._heap if hold.request_ids]
            heapq.heapify(self._heap)
        return keys
