"""Recurrent-state slots for linear-attention layers: one slot per live request, slot 0 a sink.

Slot 0 is never handed out: padding rows of a captured step read and write it, so a real request's
state is never touched by padding. A slot is zeroed by its owner's tensors on allocation (servers do
not zero freed slots; a fresh request must not see a stale state).
"""
from __future__ import annotations

from typing import Mapping, Optional

from mstar.runtime.engine.kv.free_ids import FreeIds

SINK_SLOT = 0


class SlotPoolError(ValueError):
    """The plan gives too few slots to run anything (refused at start-up)."""


class SlotPool:
    """`num_slots` slots including the sink; `num_slots - 1` requests can hold state at once."""

    def __init__(self, node: str, num_slots: int, max_concurrent_requests: Optional[int] = None):
        if num_slots < 2:
            raise SlotPoolError(
                f"node {node}: {num_slots} recurrent state slot(s) leave none for requests "
                "(slot 0 is the padding sink); set recurrent_state_slots to at least 1 in the deployment (the "
                "compiler adds the sink)"
            )
        if max_concurrent_requests is not None and num_slots - 1 < max_concurrent_requests:
            raise SlotPoolError(
                f"node {node}: {num_slots} recurrent state slots (one is the padding sink) cannot hold "
                f"max_concurrent_requests={max_concurrent_requests} requests; set recurrent_state_slots "
                f"to at least {max_concurrent_requests} in the deployment (the compiler adds the sink)"
            )
        self.node = node
        self.num_slots = num_slots
        self._free = FreeIds(SINK_SLOT + 1, num_slots)
        self._owner: dict[str, int] = {}

    @property
    def num_free_slots(self) -> int:
        return len(self._free)

    @property
    def owners(self) -> Mapping[str, int]:
        """Request id -> its slot, for every request holding one (a live view: do not change it)."""
        return self._owner

    def slot_of(self, request_id: str) -> Optional[int]:
        """The request's slot, or None when it holds none yet."""
        return self._owner.get(request_id)

    def acquire(self, request_id: str) -> Optional[int]:
        """The request's slot, allocating one if needed; None when every slot is taken."""
        if request_id in self._owner:
            return self._owner[request_id]
        slot = self._free.take()
        if slot is not None:
            self._owner[request_id] = slot
        return slot

    def release(self, request_id: str) -> None:
        slot = self._owner.pop(request_id, None)
        if slot is not None:
            self._free.give_back([slot])


def node_slot_pool(node: str, plan_slots: Optional[int], max_concurrent_requests: Optional[int]) -> SlotPool:
    """A node's pool: the plan's `RecurrentState.num_slots` (`plan_slots`), else one slot a
    concurrent request plus the sink (65 without a limit)."""
    num_slots = plan_slots if plan_slots is not None else (max_concurrent_requests or 64) + 1
    return SlotPool(node, num_slots, max_concurrent_requests)
