"""The page pool's guards (kv/pages.py) against calls that would corrupt a sequence or the prefix
cache, each a case the engines are not meant to reach but whose result, if reached, would be
wrong KV rather than an error:

- tokens that do not match the positions a commit writes key no page (a page keyed by other
  tokens would be a wrong hit for a later prompt);
- a claim onto a sequence that already holds tokens, or a restore onto one, changes nothing;
- a sequence holding a page reserved ahead of its tokens (a decode row launched ahead) needs no
  new page, never a negative count (which the admission policy would grant as pages given back).
"""

from __future__ import annotations

from mstar.runtime.engine.kv.pages import PagePool

PAGE = 4
PROMPT = [11, 12, 13, 14, 15, 16, 17, 18]  # two full pages


def test_tokens_that_do_not_match_the_positions_written_key_no_page():
    pool = PagePool(8, PAGE, prefix_cache=True)
    key = ("a", "main")
    assert pool.reserve(key, 8)
    pool.commit(key, 8, PROMPT[1:])  # one token short: which position holds which id is unknown
    pool.free_request("a")
    for prompt in (PROMPT[1:] + [99], PROMPT + [99]):
        assert pool.claim_prefix(("b", "main"), prompt, max_from_free=8) == 0
        pool.free_request("b")


def test_a_claim_onto_a_sequence_with_tokens_claims_nothing():
    pool = PagePool(8, PAGE, prefix_cache=True)
    assert pool.reserve(("writer", "main"), 8)
    pool.commit(("writer", "main"), 8, PROMPT)
    pool.free_request("writer")
    key = ("b", "main")
    assert pool.reserve(key, 2)
    pool.commit(key, 2, [1, 2])
    before = (pool.extent(key), pool.page_table(key), pool.num_free_pages)
    assert pool.claim_prefix(key, PROMPT + [99], max_from_free=8) == 0
    assert (pool.extent(key), pool.page_table(key), pool.num_free_pages) == before


def test_a_restore_onto_a_sequence_with_tokens_changes_nothing():
    pool = PagePool(8, PAGE)
    key = ("a", "main")
    assert pool.reserve(key, 5)
    pool.commit(key, 5)
    before = (pool.extent(key), pool.page_table(key), pool.num_free_pages)
    assert not pool.restore(key, 3)
    assert (pool.extent(key), pool.page_table(key), pool.num_free_pages) == before


def test_a_page_reserved_ahead_leaves_no_negative_page_count():
    pool = PagePool(8, PAGE)
    key = ("a", "main")
    assert pool.reserve(key, 8)
    pool.commit(key, 8)
    assert pool.reserve(key, 1)  # the next token's page, reserved before the token is written
    assert len(pool.page_table(key)) == 3
    assert [pool.num_new_pages(key, n) for n in range(6)] == [0, 0, 0, 0, 0, 1]
