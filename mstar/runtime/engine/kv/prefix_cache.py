"""The prefix cache's bookkeeping: full KV pages keyed by their tokens and the prefix before them,
shared by reference count, kept in least-recently-used order while no sequence holds them.

In: `PagePool` calls it (it holds no tensors and picks no victim on its own). A page's key is
exact, not a hash: (the prefix id of the page before it, the KV sequence label, the page's token
ids), where a prefix id names one registered key (ids are never reused; `ROOT` before a
sequence's first page). So a key names a whole prefix, two pages share a key only when every
token before them and in them is the same on a sequence of the same label, and no two prefixes
can collide: the dict compares the tokens themselves. (A 128-bit blake2b chain before: 3.2 us a
key against 0.7 us for the tuple, a 1040-token prompt's 65 keys 208 against 43 us on a 2-core
CI-class machine.) A sequence that holds a private copy of a prefix whose cached page was evicted
keeps chaining from the evicted id: what it registers after that is found only through that id,
never by a new request (a lost hit, never a wrong one).

- `register(page, key)`: a sequence filled `page` with tokens whose key is `key`; the page becomes
  shared (one reference: its writer) unless another page already holds that key (then it stays
  private to its writer); returns the key's prefix id, which the sequence's next key chains from;
- `lookup(key)`: the cached page holding a key and its prefix id;
- `claim_chain(prefix, label, tokens, page_size, num_pages, max_from_free)`: a new sequence takes a
  reference to each cached page of the longest cached run of its full pages (out of the free order
  when it had none; at most `max_from_free` such), walking the keys from `prefix`; with
  `take=False` (`chain`) the same walk only looks, references and free order untouched;
- `release(page)`: a sequence lets go; at zero references the page joins the free order, still
  cached; `evict()` hands back the least recently used such page (and forgets its key) when the
  pool has no other free page;
- `num_hits` / `num_misses`: full prompt pages found / not found by `PagePool.claim_prefix`;
- `shareable_prefix(tokens, media_token)`: what of a prompt may be claimed at all.
A page with references is never handed out (`evict` only takes pages without any), and a shared
page is never written: sequences write only past their last full page (pages.py).
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Optional, Sequence

ROOT = 0  # the prefix id before a sequence's first page
PageKey = tuple[int, str, tuple[int, ...]]  # (prefix id before the page, sequence label, its tokens)


def shareable_prefix(tokens: list[int], media_token: Optional[int]) -> list[int]:
    """The part of a prompt whose KV its token ids alone decide: all of it, or the tokens before
    the first media placeholder (a node's `media_token`: the states that replace those positions
    differ per request while their ids do not, so no page from there on may be claimed)."""
    if media_token is None or media_token not in tokens:
        return tokens
    return tokens[:tokens.index(media_token)]


def page_key(previous: int, label: str, tokens: Sequence[int]) -> PageKey:
    """The key of a full page: the prefix id before it, the sequence label, the page's tokens."""
    return previous, label, tuple(tokens)


class PrefixCache:
    def __init__(self) -> None:
        self.page_of: dict[PageKey, tuple[int, int]] = {}  # key -> (page, prefix id)
        self.key_of: dict[int, PageKey] = {}
        self._next_id = ROOT + 1
        self.refs: dict[int, int] = {}  # cached page -> sequences holding it
        self.free_order: OrderedDict[int, None] = OrderedDict()  # cached pages nobody holds, oldest first
        self.num_hits = 0
        self.num_misses = 0

    def __contains__(self, page: int) -> bool:
        return page in self.key_of

    @property
    def num_evictable(self) -> int:
        return len(self.free_order)

    def register(self, page: int, key: PageKey) -> int:
        """`page` (held by its writer) now holds the full prefix `key`, unless another page already
        does (this one then stays private); returns the key's prefix id either way."""
        known = self.page_of.get(key)
        if known is not None:
            return known[1]
        prefix = self._next_id
        self._next_id += 1
        self.page_of[key] = (page, prefix)
        self.key_of[page] = key
        self.refs[page] = 1
        return prefix

    def lookup(self, key: PageKey) -> Optional[tuple[int, int]]:
        """(page, prefix id) of the cached page holding `key`, or None."""
        return self.page_of.get(key)

    def claim_chain(self, prefix: int, label: str, tokens: tuple[int, ...], page_size: int, num_pages: int,
                    max_from_free: int, take: bool = True) -> tuple[list[int], int]:
        """The cached pages of the longest cached run of `tokens`' first `num_pages` full pages,
        chained from prefix id `prefix` on sequence `label`, each now holding one more reference
        (at most `max_from_free` of them pages nobody held: those count as free), and the prefix
        id after the last; with `take` false (`chain`), the whole cached run with references and
        free order untouched. The keys are `page_key`'s tuples written out (the tokens' slices are
        tuples already) and the references counted in place: a cached request's 64 pages are host
        time before its first step (`mstar bench lone`'s admission 0.123-0.124 ms against
        0.133-0.135 with a `page_key` and an acquire call a page, alternated on one host). `chain`
        walks here too, behind a flag, since a walk shared as a helper cost the claim a list or a
        generator step a page (64 pages held: 21.0-22.7 us against 20.3-22.0, 2-core host)."""
        page_of, refs, free_order, pages = self.page_of, self.refs, self.free_order, []
        for start in range(0, num_pages * page_size, page_size):
            found = page_of.get((prefix, label, tokens[start:start + page_size]))
            if found is None:
                break
            page = found[0]
            if take:
                held = refs[page]
                if held == 0:
                    if max_from_free <= 0:
                        break
                    max_from_free -= 1
                    del free_order[page]
                refs[page] = held + 1
            pages.append(page)
            prefix = found[1]
        return pages, prefix

    def chain(self, prefix: int, label: str, tokens: tuple[int, ...], page_size: int, num_pages: int) -> list[int]:
        """The cached pages `claim_chain` would walk, references and free order untouched."""
        return self.claim_chain(prefix, label, tokens, page_size, num_pages, 0, take=False)[0]

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
