"""Paged attention over a packed mixed step equals dense attention per request, whatever the page
tables; the page pool never hands a page to two sequences and loses none (property tests)."""
import random

import torch
import torch.nn.functional as F
from hypothesis import given, strategies as st

from mstar.runtime.engine.attention.torch_paged import Segment, paged_attention
from mstar.runtime.engine.kv.pages import PagePool

HEADS_Q, HEADS_KV, DIM, PAGE = 4, 2, 8, 4


def dense(q, k, v, is_causal, num_cached):
    """Reference: SDPA over the request's whole key sequence (GQA by repeating kv heads)."""
    k = k.repeat_interleave(HEADS_Q // HEADS_KV, 1).transpose(0, 1)
    v = v.repeat_interleave(HEADS_Q // HEADS_KV, 1).transpose(0, 1)
    mask = None
    if is_causal:
        mask = torch.arange(k.shape[1])[None, :] <= (torch.arange(q.shape[0])[:, None] + num_cached)
    return F.scaled_dot_product_attention(q.transpose(0, 1), k, v, attn_mask=mask).transpose(0, 1)


@given(st.lists(st.tuples(st.integers(0, 9), st.integers(1, 7), st.booleans()), min_size=1, max_size=5),
       st.integers(0, 2**16))
def test_mixed_step_equals_dense_attention(rows, seed):
    torch.manual_seed(seed)
    rng = random.Random(seed)
    num_pages = 64
    cache_k, cache_v = torch.zeros(num_pages * PAGE, HEADS_KV, DIM), torch.zeros(num_pages * PAGE, HEADS_KV, DIM)
    free = list(range(num_pages))
    rng.shuffle(free)  # scattered page tables
    segments, qs, ks, vs, history, start = [], [], [], [], [], 0
    for num_cached, num_new, is_write in rows:
        total = num_cached + num_new
        pages = [free.pop() for _ in range(-(-total // PAGE))]
        flat = torch.tensor([pages[p // PAGE] * PAGE + p % PAGE for p in range(total if is_write else num_cached)],
                            dtype=torch.long)
        old_k, old_v = torch.randn(num_cached, HEADS_KV, DIM), torch.randn(num_cached, HEADS_KV, DIM)
        cache_k[flat[:num_cached]], cache_v[flat[:num_cached]] = old_k, old_v
        q = torch.randn(num_new, HEADS_Q, DIM)
        k, v = torch.randn(num_new, HEADS_KV, DIM), torch.randn(num_new, HEADS_KV, DIM)
        segments.append(Segment(start, num_new, num_cached, flat, is_causal=is_write, is_write=is_write))
        qs.append(q), ks.append(k), vs.append(v)
        history.append((torch.cat([old_k, k]), torch.cat([old_v, v])))
        start += num_new
    out = paged_attention(torch.cat(qs), torch.cat(ks), torch.cat(vs), cache_k, cache_v, segments, DIM ** -0.5)
    for seg, q, (k_all, v_all) in zip(segments, qs, history):
        expected = dense(q, k_all, v_all, seg.is_causal, seg.num_cached)
        torch.testing.assert_close(out[seg.start:seg.end], expected, atol=1e-5, rtol=1e-5)
        if seg.is_write:  # the step's K/V landed at the sequence's positions
            torch.testing.assert_close(cache_k[seg.flat_index], k_all)


@given(st.lists(st.tuples(st.sampled_from("abcd"), st.integers(0, 9), st.booleans()), max_size=60))
def test_page_pool_invariants(ops):
    pool = PagePool(num_pages=12, page_size=4)
    for request, num_tokens, is_free in ops:
        if is_free:
            pool.free_request(request)
            continue
        key = (request, "main")
        before = pool.num_free_pages
        needed = pool.num_new_pages(key, num_tokens)
        if pool.reserve(key, num_tokens):
            pool.commit(key, num_tokens)
            assert pool.num_free_pages == before - needed
            assert len(pool.page_table(key)) == pool.pages_for(pool.num_tokens(key))
        else:
            assert needed > before and pool.num_free_pages == before
        tables = [pool.page_table((r, "main")) for r in "abcd"]
        held = [p for table in tables for p in table]
        assert len(held) == len(set(held))  # no page in two tables
        assert len(held) + pool.num_free_pages == pool.num_pages  # no page lost


@given(st.lists(st.tuples(st.integers(1, 40), st.integers(0, 30), st.booleans(), st.booleans()), min_size=1,
                max_size=4), st.integers(1, 50), st.integers(0, 2**16))
def test_queries_in_blocks_give_the_unblocked_output(rows, block_rows, seed):
    """A long segment's queries go in blocks (SCORES_BLOCK_ELEMENTS bounds its scores: a 100k-token
    prompt's took a terabyte); any block size gives the unblocked output, causal or not, writing or
    read-only, up to the products' rounding (a one-row product may take another BLAS kernel). The
    blocks depend on the segment's own shape only, so a row's numbers still do not depend on the
    other rows of its step."""
    from mstar.runtime.engine.attention import torch_paged

    torch.manual_seed(seed)
    total = sum(n for n, _, _, _ in rows)
    q, k, v = torch.randn(total, HEADS_Q, DIM), torch.randn(total, HEADS_KV, DIM), torch.randn(total, HEADS_KV, DIM)
    size = sum(n + c for n, c, _, _ in rows)
    cache = torch.randn(size, HEADS_KV, DIM), torch.randn(size, HEADS_KV, DIM)
    segments, start, base = [], 0, 0
    for num_tokens, num_cached, is_causal, is_write in rows:
        length = num_cached + (num_tokens if is_write else 0)
        segments.append(Segment(start, num_tokens, num_cached, torch.arange(base, base + length), is_causal, is_write))
        start, base = start + num_tokens, base + num_cached + num_tokens
    whole = paged_attention(q, k, v, cache[0].clone(), cache[1].clone(), segments, 0.3)
    limit = torch_paged.SCORES_BLOCK_ELEMENTS
    try:
        torch_paged.SCORES_BLOCK_ELEMENTS = HEADS_Q * block_rows  # block_rows queries over a key a block
        blocked = paged_attention(q, k, v, cache[0].clone(), cache[1].clone(), segments, 0.3)
    finally:
        torch_paged.SCORES_BLOCK_ELEMENTS = limit
    torch.testing.assert_close(blocked, whole, rtol=1e-5, atol=1e-6)
