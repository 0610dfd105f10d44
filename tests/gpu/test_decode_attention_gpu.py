"""The Triton paged decode attention (`engine/gpu/decode_attention.py`) on the GPU: against fp32
attention and FlashInfer's tensor-core decode over the same pages, at the shapes the decode graphs
launch (Llama-3.2-1B's heads, Qwen3.5's, Orpheus's and Qwen3-Omni's thinker's: a group of 7),
padding rows included, and replayed from a CUDA graph (with programmatic dependent launch where the
GPU has it) after the index arrays change in place."""
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "engine"))
from graph_standins import decode_reference  # noqa: E402

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]
PAGE = 16


def _rows(seq_lens, hkv, d, seed, pool=0):
    """Device K/V pages for the rows (a shuffled pool of at least `pool` pages) and their CSR
    arrays; length 0: a padding row."""
    gen = torch.Generator().manual_seed(seed)
    needs = [-(-n // PAGE) for n in seq_lens]
    pool = max(pool, sum(needs) + 2)
    indices = torch.randperm(pool, generator=gen)[:sum(needs)].to(torch.int32)
    indptr = torch.tensor([0] + list(torch.tensor(needs).cumsum(0)), dtype=torch.int32)
    last = torch.tensor([n - (p - 1) * PAGE if p else 0 for n, p in zip(seq_lens, needs)], dtype=torch.int32)
    pages = torch.randn(2, pool, PAGE, hkv, d, generator=gen).to(torch.bfloat16)
    return pages.cuda(), indptr.cuda(), indices.cuda(), last.cuda()


def _flashinfer(q, pages, indptr, indices, last):
    import flashinfer

    hq, hkv, d = q.shape[1], pages.shape[3], q.shape[2]
    wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
        torch.zeros(64 << 20, dtype=torch.uint8, device="cuda"), "NHD", use_tensor_cores=True, backend="fa2")
    wrapper.plan(indptr, indices, last, hq, hkv, d, PAGE, q_data_type=torch.bfloat16, kv_data_type=torch.bfloat16)
    return wrapper.run(q, (pages[0], pages[1]))


@pytest.mark.parametrize("heads", [(32, 8, 64), (8, 2, 256), (24, 8, 128), (28, 4, 128)])
@pytest.mark.parametrize("rows", [1, 5, 64])
def test_graph_shapes_match_fp32_and_flashinfer(heads, rows):
    from mstar.runtime.engine.gpu import decode_attention as da

    hq, hkv, d = heads
    seq_lens = [int(n) for n in torch.randint(1, 3000, (rows,), generator=torch.Generator().manual_seed(rows))]
    pages, indptr, indices, last = _rows(seq_lens, hkv, d, seed=rows)
    q = torch.randn(rows, hq, d, device="cuda", dtype=torch.bfloat16)
    shape = da.graph_shape(hq, hkv, d, PAGE, rows, torch.cuda.get_device_properties(0).multi_processor_count)
    got = da.decode_attention(shape, q, pages[0], pages[1], indptr, indices, last).float()
    expected = decode_reference(q, pages[0], pages[1], indptr, indices, last)
    torch.testing.assert_close(got, expected, atol=1e-2, rtol=1e-2)
    torch.testing.assert_close(got, _flashinfer(q, pages, indptr, indices, last).float(), atol=1e-2, rtol=1e-2)


@pytest.mark.parametrize("merge_here", [False, True], ids=["merge kernel", "merged in kernel"])
@pytest.mark.parametrize("splits", [1, 8])
def test_a_captured_graph_follows_its_index_arrays(splits, merge_here, monkeypatch):
    """A graph captured over fixed index buffers (as a decode graph's `staged` views) replays the
    rows written into them later, a padding row (no pages) giving zeros; 20 more replays give the
    same bits (merged in the kernel: the last split to count merges and sets its counter back)."""
    from mstar.runtime.engine.gpu import decode_attention as da

    monkeypatch.setattr(da, "_merges_in_kernel", merge_here)

    hq, hkv, d, rows = 32, 8, 64, 4
    first, later = [40, 1, 700, 2000], [1500, 0, 17, 333]
    pages, indptr, indices, last = _rows(first, hkv, d, seed=1, pool=200)
    _, late_indptr, late_indices, late_last = _rows(later, hkv, d, seed=2, pool=200)  # the same pool, other pages
    indices_buffer = torch.zeros(200, dtype=torch.int32, device="cuda")
    indices_buffer[:indices.numel()] = indices
    q = torch.randn(rows, hq, d, device="cuda", dtype=torch.bfloat16)
    shape = da.DecodeShape(hq, hkv, d, PAGE, num_splits=splits, block_n=128, min_split_tokens=128)
    partial = torch.empty(da.partial_numel(shape, rows), dtype=torch.float32, device="cuda")
    counts = torch.zeros(rows * hkv, dtype=torch.int32, device="cuda")
    run = lambda: da.decode_attention(shape, q, pages[0], pages[1], indptr, indices_buffer, last, partial,  # noqa: E731
                                      counts=counts)
    run()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = run()
    graph.replay()
    torch.testing.assert_close(out.float(), decode_reference(q, pages[0], pages[1], indptr, indices, last),
                               atol=1e-2, rtol=1e-2)
    indptr.copy_(late_indptr)
    last.copy_(late_last)
    indices_buffer[:late_indices.numel()].copy_(late_indices)
    graph.replay()
    expected = decode_reference(q, pages[0], pages[1], late_indptr, late_indices, late_last)
    torch.testing.assert_close(out.float(), expected, atol=1e-2, rtol=1e-2)
    first_bits = out.clone()
    for _ in range(20):  # the last split of each (row, head) merges and sets its counter back
        graph.replay()
        assert torch.equal(out, first_bits)
    assert not counts.any()
    assert float(out[1].abs().max()) == 0.0  # the padding row


def test_the_decode_bench_times_every_kernel():
    """`mstar bench attention --decode`'s figures, on a short context: every kernel timed, the
    Triton output close to FlashInfer's."""
    from mstar.runtime.engine.gpu import bench_decode_attention

    result = bench_decode_attention.run(3, 256, (32, 8, 64), is_spread=True, split_what_ifs=True)
    for case in result["rows"].values():
        assert case["triton_us"] > 0 and case["flashinfer_tensor_us"] > 0 and case["flashinfer_cuda_us"] > 0
        assert case["max_abs_diff"] < 2e-2 and case["floor_us"] > 0
        assert any(key.endswith("_splits_us") for key in case)  # at least one other split count timed
