"""Paged KV bookkeeping: a free list of pages and a page table per (request, KV sequence).

Holds no tensors and no policy: callers ask `reserve(key, num_tokens)` to grow a sequence; it either
gets every page it needs or nothing (so a failed row leaves the pool untouched and can be retried).
A key is `(request_id, sequence_label)`: BAGEL-style requests own several sequences (main, cfg_text,
cfg_img), each with its own page table.

With a prefix cache (`prefix_cache=True`, kv/prefix_cache.py): `commit(key, n, tokens)` keys each
page a sequence fills with known token ids; `claim_prefix(key, tokens)` starts a new sequence on
the cached pages of its longest cached prefix (whole pages, at least one token left to feed);
`free_request` lets go of shared pages (they stay cached, least recently used first out) and frees
the private ones. Free pages count the cached pages nobody holds: one is evicted when a sequence
needs a page and no other is free. A sequence only ever writes past its last full page, so a
shared (full, cached) page is never written.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from itertools import compress, repeat
from operator import attrgetter, is_not
from typing import Any, Callable, Iterable, Optional

import numpy as np

from mstar.runtime.engine.kv.prefix_cache import ROOT, PrefixCache, page_key

SeqKey = tuple[str, str]
_num_tokens_of, _pages_of, _is_keyed_of = attrgetter("num_tokens"), attrgetter("pages"), attrgetter("is_keyed")
_consume: Callable[[Iterable[Any]], None] = deque(maxlen=0).extend  # runs an iterator of calls in C (the columns)


@dataclass
class _Sequence:
    pages: list[int] = field(default_factory=list)
    num_tokens: int = 0
    # prefix cache: tokens of the page being filled, full pages keyed so far, the last one's prefix
    # id; is_keyed False once a position was written from something other than token ids
    pending: list[int] = field(default_factory=list)
    num_keyed: int = 0
    key: int = ROOT
    is_keyed: bool = True


class PagePool:
    """`num_pages` pages of `page_size` token positions each."""

    def __init__(self, num_pages: int, page_size: int, prefix_cache: bool = False):
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
        self.cache: Optional[PrefixCache] = PrefixCache() if prefix_cache else None

    @property
    def num_free_pages(self) -> int:
        """Pages a sequence can get now: free ones and cached pages nobody holds (evicted on demand)."""
        evictable = self.cache.num_evictable if self.cache is not None else 0
        return len(self._freed) + self.num_pages - self._num_fresh + evictable

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

    def num_pages_freed_by(self, request_id: str) -> int:
        """Pages that freeing the request would make available: its private pages and its cached
        ones no other sequence holds (a shared prefix page stays held by the others)."""
        cache = self.cache
        return sum(1 for key, seq in self._seqs.items() if key[0] == request_id for page in seq.pages
                   if cache is None or page not in cache or cache.refs[page] == 1)

    def num_new_pages(self, key: SeqKey, num_new_tokens: int) -> int:
        """Pages the sequence must gain to hold `num_new_tokens` more positions."""
        seq = self._seqs.get(key, _Sequence())
        return max(0, self.pages_for(seq.num_tokens + num_new_tokens) - len(seq.pages))

    def has_room(self, key: SeqKey, num_new_tokens: int) -> bool:
        """Whether the sequence exists and its pages hold `num_new_tokens` more positions
        (`num_new_pages` is 0 and `reserve` would change nothing): a decode row's common case,
        asked without building a `_Sequence` for an unknown key."""
        seq = self._seqs.get(key)
        return seq is not None and seq.num_tokens + num_new_tokens <= len(seq.pages) * self.page_size

    def extent(self, key: SeqKey) -> tuple[int, int]:
        """(positions written, positions its pages hold) of the sequence; (0, 0) for an unknown key."""
        seq = self._seqs.get(key)
        return (seq.num_tokens, len(seq.pages) * self.page_size) if seq else (0, 0)

    def column(self, keys: list[SeqKey]) -> Optional["SequenceColumn"]:
        """The sequences of `keys` (distinct) looked up once, for a decode step's columns; None when
        some key has no sequence."""
        found: list[Any] = list(map(self._seqs.get, keys))
        if not all(map(is_not, found, repeat(None))):  # (`None in found` would run _Sequence.__eq__ per key)
            return None
        return SequenceColumn(found, self.page_size, self.cache is not None)

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
        if self._num_fresh < self.num_pages:
            self._num_fresh += 1
            return self._num_fresh - 1
        assert self.cache is not None and self.cache.num_evictable, "reserve checked num_free_pages"
        return self.cache.evict()

    def commit(self, key: SeqKey, num_new_tokens: int, tokens: Optional[list[int]] = None) -> None:
        """Record that `num_new_tokens` positions were written (after `reserve`); `tokens`: their
        token ids, which key the pages they fill (None: not token ids, no later page is keyed)."""
        seq = self._seqs[key]
        seq.num_tokens += num_new_tokens
        if self.cache is not None and seq.is_keyed:
            self._key_full_pages(key[1], seq, tokens, num_new_tokens)

    def _key_full_pages(self, label: str, seq: _Sequence, tokens: Optional[list[int]], num_new: int) -> None:
        if tokens is None or len(tokens) != num_new:
            seq.is_keyed, seq.pending = False, []
            return
        assert self.cache is not None
        seq.pending.extend(tokens)
        size = self.page_size
        while len(seq.pending) >= size:
            seq.key = self.cache.register(seq.pages[seq.num_keyed], page_key(seq.key, label, seq.pending[:size]))
            seq.num_keyed += 1
            del seq.pending[:size]

    def claim_prefix(self, key: SeqKey, tokens: list[int], max_from_free: int, max_pages: Optional[int] = None) -> int:
        """Start the empty sequence `key` on the cached pages of the longest cached prefix of
        `tokens` (whole pages, leaving at least one token to feed; at most `max_from_free` of them
        pages nobody held, since those count as free, and at most `max_pages` in all when given).
        Returns the tokens it now holds."""
        if self.cache is None or self.num_tokens(key):
            return 0
        seq = self._seqs.setdefault(key, _Sequence())
        size, cache = self.page_size, self.cache
        num_full = (len(tokens) - 1) // size
        num_claimed = num_full if max_pages is None else max(0, min(num_full, max_pages))
        pages, seq.key = cache.claim_chain(seq.key, key[1], tuple(tokens), size, num_claimed, max_from_free)
        if pages:
            seq.pages.extend(pages)
            seq.num_keyed = len(pages)
        seq.num_tokens = seq.num_keyed * size
        cache.num_hits += seq.num_keyed
        cache.num_misses += num_full - seq.num_keyed
        return seq.num_tokens

    def cached_chain(self, label: str, tokens: list[int]) -> list[int]:
        """The cached pages `claim_prefix` would find for a new sequence of `label` on `tokens`,
        claiming nothing (what a claim would hold, for the admission's `claim_cap`)."""
        if self.cache is None:
            return []
        return self.cache.chain(ROOT, label, tuple(tokens), self.page_size, (len(tokens) - 1) // self.page_size)

    def sequences_of(self, request_id: str) -> list[tuple[str, int, list[int]]]:
        """(label, tokens, the pages holding them) of each sequence of the request (what offload
        moves). Pages reserved past the tokens written (a step that reserved them and then failed
        before writing) are left out: their contents mean nothing, and `restore` gives the
        sequence back the pages of its tokens only, so a copy back of every reserved page paired
        lists of two lengths."""
        return [(key[1], seq.num_tokens, seq.pages[:self.pages_for(seq.num_tokens)])
                for key, seq in self._seqs.items() if key[0] == request_id]

    def restore(self, key: SeqKey, num_tokens: int) -> bool:
        """A sequence moved back from the host: `num_tokens` positions on fresh private pages
        (never keyed for the prefix cache). False (no change) when the pool is short."""
        if self.num_tokens(key) or not self.reserve(key, num_tokens):
            return False
        seq = self._seqs[key]
        seq.num_tokens, seq.is_keyed = num_tokens, False
        return True

    def free_request(self, request_id: str) -> None:
        """Return every page of every sequence of the request: private pages to the free list,
        shared ones to the cache (last page first, so a prefix's later pages are evicted first)."""
        for key in [k for k in self._seqs if k[0] == request_id]:
            for page in reversed(self._seqs.pop(key).pages):
                if self.cache is not None and page in self.cache:
                    self.cache.release(page)
                else:
                    self._freed.append(page)


class SequenceColumn:
    """Sequences of one pool read and written together (a decode step's rows, `PagePool.column`),
    so a step looks each key up once. Valid while none of them is freed (within a step).
    `num_tokens`: positions written, `num_held`: positions the pages hold (int64 arrays, read when
    the column was taken; `reserve` on the pool grows the same sequences' page tables in place)."""

    def __init__(self, seqs: list[_Sequence], page_size: int, is_cached: bool):
        self._seqs, self._is_cached = seqs, is_cached
        num = len(seqs)
        self.num_tokens = np.fromiter(map(_num_tokens_of, seqs), dtype=np.int64, count=num)
        self.num_held = np.fromiter(map(len, map(_pages_of, seqs)), dtype=np.int64, count=num) * page_size

    def take(self, rows: list[bool]) -> "SequenceColumn":
        """The column of the rows marked True, in order (lengths as read when this one was taken)."""
        column = SequenceColumn.__new__(SequenceColumn)
        column._seqs, column._is_cached = list(compress(self._seqs, rows)), self._is_cached
        column.num_tokens, column.num_held = self.num_tokens[rows], self.num_held[rows]
        return column

    def page_tables(self, rows: Optional[list[int]] = None) -> list[list[int]]:
        """`PagePool.page_table` of each sequence, or of the `rows` given (copies, as now)."""
        seqs = self._seqs if rows is None else [self._seqs[row] for row in rows]
        return list(map(list, map(_pages_of, seqs)))

    def commit_one_each(self) -> None:
        """`PagePool.commit(key, 1)` for each sequence: one position written from something other
        than a token id (a token the device looped back), so no later page of these sequences is
        keyed for the prefix cache."""
        seqs = self._seqs
        _consume(map(setattr, seqs, repeat("num_tokens"), map(int.__add__, map(_num_tokens_of, seqs), repeat(1))))
        if self._is_cached:
            keyed = list(compress(seqs, map(_is_keyed_of, seqs)))
            _consume(map(setattr, keyed, repeat("is_keyed"), repeat(False)))
            _consume(map(setattr, keyed, repeat("pending"), map(list, repeat((), len(keyed)))))
