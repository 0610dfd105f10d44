"""The generated glue's launch checks accept every batch shape the scheduler makes for each
checked-in plan, with the buffers the GPU executor gives them (gpu/executor.py, glue_packing.py).

For each kv key's mixtures, steps of 1..cap rows (decode rows, and a prompt row beside them) land
where the scheduler puts them (`plan.buckets.pick_smallest`): a batched family's padded batch (the
decode graph: tokens = padded batch, its inputs and the wrapper's pool-sized index buffer), a
packed family's token bucket (the piecewise graphs: the real rows, the bucket's tokens; and the
step contract's padded batch beside it) or eager (the rows and their tokens). The page table is
the mirror's: one row a slot, `ceil(max_seq_len / page_size)` pages each; the rows' contexts fill
the KV pool, or every row holds as many pages as a sequence may (a prefix cache shares them, so
their sum passes the pool's pages). (The check used to bound kv_indices by rows x pages per
sequence, which refused full decode batches over a pool-sized index buffer; that buffer then
held the pool's pages plus the batch, short of rows sharing a prefix.)
"""
from __future__ import annotations

import pytest
import torch

from glue_modules import checked_in_glue, generated_glue_files
from mstar.plan.buckets import pick_smallest
from mstar.plan.io import load_plan
from mstar.runtime.engine import glue_reference as ref
from mstar.runtime.engine.gpu.packing import max_row_pages

ROW_COUNTS = (1, 2, 3, 7, 16, 33, 63, 64, 100, 128, 256)


def _cases(plan, module):
    pools = {pool.node: pool for pool in plan.deployment.kv_pools}
    for worker in plan.workers:
        for key in worker.keys:
            key_glue = module.GLUE_BY_WORKER.get(worker.rank, {}).get(key.name)
            if key_glue is None:
                continue
            families = {f.name: f for f in key.captures}
            for entry in key.mixtures:
                if not entry or not entry.cap:
                    continue
                names = ([entry.capture] if entry.capture else []) + list(entry.also_captures)
                for num_rows in sorted({min(n, entry.cap) for n in ROW_COUNTS}):
                    for tokens in ([1] * num_rows, [512] + [1] * (num_rows - 1)):
                        pick = pick_smallest(tuple(families[n] for n in names), num_rows, tokens)
                        yield key_glue, pools[key.node], pick, families.get(pick.capture), tokens


def _launch_shapes(pick, family, tokens):
    """(padded batch, token bucket, is a decode graph) of each launch the executor makes for the step."""
    num_rows, total = len(tokens), sum(tokens)
    if family is not None and family.kind == "batched":
        return [(pick.padded_batch, pick.padded_batch * family.tokens_per_row, True)]
    if family is not None:
        return [(num_rows, pick.token_bucket, False), (pick.padded_batch, pick.token_bucket, False)]
    return [(num_rows, total, False)]


@pytest.mark.parametrize("path", generated_glue_files(), ids=lambda p: p.name)
def test_glue_accepts_the_scheduler_batches_of_the_plan(path):
    plan = load_plan(path.with_name(path.name.replace("_glue.py", ".plan")), verify=False)
    module = checked_in_glue(path)
    num_checked = 0
    for key_glue, pool, pick, family, tokens in _cases(plan, module):
        constants, page_size = key_glue.constants, pool.page_size
        pages_per_seq = -(-pool.max_seq_len // page_size)
        table = torch.empty(pool.num_pages + 1, pages_per_seq, dtype=torch.int32)
        # Contexts that fill the pool between the rows (at most a sequence each), or rows on one
        # shared prefix holding every page a row may.
        budget = min(pool.num_pages // len(tokens), pages_per_seq)
        row_pages = max_row_pages(pool.max_seq_len, page_size, pool.num_pages)
        for num_pages in (sum(max(budget, -(-t // page_size)) for t in tokens), len(tokens) * row_pages):
            if num_pages > len(tokens) * row_pages:
                continue  # more tokens than the pool holds: the admission policy holds such a step
            for padded_batch, bucket, is_graph in _launch_shapes(pick, family, tokens):
                # The executor's buffers: a decode bucket's indices hold rows x a row's most pages.
                index_capacity = padded_batch * row_pages if is_graph else num_pages
                out = ref.PackBuffers.allocate(constants, bucket, index_capacity, "cpu")
                inputs = ref.RowInputs.allocate(constants, max(bucket, sum(tokens)), "cpu")
                ref.check_pack_launch(constants, len(tokens), padded_batch, bucket, inputs, table, out, num_pages)
                num_checked += 1
    assert num_checked or not any(pool for pool in plan.deployment.kv_pools), path.name
