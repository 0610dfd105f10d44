"""The glue packer's page-table updates (`GluePacker.host_step`): each slot's entries past what it
has mirrored are sent once, also when several rows of a step share a slot (a prompt the executor
unrolls into decode rows, one per token, all on the request's page table)."""
from pathlib import Path

import numpy as np
import torch

from mstar.plan.io import load_plan
from mstar.runtime.engine.glue_loader import load_plan_glue
from mstar.runtime.engine.gpu import bench
from mstar.runtime.engine.gpu.glue_packing import NUM_ROW_FIELDS, GluePacker
from mstar.runtime.engine.gpu.packing import RowSpec

PLAN_PATH = Path(__file__).resolve().parents[2] / "generated" / "llama_chunked.plan"
PLAN = load_plan(PLAN_PATH, verify=False)
GLUE = bench.bench_glue(load_plan_glue(PLAN_PATH, PLAN), PLAN.nodes[0])
LOOP_WALK = next(w for w in range(len(GLUE.constants.walks)) if GLUE.constants.device_loop_mask >> w & 1)
PAGE = GLUE.constants.page_size
PAGES_PER_SEQ = 64


def _updates(packer: GluePacker, rows: list[RowSpec], padded: int) -> list[tuple[int, int]]:
    step = packer.host_step(GLUE, rows, padded)
    start, num = NUM_ROW_FIELDS * padded, step.num_updates
    start += start % 2  # the int64 indices start on an even word
    indices = step.host[start:start + 2 * num].view(np.int64).tolist()
    return list(zip(indices, step.host[start + 2 * num:start + 3 * num].tolist()))


def test_rows_sharing_a_slot_send_its_table_once():
    # a request with 2 pages' worth cached and a 24-token tail that crosses two page boundaries,
    # unrolled into 24 rows of one slot (row i holds cached + i + 1 tokens)
    table = list(range(40, 40 + 5))
    cached = 2 * PAGE - 3
    rows = [RowSpec([5 + i], cached + i, table, 3, True, LOOP_WALK) for i in range(24)]
    packer = GluePacker(PAGE, 8, PAGES_PER_SEQ, 0, torch.device("cpu"))
    most = -(-(cached + 24) // PAGE)
    assert _updates(packer, rows, 32) == [(3 * PAGES_PER_SEQ + p, table[p]) for p in range(most)]
    assert packer.num_mirrored[3] == most
    # the next step of the same rows sends nothing; a second slot's rows send only their own table
    assert _updates(packer, rows, 32) == []
    other = [RowSpec([9], 2 * PAGE + i, list(range(90, 93)), 5, True, LOOP_WALK) for i in range(2)]
    assert _updates(packer, rows + other, 32) == [(5 * PAGES_PER_SEQ + p, 90 + p) for p in range(3)]


def test_distinct_slots_each_send_their_new_entries():
    packer = GluePacker(PAGE, 8, PAGES_PER_SEQ, 0, torch.device("cpu"))
    rows = [RowSpec(None, PAGE * (1 + slot) - 1, list(range(10 * slot, 10 * slot + 3)), slot, True, LOOP_WALK)
            for slot in (1, 2)]
    # slot 1 holds 2 * PAGE tokens after the step (2 pages), slot 2 3 * PAGE (3 pages)
    assert _updates(packer, rows, 2) == [(PAGES_PER_SEQ, 10), (PAGES_PER_SEQ + 1, 11), (2 * PAGES_PER_SEQ, 20),
                                         (2 * PAGES_PER_SEQ + 1, 21), (2 * PAGES_PER_SEQ + 2, 22)]
    assert np.array_equal(packer.num_mirrored[[1, 2]], [2, 3])
