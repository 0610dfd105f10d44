"""The Triton paged prefill attention of the whole split graphs (`engine/gpu/prefill_attention.py`)
on the GPU: against causal fp32 attention (`forward.torch_attend`) and FlashInfer's prefill over
the same pages, at the shapes the split graphs launch (a chunk after 0 to 7,936 cached tokens,
several prompt rows, padding rows), and replayed from a CUDA graph after the index arrays change in
place; then timed beside FlashInfer's graph-mode prefill (its always-split KV and merge), printed."""
import time

import pytest
import torch

from mstar.runtime.engine.gpu.forward import torch_attend

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]
PAGE = 16


def _step(rows, hkv, d, seed, tokens=None, pool=0):
    """Device pages and CSR arrays of rows (query tokens, KV positions), their new tokens the last
    positions; a row (0, 0) is a padding row. Returns (pages, qo, kv, indices, last, tokens)."""
    gen = torch.Generator().manual_seed(seed)
    needs = [-(-kv // PAGE) for _, kv in rows]
    pool = max(pool, sum(needs) + 2)
    indices = torch.randperm(pool, generator=gen)[:sum(needs)].to(torch.int32)
    qo = torch.tensor([0] + list(torch.tensor([n for n, _ in rows]).cumsum(0)), dtype=torch.int32)
    kv = torch.tensor([0] + list(torch.tensor(needs).cumsum(0)), dtype=torch.int32)
    last = torch.tensor([n - (p - 1) * PAGE if p else 0 for (_, n), p in zip(rows, needs)], dtype=torch.int32)
    pages = torch.randn(2, pool, PAGE, hkv, d, generator=gen).to(torch.bfloat16)
    return pages.cuda(), qo.cuda(), kv.cuda(), indices.cuda(), last.cuda(), tokens or int(qo[-1])


def _reference(q, pages, qo, kv, indices, last):
    return torch_attend(qo.tolist(), kv.tolist(), indices, last.tolist(), PAGE, q.shape[2] ** -0.5)(
        0, q.float(), pages[0].float(), pages[1].float())


def _flashinfer(q, pages, qo, kv, indices, last, graph_mode=False):
    """FlashInfer's fa2 prefill over the same rows (eager, or as a graph-mode wrapper plans it)."""
    import flashinfer

    hq, hkv, d = q.shape[1], pages.shape[3], q.shape[2]
    rows = last.shape[0]
    buffers = dict(qo_indptr_buf=qo, paged_kv_indptr_buf=kv, paged_kv_indices_buf=indices,
                   paged_kv_last_page_len_buf=last) if graph_mode else {}
    wrapper = flashinfer.BatchPrefillWithPagedKVCacheWrapper(
        torch.zeros(512 << 20, dtype=torch.uint8, device="cuda"), "NHD", use_cuda_graph=graph_mode, backend="fa2",
        **buffers)
    wrapper.plan(qo[:rows + 1], kv[:rows + 1], indices, last, hq, hkv, d, PAGE, causal=True,
                 q_data_type=torch.bfloat16, kv_data_type=torch.bfloat16)
    return wrapper


def _shape(heads, rows, tokens, first_row=0):
    from mstar.runtime.engine.gpu import prefill_attention as pa

    sm_count = torch.cuda.get_device_properties(0).multi_processor_count
    return pa.graph_shape(*heads, PAGE, rows, tokens, first_row, sm_count)


KEY_ROWS = [(216, 4312), (9, 900)] + [(0, 0)] * 62  # a whole split key's 64 CSR rows: the blocks last


@pytest.mark.parametrize("heads", [(32, 8, 64), (24, 8, 128), (28, 4, 128)])
@pytest.mark.parametrize("rows", [[(216, 216)], [(216, 4312)], [(216, 8152)], [(100, 300), (0, 0), (37, 37), (9, 900)],
                                  KEY_ROWS], ids=["0", "4096", "7936", "four-rows", "key-rows"])
def test_graph_shapes_match_fp32_and_flashinfer(heads, rows):
    from mstar.runtime.engine.gpu import prefill_attention as pa

    hq, hkv, d = heads
    pages, qo, kv, indices, last, _ = _step(rows, hkv, d, seed=len(rows) + rows[0][1])
    tokens = 256
    q = torch.randn(tokens, hq, d, device="cuda", dtype=torch.bfloat16)
    out = torch.full_like(q, float("nan"))
    shape = _shape(heads, len(rows), tokens)
    assert shape.blocks_last == (rows is KEY_ROWS)
    pa.prefill_attention(shape, q, pages[0], pages[1], qo, kv, indices, last, out)
    real = int(qo[-1])
    expected = _reference(q[:real], pages, qo, kv, indices, last)
    torch.testing.assert_close(out[:real].float(), expected, atol=1e-2, rtol=1e-2)
    flashinfer_out = _flashinfer(q[:real], pages, qo, kv, indices, last).run(q[:real], (pages[0], pages[1]))
    torch.testing.assert_close(out[:real].float(), flashinfer_out.float(), atol=1e-2, rtol=1e-2)
    assert out[real:].isnan().all()


def test_a_graph_replays_after_its_arrays_change_in_place():
    """One capture at the bucket's shape; two different steps staged into the same arrays."""
    from mstar.runtime.engine.gpu import prefill_attention as pa

    heads, rows, tokens = (32, 8, 64), 4, 256
    pages, qo, kv, first_indices, last, _ = _step([(200, 4000), (16, 16), (0, 0), (0, 0)], 8, 64, seed=1, pool=600)
    indices = torch.zeros(600, dtype=torch.int32, device="cuda")  # the graph's page list, room for any step's
    indices[:first_indices.shape[0]].copy_(first_indices)
    shape = _shape(heads, rows, tokens, first_row=1)
    q = torch.randn(tokens, 32, 64, device="cuda", dtype=torch.bfloat16)
    out = torch.zeros_like(q)
    partial = torch.empty(pa.partial_numel(shape), dtype=torch.float32, device="cuda")
    run = lambda: pa.prefill_attention(shape, q, pages[0], pages[1], qo, kv, indices, last, out, partial)  # noqa: E731
    run()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run()
    for step_rows, seed in (([(3, 30), (120, 2000), (40, 40), (0, 0)], 2), ([(1, 5), (0, 0), (7, 7000), (90, 90)], 3)):
        _, qo2, kv2, indices2, last2, _ = _step(step_rows, 8, 64, seed=seed, pool=600)
        qo.copy_(qo2), kv.copy_(kv2), last.copy_(last2)
        indices[:indices2.shape[0]].copy_(indices2)
        out.zero_()
        graph.replay()
        torch.cuda.synchronize()
        first, real = int(qo2[1]), int(qo2[-1])
        expected = _reference(q[:real], pages, qo2, kv2, indices2, last2)
        torch.testing.assert_close(out[first:real].float(), expected[first:real], atol=1e-2, rtol=1e-2)
        assert out[:first].abs().sum() == 0  # row 0 (the decode rows' tokens) left alone


def _graph_us(run, replays=50):
    graph = torch.cuda.CUDAGraph()
    run()
    with torch.cuda.graph(graph):
        for _ in range(16):  # a step's 16 layers
            run()
    graph.replay()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(replays):
        graph.replay()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / replays / 16 * 1e6


def _chunk_timings(context: int, num_rows: int) -> tuple[float, float, int]:
    """(Triton us, FlashInfer graph-mode us, splits) a layer for a 216-token chunk after `context`,
    over `num_rows` CSR rows (the chunk step's whole key has 64: 40 decode rows and the prompt, padded)."""
    from mstar.runtime.engine.gpu import prefill_attention as pa

    # row 0: the decode rows' tokens over a page, as the split route; then the prompt; then padding rows
    rows = [(40, 41), (216, 216 + context)] + [(0, 0)] * (num_rows - 2)
    pages, qo, kv, indices, last, _ = _step(rows, 8, 64, seed=context)
    q = torch.randn(256, 32, 64, device="cuda", dtype=torch.bfloat16)
    shape = _shape((32, 8, 64), num_rows, 256, first_row=1)
    out = torch.empty_like(q)
    partial = torch.empty(max(1, pa.partial_numel(shape)), dtype=torch.float32, device="cuda")
    triton_us = _graph_us(lambda: pa.prefill_attention(shape, q, pages[0], pages[1], qo, kv, indices, last, out,
                                                       partial))
    wrapper = _flashinfer(q, pages, qo, kv, indices, last, graph_mode=True)
    return triton_us, _graph_us(lambda: wrapper.run(q, (pages[0], pages[1]))), shape.num_splits


def test_timed_against_flashinfers_graph_mode_prefill():
    """Not a timed test (nothing asserted on time): the per-layer figures of a chunk step's prompt
    attention, printed for docs/engine.md (`pytest -s`)."""
    for num_rows in (2, 64):
        for context in (0, 4096, 7936):
            triton_us, flashinfer_us, splits = _chunk_timings(context, num_rows)
            print(f"\nchunk of 216 after {context} over {num_rows} CSR rows: triton {triton_us:.1f} us a layer "
                  f"({splits} splits), FlashInfer graph-mode fa2 {flashinfer_us:.1f} us")
