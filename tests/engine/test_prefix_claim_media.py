"""A prefix claim stops at a prompt's first media placeholder (kv/prefix_cache.py
`shareable_prefix`, through kv/claims.py, the claim both engines make): the states that replace the
placeholders differ per request (another image, another clip) while their token ids do not, so two
prompts with the same ids may share only the pages before the first placeholder. A prompt without a
placeholder on a node that has one claims its whole cached prefix."""

from __future__ import annotations

from mstar.runtime.engine.kv.admission import Admission
from mstar.runtime.engine.kv.claims import claim_cached_prefix
from mstar.runtime.engine.kv.pages import PagePool

MEDIA = 900  # the node's media_token
PAGE = 4


def cached_pool(prompt: list[int]) -> PagePool:
    """Pages of 4 with a prefix cache; the prompt's full pages written, keyed by their ids, and let go."""
    pool = PagePool(16, PAGE, prefix_cache=True)
    assert pool.reserve(("writer", "main"), len(prompt))
    pool.commit(("writer", "main"), len(prompt), prompt)
    pool.free_request("writer")
    return pool


def test_a_prompt_with_media_shares_only_the_pages_before_its_first_placeholder():
    prompt = [1, 2, 3, 4, 5, 6, MEDIA, MEDIA, MEDIA, MEDIA, 7, 8, 9, 10]  # every id cached, 3 full pages
    pool = cached_pool(prompt)
    # the same ids, another image: only the first page (before position 6's placeholder) is its own KV
    claimed = claim_cached_prefix(Admission(num_pages=16), pool, ("b", "main"), prompt, MEDIA)
    assert claimed == PAGE
    assert pool.num_tokens(("b", "main")) == PAGE and len(pool.page_table(("b", "main"))) == 1


def test_a_prompt_without_a_placeholder_claims_its_whole_cached_prefix():
    prompt = list(range(1, 14))  # 3 full pages cached, one token left to feed
    pool = cached_pool(prompt)
    assert claim_cached_prefix(Admission(num_pages=16), pool, ("b", "main"), prompt, MEDIA) == 3 * PAGE
