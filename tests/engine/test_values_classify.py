"""`values.classify` on lists: its fast path for a flat list of ints gives what the per-item rules
give (flatten, then tokens only when every item is an int and none a bool), for any nesting of
ints, bools and floats; and the prefix cache's page keys tell pages apart by every id."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings, strategies as st

from mstar.runtime.engine.kv.prefix_cache import ROOT, page_key
from mstar.runtime.engine.runners import values
from mstar.runtime.engine.runners.values import InputError, classify

ITEMS = st.one_of(st.integers(-2**40, 2**40), st.booleans(), st.floats(allow_nan=False, width=32))
VALUES = st.recursive(st.lists(ITEMS, max_size=6), lambda inner: st.lists(st.one_of(ITEMS, inner), max_size=4),
                      max_leaves=20)


def _by_rules(value):
    """The per-item rules alone (module docstring)."""
    items = values._flatten(value)
    if not items:
        return ("signal", None)
    if all(isinstance(i, int) and not isinstance(i, bool) for i in items):
        return ("tokens", items)
    return ("error", None)


@settings(max_examples=300, deadline=None)
@given(VALUES)
def test_fast_path_agrees_with_the_rules(value):
    expected_kind, expected_ids = _by_rules(value)
    if expected_kind == "error":
        with pytest.raises(InputError):
            classify("x", value)
        return
    got = classify("x", value)
    assert got.kind == expected_kind
    if expected_ids is not None:
        assert got.tensor is not None and got.tensor.dtype == torch.long
        assert got.tensor.tolist() == expected_ids


def test_flat_ids_take_the_fast_path_and_bools_do_not():
    assert values._flat_token_ids([3, 1, 2]).tolist() == [3, 1, 2]
    assert values._flat_token_ids([3, True]) is None  # bools are not token ids
    assert values._flat_token_ids([[3], 1]) is None  # nested: the general path flattens
    assert values._flat_token_ids([2**70]) is None  # past int64: the general path decides


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 2**31), min_size=16, max_size=16), st.integers(0, 15), st.integers(1, 2**20))
def test_page_keys_differ_when_one_id_differs(tokens, index, delta):
    changed = list(tokens)
    changed[index] += delta
    assert page_key(ROOT, "main", tokens) != page_key(ROOT, "main", changed)
    assert page_key(ROOT, "main", tokens) == page_key(ROOT, "main", list(tokens))
    assert page_key(ROOT, "main", tokens) != page_key(ROOT, "other", tokens)
    assert page_key(ROOT, "main", tokens) != page_key(ROOT + 1, "main", tokens)  # another prefix before it


def test_a_prefix_registered_again_after_eviction_gets_a_new_id_and_old_chains_stay_apart():
    """Prefix ids are never reused: a page registered under an evicted prefix's id is found only
    through that id, never through the same prefix registered again (a lost hit, never a wrong one)."""
    from mstar.runtime.engine.kv.prefix_cache import PrefixCache

    cache = PrefixCache()
    first = cache.register(1, page_key(ROOT, "main", [1, 2]))
    cache.release(1)
    assert cache.evict() == 1 and cache.lookup(page_key(ROOT, "main", [1, 2])) is None
    child = cache.register(2, page_key(first, "main", [3, 4]))  # a sequence still chaining from it
    again = cache.register(3, page_key(ROOT, "main", [1, 2]))
    assert again != first and cache.lookup(page_key(ROOT, "main", [1, 2])) == (3, again)
    assert cache.lookup(page_key(again, "main", [3, 4])) is None
    assert cache.lookup(page_key(first, "main", [3, 4])) == (2, child)
    assert cache.register(4, page_key(ROOT, "main", [1, 2])) == again  # a second writer: stays private
    assert 4 not in cache


@settings(max_examples=200, deadline=None)
@given(VALUES, st.integers(0, 8), st.integers(1, 8), st.booleans())
def test_a_token_list_s_chunk_is_what_classify_gives_for_it(value, start, num, is_partial):
    """`token_list_chunk` (the GPU runner's fast path) gives a cut row's chunk, or a whole row's
    list, as `classify` then `chunk_of` do, or None where `classify` must decide; a cut row leaves
    the list in the memo for a chunk launched ahead."""
    from mstar.runtime.step import StepRow

    row = StepRow("r", "prefill", num, start, {"x": value}, chunk_start=start, is_partial=is_partial)
    memo: dict = {}
    got = values.token_list_chunk(value, row, memo, "LLM", "x")
    part = value[start:start + num] if values.is_cut(row) else value
    if not part or any(type(item) is not int for item in part):
        assert got is None and not memo
        return
    assert got == classify("x", part).tensor.tolist()
    assert got is not value  # a copy: the request's prompt is not the row's to keep
    assert memo == ({("LLM", "x"): (value, None)} if values.is_cut(row) else {})


def test_the_memo_of_a_token_list_is_not_a_classification():
    """classify_for_row does not take a token list's memo entry for a classification."""
    from mstar.runtime.step import StepRow

    value = [5, 6, 7, 8]
    row = StepRow("r", "prefill", 2, 2, {"x": value}, chunk_start=2)
    memo: dict = {}
    assert values.token_list_chunk(value, row, memo, "LLM", "x") == [7, 8]
    classified = values.classify_for_row(row, memo, "LLM", "x", value)
    assert classified.kind == "tokens" and classified.tensor.tolist() == value


def test_a_chunk_launched_ahead_from_a_token_list_memo_is_checked_as_the_row_s_own():
    """Only the cut row's own chunk was checked when it left the list in the memo: the next chunk,
    launched ahead, is checked again (a bool, a string or a short tail waits for the real launch,
    which classifies the prompt and says why)."""
    prompt = [5, 6, 7, 8, True, "9", 10]
    assert values.held_token_chunk(prompt, 0, 4) == [5, 6, 7, 8]
    assert values.held_token_chunk(prompt, 2, 3) is None  # a bool
    assert values.held_token_chunk(prompt, 5, 1) is None  # a string
    assert values.held_token_chunk(prompt, 6, 2) is None  # one token left, two asked
    assert values.held_token_chunk(prompt, 6, 1) == [10]
