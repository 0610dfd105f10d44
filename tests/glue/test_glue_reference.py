"""The torch references: worked examples, the FlashInfer layout invariants, launch checks."""
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from mstar.runtime.engine import glue_reference as ref
from mstar.runtime.engine.glue_reference import GlueConstants, GlueLaunchError, PackBuffers, RowInputs, TokenBuffers

CONSTANTS = GlueConstants(key="LLM:mixed", node="LLM", walks=("prefill", "decode"), page_size=4, max_rows=8,
                          device_loop_mask=0b10, stream_mask=0b11, host_mask=0b01, batch_sizes=(1, 2, 4, 8),
                          token_buckets=(1, 2, 4, 8, 16, 32))
NUM_SLOTS, PAGES_PER_SEQ, PAD_SLOT = 6, 8, 2
# Slot s owns pages 10*s + 1, 10*s + 2, ...
PAGE_TABLE = torch.tensor([[10 * s + p + 1 for p in range(PAGES_PER_SEQ)] for s in range(NUM_SLOTS)],
                          dtype=torch.int32)


def _inputs(rows: list[dict], host_tokens: list[int]) -> RowInputs:
    inputs = RowInputs.allocate(CONSTANTS, CONSTANTS.max_tokens, "cpu")
    for i, row in enumerate(rows):
        for name, value in row.items():
            getattr(inputs, name)[i] = value
    inputs.host_tokens[:len(host_tokens)] = torch.tensor(host_tokens)
    return inputs


def _pack(rows, host_tokens, padded_batch, token_bucket, loop_back=None):
    out = PackBuffers.allocate(CONSTANTS, CONSTANTS.max_tokens, CONSTANTS.max_rows * PAGES_PER_SEQ, "cpu")
    loop_back = torch.arange(NUM_SLOTS, dtype=torch.int32) + 500 if loop_back is None else loop_back
    inputs = _inputs(rows, host_tokens)
    num_pages = int(ref.step_offsets(CONSTANTS, inputs.num_tokens[:len(rows)], inputs.context_len[:len(rows)],
                                     padded_batch)[1][-1])
    ref.pack_step(CONSTANTS, len(rows), padded_batch, token_bucket, inputs, PAGE_TABLE, loop_back, out, PAD_SLOT,
                  num_pages)
    return out


def test_pack_worked_example():
    # FlashInfer's own example: old lengths 5, 17, 0 appending 1, 3, 4 tokens, padded to 4 rows
    # and a 16-token bucket. Row 1 is a decode row past its first iteration: its token comes
    # from the loop-back buffer, not from host_tokens.
    rows = [dict(walk_index=0, num_tokens=1, context_len=5, slot=1),
            dict(walk_index=1, num_tokens=3, context_len=17, slot=3, loop_iter=2),
            dict(walk_index=0, num_tokens=4, context_len=0, slot=0)]
    out = _pack(rows, [7, 8, 8, 8, 9, 9, 9, 9], padded_batch=4, token_bucket=16)
    assert out.qo_indptr[:5].tolist() == [0, 1, 4, 8, 8]
    assert out.positions[:16].tolist() == [5, 17, 18, 19, 0, 1, 2, 3] + [0] * 8
    assert out.tokens[:16].tolist() == [7, 503, 503, 503, 9, 9, 9, 9] + [0] * 8
    # pages: 6 tokens -> 2, 20 -> 5, 4 -> 1
    assert out.kv_indptr[:5].tolist() == [0, 2, 7, 8, 8]
    assert out.kv_indices[:8].tolist() == [11, 12, 31, 32, 33, 34, 35, 1]
    assert out.kv_last_page_len[:4].tolist() == [2, 4, 4, 0]
    assert out.logits_index[:4].tolist() == [0, 3, 7, 7]
    # slot = page * 4 + position % 4; padding tokens go to the dummy slot
    assert out.kv_slots[:16].tolist() == [12 * 4 + 1, 35 * 4 + 1, 35 * 4 + 2, 35 * 4 + 3,
                                          1 * 4, 1 * 4 + 1, 1 * 4 + 2, 1 * 4 + 3] + [PAD_SLOT] * 8


