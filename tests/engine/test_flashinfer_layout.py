"""FlashInferAttention's CSR layout, checked on the CPU against a stand-in `flashinfer` module that
implements the documented semantics of BatchPrefillWithPagedKVCacheWrapper (plan: qo_indptr,
kv page indptr / indices / last-page lengths; run: causal, bottom-right aligned, NHD pages). The
real kernel against the torch path is tests/gpu/test_gpu_engine.py."""
import sys
import types

import torch

from mstar.runtime.engine.attention.torch_paged import Segment, paged_attention


class _StandInWrapper:
    def __init__(self, workspace, layout):
        assert layout == "NHD"
        self.planned = None

    def plan(self, qo_indptr, kv_indptr, kv_indices, last_page_len, num_qo_heads, num_kv_heads, head_dim,
             page_size, causal, sm_scale, q_data_type, kv_data_type):
        for t in (qo_indptr, kv_indptr, kv_indices, last_page_len):
            assert t.dtype == torch.int32
        assert causal and q_data_type == kv_data_type == torch.bfloat16
        self.planned = (qo_indptr.tolist(), kv_indptr.tolist(), kv_indices.tolist(), last_page_len.tolist(),
                        page_size, sm_scale)

    def run(self, q, caches):
        qo, kv_indptr, indices, last, page_size, scale = self.planned
        k_pages, v_pages = caches
        out = torch.empty_like(q)
        group = q.shape[1] // k_pages.shape[2]
        for i in range(len(qo) - 1):
            pages = indices[kv_indptr[i]:kv_indptr[i + 1]]
            kv_len = (len(pages) - 1) * page_size + last[i]
            keys = k_pages[pages].reshape(-1, *k_pages.shape[2:])[:kv_len].float().repeat_interleave(group, 1)
            values = v_pages[pages].reshape(-1, *v_pages.shape[2:])[:kv_len].float().repeat_interleave(group, 1)
            rows = q[qo[i]:qo[i + 1]].float()
            scores = torch.einsum("thd,shd->hts", rows, keys) * scale
            q_pos = torch.arange(rows.shape[0]).unsqueeze(1) + kv_len - rows.shape[0]  # bottom-right
            scores = scores.masked_fill(torch.arange(kv_len).unsqueeze(0) > q_pos, float("-inf"))
            out[qo[i]:qo[i + 1]] = torch.einsum("hts,shd->thd", scores.softmax(-1), values).to(q.dtype)
        return out


def test_plan_layout_matches_the_torch_path(monkeypatch):
    monkeypatch.setitem(sys.modules, "flashinfer",
                        types.SimpleNamespace(BatchPrefillWithPagedKVCacheWrapper=_StandInWrapper))
    from mstar.runtime.engine.attention.flashinfer_paged import FlashInferAttention

    torch.manual_seed(0)
    page_size, hq, hkv, d, num_pages = 4, 4, 2, 8, 32
    rows = [(1, 9), (5, 0), (3, 4), (1, 3), (6, 6)]  # (new tokens, cached): decode rows beside prompt chunks
    free = torch.randperm(num_pages).tolist()
    segments, tables, start = [], [], 0
    for num_tokens, num_cached in rows:
        total = num_tokens + num_cached
        table = [free.pop() for _ in range(-(-total // page_size) + (1 if num_tokens == 3 else 0))]  # a spare page
        pos = torch.arange(total)
        segments.append(Segment(start, num_tokens, num_cached,
                                torch.tensor(table)[pos // page_size] * page_size + pos % page_size))
        tables.append(table)
        start += num_tokens
    q = torch.randn(start, hq, d).bfloat16()
    k, v = torch.randn(start, hkv, d).bfloat16(), torch.randn(start, hkv, d).bfloat16()
    cache = [torch.randn(num_pages * page_size, hkv, d).bfloat16() for _ in range(2)]
    reference_cache = [c.clone() for c in cache]
    expected = paged_attention(q, k, v, *reference_cache, segments, d ** -0.5)

    backend = FlashInferAttention(torch.device("cpu"), hq, hkv, d, page_size)
    assert backend.num_steps == 0  # the start-up warm-up is not counted
    new_index = torch.cat([s.flat_index[s.num_cached:] for s in segments])
    attend = backend.plan_step([(s.num_tokens, s.num_cached, t) for s, t in zip(segments, tables)], new_index,
                               d ** -0.5)
    got = attend(q, k, v, *cache, d ** -0.5)
    assert backend.num_steps == 1
    assert torch.equal(cache[0], reference_cache[0]) and torch.equal(cache[1], reference_cache[1])
    assert torch.allclose(got.float(), expected.float(), atol=2e-2, rtol=2e-2)
