"""The Triton paged decode attention (`engine/gpu/decode_attention.py`) under the Triton interpreter
on the CPU, against attention computed in fp32 from the gathered pages."""
import pytest
import torch

pytest.importorskip("triton")

from graph_standins import decode_reference  # noqa: E402
from interpreter_child import parent_only, run_child, skip_unless_child  # noqa: E402

from mstar.runtime.engine.gpu import decode_attention as da  # noqa: E402


@pytest.fixture
def interpreted():
    skip_unless_child("test_decode_attention_under_the_interpreter")
    return da


@parent_only
def test_decode_attention_under_the_interpreter():
    """Triton reads TRITON_INTERPRET when it first decorates its own library: this file again, in a
    process with the variable set."""
    run_child(__file__, "33 passed")


def random_rows(seq_lens, page_size, hkv, d, seed, spare_pages=3):
    """Pages for each row's positions, scattered over a shuffled pool (with pages no row uses); a
    row of length 0 is a padding row as the glue packs it (no pages, last page length 0)."""
    gen = torch.Generator().manual_seed(seed)
    needs = [-(-n // page_size) for n in seq_lens]
    pool = sum(needs) + spare_pages
    order = torch.randperm(pool, generator=gen).to(torch.int32)
    indptr = torch.tensor([0] + list(torch.tensor(needs).cumsum(0)), dtype=torch.int32)
    indices = order[:sum(needs)]
    last = torch.tensor([n - (p - 1) * page_size if p else 0 for n, p in zip(seq_lens, needs)], dtype=torch.int32)
    k_pages = torch.randn(pool, page_size, hkv, d, generator=gen).to(torch.bfloat16)
    v_pages = torch.randn(pool, page_size, hkv, d, generator=gen).to(torch.bfloat16)
    return k_pages, v_pages, indptr, indices, last


@pytest.mark.parametrize("hq,hkv,d,splits,seq_lens", [
    (8, 2, 16, 1, [1, 17, 64, 100]),          # one program a (row, KV head): whole rows
    (8, 2, 16, 4, [1, 17, 300, 530]),         # split rows, some shorter than one share
    (4, 4, 32, 2, [33, 600]),                 # no grouping (one query head a KV head)
    (12, 4, 16, 8, [5, 1100]),                # a group of 3, padded to the product's 16 rows
    (8, 2, 16, 2, [70, 0, 129]),              # a padding row between two rows: zeros
])
@pytest.mark.parametrize("page_size", [16, 48])  # a tile of 32 positions holds two pages, or part of one
@pytest.mark.parametrize("merge_here", [False, True], ids=["merge kernel", "merged in kernel"])
def test_matches_fp32_attention_over_the_gathered_pages(interpreted, monkeypatch, hq, hkv, d, splits, seq_lens,
                                                        page_size, merge_here):
    monkeypatch.setattr(da, "_merges_in_kernel", merge_here)
    k_pages, v_pages, indptr, indices, last = random_rows(seq_lens, page_size, hkv, d, seed=len(seq_lens) + splits)
    q = torch.randn(len(seq_lens), hq, d).to(torch.bfloat16)
    shape = da.DecodeShape(hq, hkv, d, page_size, num_splits=splits, block_n=32, min_split_tokens=64)
    got = interpreted.decode_attention(shape, q, k_pages, v_pages, indptr, indices, last)
    expected = decode_reference(q, k_pages, v_pages, indptr, indices, last)
    assert got.dtype == torch.bfloat16 and got.shape == q.shape
    torch.testing.assert_close(got.float(), expected, atol=4e-3, rtol=1e-2)


def test_a_strided_query_view_and_a_given_scratch(interpreted):
    """q as a view of a wider step tensor (the q part of a q/k/v product), the scratch passed in."""
    hq, hkv, d, page_size = 8, 2, 16, 16
    seq_lens = [40, 200, 3]
    k_pages, v_pages, indptr, indices, last = random_rows(seq_lens, page_size, hkv, d, seed=7)
    qkv = torch.randn(len(seq_lens), (hq + 2 * hkv) * d).to(torch.bfloat16)
    q = qkv[:, :hq * d].view(len(seq_lens), hq, d)
    shape = da.DecodeShape(hq, hkv, d, page_size, num_splits=2, block_n=16, min_split_tokens=32)
    partial = torch.full((da.partial_numel(shape, len(seq_lens)),), float("nan"))
    got = interpreted.decode_attention(shape, q, k_pages, v_pages, indptr, indices, last, partial)
    torch.testing.assert_close(got.float(), decode_reference(q, k_pages, v_pages, indptr, indices, last),
                               atol=4e-3, rtol=1e-2)


@pytest.fixture
def merging_in_kernel(interpreted, monkeypatch):
    monkeypatch.setattr(da, "_merges_in_kernel", True)
    return interpreted


def test_one_launch_merges_its_splits_and_leaves_the_counters_zero(merging_in_kernel):
    """`set_merge_in_kernel(True)`: the last split of a (row, KV head) to count merges the group;
    given counters stay zero between calls (one set serves every layer and replay of a graph)."""
    interpreted = merging_in_kernel
    hq, hkv, d, page_size = 8, 2, 16, 16
    seq_lens = [300, 0, 45, 530]
    k_pages, v_pages, indptr, indices, last = random_rows(seq_lens, page_size, hkv, d, seed=11)
    q = torch.randn(len(seq_lens), hq, d).to(torch.bfloat16)
    shape = da.DecodeShape(hq, hkv, d, page_size, num_splits=4, block_n=32, min_split_tokens=64)
    counts = torch.zeros(len(seq_lens) * hkv, dtype=torch.int32)
    expected = decode_reference(q, k_pages, v_pages, indptr, indices, last)
    for _ in range(2):
        got = interpreted.decode_attention(shape, q, k_pages, v_pages, indptr, indices, last, counts=counts)
        # tight: an average over hundreds of positions is small, and a merge of missing splits is
        # off by about 1e-2 (bf16's rounding of the output: a few 1e-3)
        torch.testing.assert_close(got.float(), expected, atol=4e-3, rtol=1e-2)
        assert not counts.any()
    assert torch.equal(got[1], torch.zeros_like(got[1])), "a padding row gets zeros"


def test_counters_of_the_wrong_kind_are_refused(merging_in_kernel):
    interpreted = merging_in_kernel
    shape = da.DecodeShape(8, 2, 16, 16, num_splits=2, block_n=32, min_split_tokens=64)
    k_pages, v_pages, indptr, indices, last = random_rows([40, 70], 16, 2, 16, seed=12)
    q = torch.randn(2, 8, 16).to(torch.bfloat16)
    with pytest.raises(ValueError, match="int32 zeros of at least 4"):
        interpreted.decode_attention(shape, q, k_pages, v_pages, indptr, indices, last,
                                     counts=torch.zeros(3, dtype=torch.int32))


def test_the_split_count_fills_the_device_in_powers_of_two():
    assert [da.splits_for(rows, 8, 132) for rows in (1, 4, 8, 16, 33, 64)] == [32, 16, 8, 4, 1, 1]
    assert da.splits_for(1, 2, 132, max_splits=8) == 8


@pytest.mark.parametrize("heads,ok", [((32, 8, 64), True), ((8, 2, 256), True), ((28, 4, 128), True),
                                      ((32, 8, 80), False), ((64, 2, 64), False), ((8, 2, 512), False)])
def test_which_heads_the_kernel_takes(heads, ok):
    assert da.supports(*heads) is ok


def test_a_graph_shape_tiles_16_kib_of_keys():
    llama, qwen = da.graph_shape(32, 8, 64, 16, 64, 132), da.graph_shape(8, 2, 256, 16, 1, 132)
    assert (llama.block_n, llama.num_splits) == (128, 1) and (qwen.block_n, qwen.num_splits) == (32, 32)


def test_the_decode_bench_table_prints_every_row():
    from mstar.runtime.engine.gpu.bench_decode_attention import table

    case = {"triton_us": 4.7, "triton_splits": 32, "flashinfer_tensor_us": 10.0, "floor_us": 0.5,
            "triton_vs_flashinfer": 2.13, "max_abs_diff": 0.001}
    result = {"heads": {"qo": 8, "kv": 2, "dim": 256}, "context": 1024, "page_size": 16, "copy_tb_s": 4.2,
              "device": "H200", "rows": {"1": dict(case, flashinfer_cuda_us=7.7), "64": case}}
    lines = table(result).splitlines()
    assert "8/2 heads x 256" in lines[0] and "1024 positions a row" in lines[0] and len(lines) == 4
    assert lines[2].split()[:3] == ["1", "4.70", "32"] and "7.70" in lines[2] and "2.13x" in lines[2]
    assert lines[3].split()[4] == "-"  # no CUDA-core figure for that row
    # Spread rows and the split what-ifs: the header says so, each what-if its own column.
    result = dict(result, spread=True, rows={"64": dict(case, triton_2_splits_us=4.1)})
    lines = table(result).splitlines()
    assert "256..4096 positions over the rows" in lines[0] and lines[2].endswith("2 splits 4.10")


def test_the_decode_bench_spreads_row_lengths():
    from mstar.runtime.engine.gpu.bench_decode_attention import row_lengths

    assert row_lengths(3, 1024, False) == [1024] * 3 and row_lengths(1, 1024, True) == [1024]
    spread = row_lengths(64, 1024, True)
    assert spread[0] == 256 and spread[-1] == 4096 and spread == sorted(spread) and len(spread) == 64