def test_step_offsets_are_what_pack_step_writes():
    counts, contexts = torch.tensor([1, 3, 4]), torch.tensor([5, 17, 0])
    qo, kv, last = ref.step_offsets(CONSTANTS, counts, contexts, padded_batch=4)
    assert (qo.tolist(), kv.tolist(), last.tolist()) == ([0, 1, 4, 8, 8], [0, 2, 7, 8, 8], [2, 4, 4, 0])


def test_first_decode_iteration_takes_the_host_token():
    out = _pack([dict(walk_index=1, num_tokens=1, context_len=3, slot=2, loop_iter=0)], [42], 1, 1)
    assert out.tokens[0] == 42


@st.composite
def _steps(draw):
    num_rows = draw(st.integers(0, CONSTANTS.max_rows))
    rows = [dict(walk_index=draw(st.integers(0, 1)), num_tokens=draw(st.integers(0, 4)),
                 context_len=draw(st.integers(0, 16)), slot=draw(st.integers(0, NUM_SLOTS - 1)))
            for _ in range(num_rows)]
    total = sum(r["num_tokens"] for r in rows)
    padded_batch = draw(st.sampled_from([num_rows] + [b for b in CONSTANTS.batch_sizes if b >= num_rows]))
    if padded_batch == num_rows:
        return rows, padded_batch, total + draw(st.integers(0, CONSTANTS.max_tokens - total))
    return rows, padded_batch, draw(st.sampled_from([t for t in CONSTANTS.token_buckets if t >= total]))


@given(_steps())
def test_pack_layout_invariants(step):
    rows, padded_batch, token_bucket = step
    out = _pack(rows, list(range(100, 132)), padded_batch, token_bucket)
    qo, kv = out.qo_indptr[:padded_batch + 1], out.kv_indptr[:padded_batch + 1]
    last = out.kv_last_page_len[:padded_batch]
    assert qo[0] == 0 and kv[0] == 0
    assert bool((qo[1:] >= qo[:-1]).all()) and bool((kv[1:] >= kv[:-1]).all())
    num_pages = kv[1:] - kv[:-1]
    # FlashInfer's get_seq_lens: clamp(pages - 1, 0) * page_size + last
    seq_lens = torch.clamp(num_pages - 1, min=0) * CONSTANTS.page_size + last
    for i, row in enumerate(rows):
        assert int(qo[i + 1] - qo[i]) == row["num_tokens"]
        assert int(seq_lens[i]) == row["context_len"] + row["num_tokens"]
        if num_pages[i] > 0:
            assert 1 <= int(last[i]) <= CONSTANTS.page_size
    # padding rows: zero-length segments with no pages
    assert bool((qo[len(rows) + 1:] == qo[len(rows)]).all()) and bool((num_pages[len(rows):] == 0).all())
    assert bool((last[len(rows):] == 0).all())
    total = int(qo[len(rows)])
    assert bool((out.kv_slots[total:token_bucket] == PAD_SLOT).all())


def test_scatter_sends_tokens_where_the_walk_needs_them():
    rows = [dict(walk_index=0, slot=1, is_emitting=1, stream_pos=0),   # prefill: stream + host
            dict(walk_index=1, slot=2, is_emitting=1, stream_pos=3),   # decode: loop-back + stream
            dict(walk_index=1, slot=3, is_emitting=0, stream_pos=0),   # mid-chunk: nothing
            dict(walk_index=1, slot=4, is_emitting=1, stream_pos=9)]   # stream position past the end
    inputs = _inputs(rows, [])
    buffers = TokenBuffers.allocate(CONSTANTS, NUM_SLOTS, 4, "cpu")
    ref.scatter_after_sampling(CONSTANTS, 4, torch.tensor([11, 22, 33, 44]), inputs, buffers)
    assert buffers.loop_back.tolist() == [0, 0, 22, 0, 44, 0]
    assert buffers.stream_tokens[1].tolist() == [11, 0, 0, 0]
    assert buffers.stream_tokens[2].tolist() == [0, 0, 0, 22]
    assert int(buffers.stream_tokens.count_nonzero()) == 2
    assert buffers.host_out.tolist() == [11, 0, 0, 0, 0, 0, 0, 0]


