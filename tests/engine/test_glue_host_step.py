"""The glue packer's host step (`GluePacker.host_step`): the row list, page-table updates and host
tokens it lays out for `pack_step`, FlashInfer's CSR arrays with padding rows as zero-length
segments, and its refusals."""
from pathlib import Path

import numpy as np
import pytest
import torch

from mstar.plan.io import load_plan
from mstar.runtime.engine.glue_loader import load_plan_glue
from mstar.runtime.engine.glue_reference import GlueLaunchError
from mstar.runtime.engine.gpu import bench
from mstar.runtime.engine.gpu.glue_packing import NUM_ROW_FIELDS, GluePacker
from mstar.runtime.engine.gpu.packing import RowSpec

PLAN_PATH = Path(__file__).resolve().parents[2] / "generated" / "llama_chunked.plan"
PLAN = load_plan(PLAN_PATH, verify=False)
GLUE = bench.bench_glue(load_plan_glue(PLAN_PATH, PLAN), PLAN.nodes[0])
WALKS = range(len(GLUE.constants.walks))
LOOP_WALK = next(w for w in WALKS if GLUE.constants.device_loop_mask >> w & 1)
PROMPT_WALK = next(w for w in WALKS if not GLUE.constants.device_loop_mask >> w & 1)
PAGE = GLUE.constants.page_size
PAGES_PER_SEQ = 8


def test_a_mixed_step_is_laid_out_row_by_row_with_padding():
    packer = GluePacker(PAGE, 8, PAGES_PER_SEQ, 0, torch.device("cpu"))
    rows = [RowSpec(None, PAGE, [4, 5], 2, True, LOOP_WALK),  # a decode row: 1 token after PAGE cached
            RowSpec([11, 12, 13], PAGE - 1, [7, 8], 5, False, PROMPT_WALK)]  # 3 tokens cross a page
    step = packer.host_step(GLUE, rows, 4)
    r = 4
    fields = step.host[:NUM_ROW_FIELDS * r].reshape(NUM_ROW_FIELDS, r).tolist()
    assert fields == [[LOOP_WALK, PROMPT_WALK, 0, 0], [1, 3, 0, 0], [PAGE, PAGE - 1, 0, 0], [1, 0, 0, 0],
                      [2, 5, 0, 0], [1, 1, 0, 0], [0, 0, 0, 0]]
    start = NUM_ROW_FIELDS * r  # even: the int64 update indices follow at once
    assert step.num_updates == 4
    assert step.host[start:start + 8].view(np.int64).tolist() == [2 * PAGES_PER_SEQ, 2 * PAGES_PER_SEQ + 1,
                                                                  5 * PAGES_PER_SEQ, 5 * PAGES_PER_SEQ + 1]
    assert step.host[start + 8:start + 12].tolist() == [4, 5, 7, 8]
    assert step.host[start + 12:].tolist() == [0, 11, 12, 13]  # the decode row's one ignored entry first
    assert (step.num_rows, step.padded_batch, step.num_tokens, step.num_pages) == (2, 4, 4, 4)
    assert step.qo_indptr.tolist() == [0, 1, 4, 4, 4]
    assert step.kv_indptr.tolist() == [0, 2, 4, 4, 4]
    assert step.last_page_len.tolist() == [1, 2, 0, 0]
    assert step.seq_lens.tolist() == [PAGE + 1, PAGE + 2, 0, 0]  # what FlashInfer's planner reads as KV lengths
    assert all(t.dtype == torch.int32 for t in (step.qo_indptr, step.kv_indptr, step.last_page_len, step.seq_lens))
    # the mirror now holds both tables: the next step of the same rows sends nothing
    assert packer.host_step(GLUE, rows, 4).num_updates == 0


@pytest.mark.parametrize("row, reason", [
    (RowSpec([1], 0, [0], 1, False, len(GLUE.constants.walks)), "outside the key's walks"),
    (RowSpec([1], 0, [0], 1, False, -1), "outside the key's walks"),
    (RowSpec(None, 3, [0], 1, True, PROMPT_WALK), "does not loop back"),
])
def test_a_row_the_key_cannot_pack_is_refused(row, reason):
    packer = GluePacker(PAGE, 8, PAGES_PER_SEQ, 0, torch.device("cpu"))
    with pytest.raises(GlueLaunchError, match=reason):
        packer.host_step(GLUE, [RowSpec([1], 0, [0], 3, False, PROMPT_WALK), row], 2)
    assert not packer.num_mirrored.any()  # a refused step mirrors nothing


def test_an_odd_row_list_pads_the_update_indices_to_an_even_word():
    packer = GluePacker(PAGE, 8, PAGES_PER_SEQ, 0, torch.device("cpu"))
    step = packer.host_step(GLUE, [RowSpec([3, 4], 0, [9], 1, False, PROMPT_WALK)], 1)
    start = NUM_ROW_FIELDS  # 7 words of row fields, then one of padding
    assert step.host[start] == 0 and step.host[start + 1:start + 3].view(np.int64).tolist() == [PAGES_PER_SEQ]
    assert step.host[start + 3:].tolist() == [9, 3, 4]


def test_a_row_past_a_sequence_s_pages_is_refused():
    packer = GluePacker(PAGE, 8, PAGES_PER_SEQ, 0, torch.device("cpu"))
    with pytest.raises(ValueError, match="pages, past the"):
        packer.host_step(GLUE, [RowSpec(None, PAGE * PAGES_PER_SEQ, list(range(9)), 1, True, LOOP_WALK)], 1)
