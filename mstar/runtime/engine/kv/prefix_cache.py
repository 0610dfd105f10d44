"""The prefix cache's bookkeeping: full KV pages keyed by a hash of their tokens, shared by
reference count, kept in least-recently-used order while no sequence holds them.

In: `PagePool` calls it (it holds no tensors and picks no victim on its own). A page's key is a
128-bit blake2b digest of the previous page's key, the KV sequence label and the page's token ids,
so a key names a whole prefix: two pages share a key only when every token before them and in
them is the same, on a sequence of the same label.

- `register(page, key)`: a sequence filled `page` with tokens whose chain key is `key`; the page
  becomes shared (one reference: its writer) unless another page already holds that key (then it
  stays private to its writer);
- `lookup(key)` / `acquire(page)`: a new sequence takes a reference to a cached page (out of the
  free order when it had none);
- `release(page)`: a sequence lets go; at zero references the page joins the free order, still
  cached; `evict()` hands back the least recently used such page (and forgets its key) when the
  pool has no other free page;
- `num_hits` / `num_misses`: full prompt pages found / not found by `PagePool.claim_prefix`;
- `shareable_prefix(tokens, media_token)`: what of a prompt may be claimed at all.
A page with references is never handed out (`evict` only takes pages without any), and a shared
page is never written: sequences write only past their last full page (pages.py).
"""
from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from typing import Optional

ROOT_KEY = b""


def shareable_prefix(tokens: list[int], media_token: Optional[int]) -> list[int]:
    """The part of a prompt whose KV its token ids alone decide: all of it, or the tokens before
    the first media placeholder (a node's `media_token`: the states that replace those positions
    differ per request while their ids do not, so no page from there on may be claimed)."""
    if media_token is None or media_token not in tokens:
        return tokens
    return tokens[:tokens.index(media_token)]


def page_key(previous: bytes, label: str, tokens: list[int]) -> bytes:
    """The chain key of a full page: previous page's key, the sequence label, the page's tokens."""
    digest = hashlib.blake2b(previous, digest_size=16)
    digest.update(label.encode())
    digest.update(b"\0")
    try:  # fixed-width ids: one C call a page (the decimal text of each id cost 3x more)
        digest.update(array("q", tokens).tobytes())
    except OverflowError:  # an id past int64 (refused elsewhere): its decimal text, told apart by the marker
        digest.update(b"\1" + b",".join(str(t).encode() for t in tokens))
    return digest.digest()


class PrefixCache:
    def __init__(self) -> None:
        self.page_of: dict[bytes, int] = {}
        self.key_of: dict[int, bytes] = {}
        self.refs: dict[int, int] = {}  # cached page -> sequences holding it
        self.free_order: OrderedDict[int, None] = OrderedDict()  # cached pages nobody holds, oldest first
        self.num_hits = 0
        self.num_misses = 0

    def __contains__(self, page: int) -> bool:
        return page in self.key_of

    @property
    def num_evictable(self) -> int:
        return len(self.free_order)

    def register(self, page: int, key: bytes) -> bool:
        """`page` (held by its writer) now holds the full prefix `key`; False when another page
        already does (this one stays private)."""
        if key in self.page_of:
            return False
        self.page_of[key] = page
        self.key_of[page] = key
        self.refs[page] = 1
        return True

    def lookup(self, key: bytes) -> Optional[int]:
        return self.page_of.get(key)

    def acquire(self, page: int) -> None:
        if self.refs[page] == 0:
            del self.free_order[page]
        self.refs[page] += 1

    def release(self, page: int) -> None:
        self.refs[page] -= 1
        if self.refs[page] == 0:
            self.free_order[page] = None

    def evict(self) -> int:
        """The least recently freed cached page, forgotten (its key no longer hits)."""
        page, _ = self.free_order.popitem(last=False)
        del self.page_of[self.key_of.pop(page)]
        del self.refs[page]
        return page
