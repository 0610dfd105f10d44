"""Stream buffers and chunk policies between partitions (reference notes 2.8).

A producer partition pushes values on a stream edge; the consumer's buffer turns the items into
chunks by its policy:

- window(size, stride): chunk = items[pos:pos+size] once that many items exist; pos += stride.
- left_context(chunk, context): the first chunk is items[0:chunk] and advances chunk-context;
  every later chunk is items[pos:pos+chunk+context] (context old items + chunk new) and
  advances chunk.
- fixed(size, continue_after_done): chunk = items[pos:pos+size]; pos += size.

After the producer is done, items not yet covered by any chunk are flushed as one final partial
chunk (for window and left_context it starts at pos, so it keeps its overlap). When every item
was already covered, there is no final chunk: the buffer is simply finished (we never hand the
engine an empty chunk). With continue_after_done a fixed buffer is never finished: once drained
it answers every poll with an empty chunk, so a consumer that needs one input per step keeps
running (Qwen3-Omni's Talker after the Thinker ends).

Items: a pushed list is extended item by item; any other value is one item. A chunk is a list.
With a `keep` range (spec `keep LOW..HIGH`), an item outside it is dropped as it is pushed: it
takes no position in any chunk (Orpheus's text and control tokens never enter a SNAC window, as
its decoder skips them before it counts frame positions).
"""
from __future__ import annotations

from dataclasses import dataclass
import logging
from typing import Any, Optional

from mstar.plan.schema import ChunkPolicyPlan, Plan

log = logging.getLogger(__name__)


@dataclass
class Chunk:
    items: list[Any]
    is_final: bool


def stream_keeps(plan: Plan, vocab_sizes: dict[str, int]) -> dict[tuple[str, str], tuple[int, int]]:
    """(consumer partition, edge) -> the keep range its buffers apply. A range the producer's model
    cannot reach (a stand-in sampling from fewer ids than the plan's vocabulary: tiny dims, the
    simulator; `vocab_sizes` from EngineCaps) is not applied, so the stand-in's tokens still flow
    through the stream as they did before the range existed; noted in the log."""
    keeps = {}
    for part in plan.partitions:
        for stream in part.streams:
            if stream.keep is None:
                continue
            vocab = vocab_sizes.get(stream.producer_node)
            if vocab is not None and vocab <= stream.keep[0]:
                log.info("stream %s.%s: keep %d..%d not applied, %s samples from %d ids only (a stand-in model)",
                         part.name, stream.edge, *stream.keep, stream.producer_node, vocab)
                continue
            keeps[(part.name, stream.edge)] = stream.keep
    return keeps


class StreamBuffer:
    """Items of one stream edge for one request, cut into chunks by a policy."""

    def __init__(self, policy: ChunkPolicyPlan, keep: Optional[tuple[int, int]] = None):
        self._policy = policy
        self._keep = keep
        self._items: list[Any] = []
        self._pos = 0  # where the next chunk starts
        self._covered = 0  # items[0:covered] are in some chunk already
        self._num_chunks = 0
        self.is_producer_done = False
        self.is_finished = False  # the final chunk was taken (or there was nothing left)
        self._next_end = self._next_span()[1]  # a full chunk exists once this many items do

    def push(self, value: Any) -> None:
        values = value if isinstance(value, list) else [value]
        if self._keep is not None:
            low, high = self._keep
            values = [v for v in values if low <= v <= high]
        self._items.extend(values)

    def mark_producer_done(self) -> None:
        self.is_producer_done = True

    @property
    def num_items(self) -> int:
        return len(self._items)

    def _next_span(self) -> tuple[int, int, int]:
        """(start, end, next pos) of the next full chunk by the policy."""
        policy = self._policy
        if policy.kind == "window":
            stride = policy.stride or policy.size
            return self._pos, self._pos + policy.size, self._pos + stride
        if policy.kind == "left_context":
            context = policy.context or 0
            if self._num_chunks == 0:
                return 0, policy.size, policy.size - context
            return self._pos, self._pos + policy.size + context, self._pos + policy.size
        return self._pos, self._pos + policy.size, self._pos + policy.size

    def has_chunk(self) -> bool:
        """Whether poll() would give a chunk now (without taking it)."""
        if self._next_end <= len(self._items):
            return not self.is_finished
        if self.is_finished or not self.is_producer_done:
            return False
        # A keep-alive empty chunk, or a final partial chunk of uncovered items.
        return self._policy.is_continue_after_done or self._covered < len(self._items)

    @property
    def is_exhausted(self) -> bool:
        """No chunk will ever come again: finished, or producer done with every item covered."""
        if self.is_finished:
            return True
        return (
            self.is_producer_done
            and not self._policy.is_continue_after_done
            and self._covered >= len(self._items)
        )

    def poll(self) -> Optional[Chunk]:
        """Take the next chunk, or None when the policy is not satisfied yet.

        When the producer is done and every item was already covered, returns None and sets
        is_finished (no empty final chunk).
        """
        if self.is_finished:
            return None
        start, end, next_pos = self._next_span()
        if end <= len(self._items):
            # (the items are read before `_take`, which may drop the stream's start: a chunk taken
            # as the read position passed 4096 items came back empty)
            items = self._items[start:end]
            self._take(start, end, next_pos)
            return Chunk(items, is_final=False)
        if not self.is_producer_done:
            return None
        if self._policy.is_continue_after_done:
            if self._pos < len(self._items):
                items = self._items[self._pos:]
                self._take(self._pos, len(self._items), len(self._items))
                return Chunk(items, is_final=False)
            return Chunk([], is_final=False)
        self.is_finished = True
        if self._covered >= len(self._items):
            return None
        chunk = Chunk(self._items[start:], is_final=True)
        self._covered = len(self._items)
        return chunk

    def _take(self, start: int, end: int, next_pos: int) -> None:
        self._pos = next_pos
        self._covered = max(self._covered, end)
        self._num_chunks += 1
        # Drop items no later chunk can reach, so long streams stay small.
        if self._pos > 4096:
            drop = self._pos
            del self._items[:drop]
            self._pos -= drop
            self._covered = max(0, self._covered - drop)
        self._next_end = self._next_span()[1]
