"""Whole packed graphs' host-side pieces, on the CPU (the graphs themselves are GPU tests:
tests/gpu/test_gpu_piecewise.py): the split route's wrapper arrays derived with device ops inside
the graph equal the host's, and mean what the wrappers need; the plan's packed families become
piecewise and whole families with their routes and keys."""
from pathlib import Path

import numpy as np
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from mstar.plan.io import load_plan
from mstar.runtime.engine.gpu.executor import WholePacked
from mstar.runtime.engine.gpu.packed_graphs import (
    first_plan_counts,
    SplitArrays,
    derive_split_arrays,
    kv_lengths,
    split_host_arrays,
)
from mstar.runtime.engine.gpu.runner import packed_families

PAGE = 16
GENERATED = Path(__file__).resolve().parents[2] / "generated"


@st.composite
def split_steps(draw):
    """(packed qo, kv, last of B rows, decode rows d, the rows' (tokens, cached)): d decode rows of
    one token first, then prompt rows, then zero-length padding rows up to B."""
    num_decode = draw(st.integers(1, 6))
    num_prompts = draw(st.integers(1, 4))
    rows = [(1, draw(st.integers(0, 100))) for _ in range(num_decode)]
    rows += [(draw(st.integers(1, 70)), draw(st.integers(0, 100))) for _ in range(num_prompts)]
    batch = len(rows) + draw(st.integers(0, 5))
    counts = np.array([t for t, _ in rows])
    seq = np.array([t + c for t, c in rows])
    pages = -(-seq // PAGE)
    qo = np.full(batch + 1, counts.sum(), dtype=np.int32)
    qo[:len(rows) + 1] = np.concatenate([[0], np.cumsum(counts)])
    kv = np.full(batch + 1, pages.sum(), dtype=np.int32)
    kv[:len(rows) + 1] = np.concatenate([[0], np.cumsum(pages)])
    last = np.zeros(batch, dtype=np.int32)
    last[:len(rows)] = seq - (pages - 1) * PAGE
    return qo, kv, last, num_decode, rows


@settings(max_examples=200, deadline=None)
@given(split_steps())
def test_the_graph_derives_the_hosts_split_arrays(step):
    qo, kv, last, num_decode, rows = step
    batch = last.shape[0]
    arrays = SplitArrays.zeros(batch, torch.device("cpu"))
    arrays.num_decode.fill_(num_decode)
    mask = derive_split_arrays(torch.from_numpy(qo), torch.from_numpy(kv), torch.from_numpy(last), arrays)
    dec_indptr, dec_last, pre_qo, pre_kv, pre_last = split_host_arrays(qo, kv, last, num_decode)
    for device, host in ((arrays.dec_indptr, dec_indptr), (arrays.dec_last, dec_last), (arrays.pre_qo, pre_qo),
                         (arrays.pre_kv, pre_kv), (arrays.pre_last, pre_last)):
        assert device.tolist() == host.tolist()
    assert mask.flatten().tolist() == [i < num_decode for i in range(batch)]
    # What the wrappers read: the decode wrapper's rows are the decode rows (then empty rows)...
    lengths = [t + c for t, c in rows]
    assert kv_lengths(dec_indptr, dec_last, PAGE).tolist() == lengths[:num_decode] + [0] * (batch - num_decode)
    # ...the prefill wrapper's row 0 holds the decode tokens over one page of KV, its rows 1.. are the
    # prompt rows with their own tokens and KV, the rest empty; every token is some row's.
    assert pre_qo[0] == 0 and pre_qo[1] == num_decode and pre_qo[-1] == qo[-1]
    prompt_tokens = [t for t, _ in rows[num_decode:]]
    empty = [0] * (batch - len(prompt_tokens))  # prefill rows 1..B past the prompt rows
    assert np.diff(pre_qo).tolist()[1:] == prompt_tokens + empty
    pre_lengths = kv_lengths(pre_kv, pre_last, PAGE).tolist()
    assert pre_kv[1] - pre_kv[0] == 1 and 1 <= pre_lengths[0] <= PAGE
    assert pre_lengths[1:] == lengths[num_decode:] + empty


def test_llama_plan_captures_its_mixed_family_whole_on_both_routes():
    """specs/llama.mw: the mixed family whole on both routes, the short prefill steps whole (one
    packed call), the long ones piecewise (the family of the second capture line)."""
    packed = packed_families(load_plan(str(GENERATED / "llama.plan")), "LLM")
    assert packed is not None and packed.names == frozenset({"LLM:prefill#2"})
    mixed, prefill = packed.whole
    assert mixed.name == "LLM:mixed" and mixed.routes == frozenset({"packed", "split"})
    keys = mixed.keys()
    assert (8192, 64, "split") in keys and (128, 1, "packed") in keys
    assert (128, 1, "split") not in keys  # a split step holds a decode row and a prompt row
    assert prefill.name == "LLM:prefill" and prefill.routes == frozenset({"packed"})
    assert {(tokens, batch) for tokens, batch, _ in prefill.keys()} == {
        (tokens, batch) for tokens in (32, 64, 128, 256, 384, 512) for batch in (1, 2, 4)}


def test_whole_keys_hold_a_token_a_row():
    family = WholePacked("F", (0, 1, 4, 4, 4), (1, 4), (2, 8), frozenset({"packed"}))
    assert family.keys() == [(2, 1, "packed"), (8, 1, "packed"), (8, 4, "packed")]


@given(st.integers(1, 64), st.integers(0, 20000), st.integers(1, 20000))
def test_first_plan_keeps_each_row_within_its_page_table(rows, extra, max_row_tokens):
    """A key's first plan fills its token bucket with rows no longer than a row may be (a node
    whose max_seq_len is below its largest bucket failed at capture: FlashInfer's "length of
    paged_kv_indices exceeds the allocated buffer size")."""
    tokens = rows + extra
    counts = first_plan_counts(tokens, rows, max_row_tokens)
    assert counts.shape == (rows,) and counts.min() >= 1 and counts.max() <= max(1, max_row_tokens)
    assert counts.sum() == min(tokens, rows * max(1, max_row_tokens))
    if tokens <= max_row_tokens + rows - 1:  # the longest row the bucket allows, the others one token
        assert counts[0] == tokens - (rows - 1) and (counts[1:] == 1).all()