@pytest.mark.parametrize("num_rows, padded_batch, token_bucket, match", [
    (9, 9, 4, "at most 8"),
    (3, 2, 4, "must lie in"),
    (3, 5, 4, "not a captured batch size"),
    (1, 1, 33, "exceeds the token buffers"),
    (3, 4, 5, "not a captured token count"),
])
def test_pack_launch_checks(num_rows, padded_batch, token_bucket, match):
    out = PackBuffers.allocate(CONSTANTS, CONSTANTS.max_tokens, CONSTANTS.max_rows * PAGES_PER_SEQ, "cpu")
    inputs = RowInputs.allocate(CONSTANTS, CONSTANTS.max_tokens, "cpu")
    with pytest.raises(GlueLaunchError, match=match):
        ref.check_pack_launch(CONSTANTS, num_rows, padded_batch, token_bucket, inputs, PAGE_TABLE, out, 0)


def test_pack_launch_checks_page_buffers():
    out = PackBuffers.allocate(CONSTANTS, CONSTANTS.max_tokens, PAGES_PER_SEQ, "cpu")
    inputs = RowInputs.allocate(CONSTANTS, CONSTANTS.max_tokens, "cpu")
    with pytest.raises(GlueLaunchError, match="kv_indices holds"):
        ref.check_pack_launch(CONSTANTS, 2, 2, 4, inputs, PAGE_TABLE, out, PAGES_PER_SEQ + 1)
    with pytest.raises(GlueLaunchError, match="at most"):
        ref.check_pack_launch(CONSTANTS, 1, 1, 4, inputs, PAGE_TABLE, out, PAGES_PER_SEQ + 1)
    with pytest.raises(GlueLaunchError, match="contiguous rows"):
        ref.check_pack_launch(CONSTANTS, 1, 1, 4, inputs, PAGE_TABLE.t(), out, 1)


def test_pack_launch_takes_a_full_batch_over_a_pool_sized_index_buffer():
    """A captured decode batch of max_rows rows with long page-table rows: kv_indices sized by the
    pool (fewer than rows x pages per sequence) holds the step's real pages, so it launches
    (the check used to compare against rows x pages per sequence and refused it)."""
    table = torch.arange(1, 1 + NUM_SLOTS * 64, dtype=torch.int32).reshape(NUM_SLOTS, 64)
    out = PackBuffers.allocate(CONSTANTS, CONSTANTS.max_tokens, 3 * PAGES_PER_SEQ, "cpu")
    inputs = RowInputs.allocate(CONSTANTS, CONSTANTS.max_tokens, "cpu")
    inputs.num_tokens[:8] = 1
    inputs.context_len[:8] = 5
    inputs.slot[:8] = torch.tensor([0, 1, 2, 3, 4, 5, 0, 1])
    ref.pack_step(CONSTANTS, 8, 8, 8, inputs, table, torch.zeros(NUM_SLOTS, dtype=torch.int32), out, PAD_SLOT, 16)
    assert out.kv_indptr[:9].tolist() == list(range(0, 17, 2))
    with pytest.raises(GlueLaunchError, match="host counted"):
        ref.pack_step(CONSTANTS, 8, 8, 8, inputs, table, torch.zeros(NUM_SLOTS, dtype=torch.int32), out, PAD_SLOT, 15)


def test_reference_refuses_a_row_longer_than_its_page_table():
    with pytest.raises(GlueLaunchError, match="more pages"):
        _pack([dict(walk_index=0, num_tokens=2, context_len=31, slot=0)], [1, 2], 1, 2)


def test_scatter_launch_checks():
    inputs = RowInputs.allocate(CONSTANTS, 4, "cpu")
    buffers = TokenBuffers.allocate(CONSTANTS, NUM_SLOTS, 4, "cpu")
    with pytest.raises(GlueLaunchError, match="sampled tokens"):
        ref.scatter_after_sampling(CONSTANTS, 3, torch.zeros(2, dtype=torch.long), inputs, buffers)
