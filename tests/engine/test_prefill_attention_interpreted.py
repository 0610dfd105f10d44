"""The Triton paged prefill attention of the whole split graphs (`engine/gpu/prefill_attention.py`)
under the Triton interpreter on the CPU, against causal attention in fp32 over the gathered pages
(`forward.torch_attend`)."""
from dataclasses import dataclass

import pytest
import torch

pytest.importorskip("triton")

from interpreter_child import parent_only, run_child, skip_unless_child  # noqa: E402

from mstar.runtime.engine.gpu import prefill_attention as pa  # noqa: E402
from mstar.runtime.engine.gpu.forward import torch_attend  # noqa: E402


@pytest.fixture
def interpreted():
    skip_unless_child("test_prefill_attention_under_the_interpreter")
    return pa


@parent_only
def test_prefill_attention_under_the_interpreter():
    """Triton reads TRITON_INTERPRET when it first decorates its own library: this file again, in a
    process with the variable set."""
    run_child(__file__, "15 passed")


def random_rows(rows, page_size, hkv, d, seed, spare_pages=3):
    """rows: (query tokens, KV positions) of each row, its new tokens the last positions; pages
    scattered over a shuffled pool; a row of (0, 0) is a padding row (no pages)."""
    gen = torch.Generator().manual_seed(seed)
    needs = [-(-kv // page_size) for _, kv in rows]
    pool = sum(needs) + spare_pages
    order = torch.randperm(pool, generator=gen).to(torch.int32)
    qo = torch.tensor([0] + list(torch.tensor([n for n, _ in rows]).cumsum(0)), dtype=torch.int32)
    kv_indptr = torch.tensor([0] + list(torch.tensor(needs).cumsum(0)), dtype=torch.int32)
    indices = order[:sum(needs)]
    last = torch.tensor([kv - (p - 1) * page_size if p else 0 for (_, kv), p in zip(rows, needs)], dtype=torch.int32)
    k_pages = torch.randn(pool, page_size, hkv, d, generator=gen).to(torch.bfloat16)
    v_pages = torch.randn(pool, page_size, hkv, d, generator=gen).to(torch.bfloat16)
    return qo, kv_indptr, indices, last, k_pages, v_pages


def attend(shape, rows, seed, tokens=None, strided=False):
    """The kernel's output beside the reference's, over a step of `tokens` (the rows' tokens, then
    padding tokens nobody attends); out starts as NaN so unwritten tokens show."""
    hq, hkv, d = shape.num_qo_heads, shape.num_kv_heads, shape.head_dim
    qo, kv_indptr, indices, last, k_pages, v_pages = random_rows(rows, shape.page_size, hkv, d, seed)
    tokens = tokens or int(qo[-1])
    gen = torch.Generator().manual_seed(seed + 100)
    if strided:  # q a view of a wider step tensor (the q part of a q/k/v product)
        q = torch.randn(tokens, (hq + 2 * hkv) * d, generator=gen).to(torch.bfloat16)[:, :hq * d].view(tokens, hq, d)
    else:
        q = torch.randn(tokens, hq, d, generator=gen).to(torch.bfloat16)
    out = torch.full((tokens, hq, d), float("nan"), dtype=torch.bfloat16)
    pa.prefill_attention(shape, q, k_pages, v_pages, qo, kv_indptr, indices, last, out)
    expected = torch_attend(qo.tolist(), kv_indptr.tolist(), indices, last.tolist(), shape.page_size, d ** -0.5)(
        0, q.float(), k_pages.float(), v_pages.float())
    return out, expected, qo


@pytest.mark.parametrize("hq,hkv,d,splits,rows", [
    (8, 2, 16, 1, [(40, 40), (5, 70)]),                  # a prompt from position 0, a chunk after 65 cached
    (8, 2, 16, 4, [(37, 300), (1, 1), (20, 530)]),       # split shares, some past a block's last position
    (4, 4, 32, 2, [(33, 600)]),                          # no grouping: 64 tokens a block
    (12, 4, 16, 2, [(23, 90), (9, 9)]),                  # a group of 3, padded to 4
    (8, 2, 16, 2, [(6, 70), (0, 0), (17, 129)]),         # a padding row between two rows
])
@pytest.mark.parametrize("page_size", [16, 48])
def test_matches_causal_fp32_attention_over_the_gathered_pages(interpreted, hq, hkv, d, splits, rows, page_size):
    """(The grid in either order: the blocks last where a page of 48 positions is asked.)"""
    shape = pa.PrefillShape(hq, hkv, d, page_size, num_rows=len(rows), num_tokens=sum(n for n, _ in rows) + 7,
                            num_splits=splits, block_n=32, min_split_tokens=64, blocks_last=page_size == 48)
    out, expected, qo = attend(shape, rows, seed=len(rows) + splits + page_size, tokens=shape.num_tokens)
    real = int(qo[-1])
    torch.testing.assert_close(out[:real].float(), expected[:real], atol=2e-2, rtol=2e-2)
    assert out[real:].isnan().all()  # the step's padding tokens: no row's, never written


def test_rows_before_the_first_are_left_alone(interpreted):
    """The split route's row 0 (the decode rows' tokens over one page) is the decode kernel's: the
    prefill kernel writes neither it nor, split, any merged output of its tokens."""
    rows = [(3, 20), (30, 100), (12, 12)]
    shape = pa.PrefillShape(8, 2, 16, 16, num_rows=3, num_tokens=50, first_row=1, num_splits=4, block_n=16,
                            min_split_tokens=32)
    out, expected, qo = attend(shape, rows, seed=5, tokens=50)
    assert out[:3].isnan().all() and out[45:].isnan().all()
    torch.testing.assert_close(out[3:45].float(), expected[3:45], atol=2e-2, rtol=2e-2)


def test_a_strided_query_view(interpreted):
    shape = pa.PrefillShape(8, 2, 16, 16, num_rows=2, num_tokens=40, num_splits=2, block_n=16, min_split_tokens=32)
    out, expected, _ = attend(shape, [(25, 90), (15, 15)], seed=9, strided=True)
    torch.testing.assert_close(out.float(), expected, atol=2e-2, rtol=2e-2)


def test_a_graph_shape_fills_the_device():
    """Llama-3.2-1B's heads in the llama plan's split graphs: 16 tokens a block (x a group of 4),
    splits up to two programs an SM, none from 1,024 tokens; every row may waste one block."""
    chunk = pa.graph_shape(32, 8, 64, 16, num_rows=65, num_tokens=256, first_row=1, sm_count=132)
    assert (chunk.block_t, chunk.num_splits, chunk.num_blocks) == (16, 4, 16 + 64)
    assert pa.graph_shape(32, 8, 64, 16, 65, 1024, 1, 132).num_splits == 1
    assert pa.graph_shape(28, 4, 128, 16, 9, 512, 1, 132).block_t == 8  # a group of 7 padded to 8
    assert pa.partial_numel(chunk) == 256 * 32 * 4 * 65 and pa.partial_numel(pa.graph_shape(
        32, 8, 64, 16, 65, 1024, 1, 132)) == 0
    # the token blocks on the grid's slowest axis, in 8 KiB tiles of K, only where the rows' spare
    # blocks outnumber the bucket's; else 16 KiB tiles
    two_rows = pa.graph_shape(32, 8, 64, 16, 2, 256, 1, 132)
    assert (chunk.blocks_last, chunk.block_n) == (True, 64) and (two_rows.blocks_last, two_rows.block_n) == (False, 128)
    assert not pa.graph_shape(32, 8, 64, 16, 65, 4096, 1, 132).blocks_last
    assert pa.graph_shape(24, 8, 128, 16, 65, 256, 1, 132).block_n == 32


# A whole graph's step in the two tests below: heads, page size, batch size and token bucket
HQ, HKV, D, PAGE_SIZE, BATCH, BUCKET = 8, 2, 16, 16, 6, 64


@dataclass
class _GraphStep:
    qo: torch.Tensor
    kv: torch.Tensor
    indices: torch.Tensor
    last: torch.Tensor
    k_pages: torch.Tensor
    v_pages: torch.Tensor
    pages: torch.Tensor  # the page indices in a graph's fixed buffer of 64 entries


def _graph_step(rows, seed: int) -> _GraphStep:
    """`random_rows` over `rows`, then padding rows (no pages) up to BATCH."""
    qo, kv, indices, last, k_pages, v_pages = random_rows(rows + [(0, 0)] * (BATCH - len(rows)), PAGE_SIZE, HKV, D,
                                                          seed)
    pages = torch.zeros(64, dtype=torch.int32)
    pages[:indices.shape[0]] = indices
    return _GraphStep(qo, kv, indices, last, k_pages, v_pages, pages)


def _assert_attends_causally(attend, step: _GraphStep, seed: int) -> None:
    """`attend` (a graph's attention of one layer) over a random q of BUCKET tokens equals causal
    attention over the step's rows, in fp32, on its real tokens."""
    q = torch.randn(BUCKET, HQ, D, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)
    got = attend(0, q, step.k_pages, step.v_pages)
    expected = torch_attend(step.qo.tolist(), step.kv.tolist(), step.indices, step.last.tolist(), PAGE_SIZE,
                            D ** -0.5)(0, q.float(), step.k_pages.float(), step.v_pages.float())
    real = int(step.qo[-1])
    torch.testing.assert_close(got[:real].float(), expected[:real], atol=2e-2, rtol=2e-2)


def test_the_split_route_on_triton_kernels_alone_attends_every_row(interpreted):
    """`packed_graphs.SplitAttend` over a packed split step (decode rows first, prompt rows, padding
    rows; the arrays derived as the graph derives them): the decode kernel's rows and the prefill
    kernel's tokens together equal causal attention over the packed step."""
    from mstar.runtime.engine.gpu.attention import TritonDecode
    from mstar.runtime.engine.gpu.packed_graphs import SplitArrays, SplitAttend, derive_split_arrays

    rows = [(1, 40), (1, 17), (30, 95), (12, 12)]  # two decode rows, then two prompt rows; 2 padding rows
    step = _graph_step(rows, seed=3)
    arrays = SplitArrays.zeros(BATCH, torch.device("cpu"))
    arrays.num_decode.fill_(2)
    derive_split_arrays(step.qo, step.kv, step.last, arrays)
    heads = (HQ, HKV, D)
    decode = TritonDecode(heads, PAGE_SIZE, BATCH, arrays.dec_indptr, step.pages, arrays.dec_last, sm_count=132)
    shape = pa.graph_shape(*heads, PAGE_SIZE, BATCH + 1, BUCKET, 1, 132)
    _assert_attends_causally(SplitAttend(decode, shape, BATCH, arrays, step.pages, None), step, seed=4)


def test_a_packed_key_on_the_triton_prefill_kernel_attends_every_row(interpreted):
    """`packed_graphs.PackedAttend` (a whole graph's packed key with `set_triton_packed`) over a packed
    step of its graph's shape: prompt rows, the packed route's one-token decode rows and padding
    rows in one prefill call equal causal attention over the step."""
    from mstar.runtime.engine.gpu.packed_graphs import PackedAttend

    rows = [(30, 95), (1, 40), (12, 12), (1, 17)]  # prompt rows and decode rows mixed; 2 padding rows
    step = _graph_step(rows, seed=5)
    shape = pa.graph_shape(HQ, HKV, D, PAGE_SIZE, BATCH, BUCKET, 0, 132)
    _assert_attends_causally(PackedAttend(shape, step.qo, step.kv, step.pages, step.last, None), step, seed=6)
