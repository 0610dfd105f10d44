"""Paged KV bookkeeping: a free list of pages and a page table per (request, KV sequence).

Holds no tensors and no policy: callers ask `reserve(key, num_tokens)` to grow a sequence; it either
gets every page it needs or nothing (so a failed row leaves the pool untouched and can be retried).
A key is `(request_id, sequence_label)`: BAGEL-style requests own several sequences (main, cfg_text,
cfg_img), each with its own page table.
"""
from __future__ import annotations

from dataclasses import dataclass, field

SeqKey = tuple[str, str]


@dataclass
class _Sequence:
    pages: list[int] = field(default_factory=list)
    num_tokens: int = 0


class PagePool:
    """`num_pages` pages of `page_size` token positions each."""

    def __init__(self, num_pages: int, page_size: int):
        if num_pages <= 0 or page_size <= 0:
            raise ValueError(f"a KV pool needs positive num_pages and page_size, got {num_pages}, {page_size}")
        self.num_pages = num_pages
        self.page_size = page_size
        # Free pages are those returned (a stack: the last freed is reused first) plus the
        # never-used ids `_num_fresh..num_pages-1`, handed out in increasing order. Keeping the
        # untouched ids as a counter rather than a list makes a huge pool cost nothing up front.
        self._freed: list[int] = []
        self._num_fresh = 0
        self._seqs: dict[SeqKey, _Sequence] = {}

    @property
    def num_free_pages(self) -> int:
        return len(self._freed) + self.num_pages - self._num_fresh

    def pages_for(self, num_tokens: int) -> int:
        """Pages a sequence of `num_tokens` positions occupies."""
        return -(-num_tokens // self.page_size)

    def num_tokens(self, key: SeqKey) -> int:
        """Positions already written in the sequence (0 for an unknown key)."""
        seq = self._seqs.get(key)
        return seq.num_tokens if seq else 0

    def page_table(self, key: SeqKey) -> list[int]:
        seq = self._seqs.get(key)
        return list(seq.pages) if seq else []

    def labels_of(self, request_id: str) -> list[str]:
        """Labels of the request's sequences, in the order they were first reserved."""
        return [key[1] for key in self._seqs if key[0] == request_id]

    def num_pages_held(self, request_id: str) -> int:
        """Pages held by every sequence of the request."""
        return sum(len(seq.pages) for key, seq in self._seqs.items() if key[0] == request_id)

    def num_new_pages(self, key: SeqKey, num_new_tokens: int) -> int:
        """Pages the sequence must gain to hold `num_new_tokens` more positions."""
        seq = self._seqs.get(key, _Sequence())
        return max(0, self.pages_for(seq.num_tokens + num_new_tokens) - len(seq.pages))

    def reserve(self, key: SeqKey, num_new_tokens: int) -> bool:
        """Grow the sequence's page table to hold `num_new_tokens` more positions.

        All or nothing: False (and no change) when the free list is too short.
        """
        num_needed = self.num_new_pages(key, num_new_tokens)
        if num_needed > self.num_free_pages:
            return False
        seq = self._seqs.setdefault(key, _Sequence())
        for _ in range(num_needed):
            seq.pages.append(self._take_page())
        return True

    def _take_page(self) -> int:
        if self._freed:
            return self._freed.pop()
        self._num_fresh += 1
        return self._num_fresh - 1

    def commit(self, key: SeqKey, num_new_tokens: int) -> None:
        """Record that `num_new_tokens` positions were written (after `reserve`)."""
        seq = self._seqs[key]
        seq.num_tokens += num_new_tokens

    def free_request(self, request_id: str) -> None:
        """Return every page of every sequence of the request to the free list."""
        for key in [k for k in self._seqs if k[0] == request_id]:
            self._freed.extend(reversed(self._seqs.pop(key).pages))
