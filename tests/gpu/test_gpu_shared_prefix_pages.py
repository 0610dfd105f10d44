"""Decode graphs over rows that share prefix pages, on a CUDA GPU (skipped without one): a prefix
cache lets rows index the same pages, so a decode step's page indices (the sum of its rows' page
tables) pass the pool's pages; the decode wrapper's index buffer holds the bucket's rows x a row's
most pages (`packing.max_row_pages`), so FlashInfer's graph-mode decode takes the step, packed by
the generated glue and by numpy alike (before: the glue refused it, the numpy copy failed)."""
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import test_glue_step_path_gpu as gpu_steps  # noqa: E402

from mstar.runtime.engine.gpu.packing import RowSpec  # noqa: E402

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]
NUM_POOL_PAGES, NUM_SHARED, NUM_ROWS = 48, 40, 8  # 8 rows x (40 shared + 1 own) = 328 indices


def _rows(step: int) -> list[RowSpec]:
    shared = list(range(NUM_SHARED))
    return [RowSpec([5 + row + step], NUM_SHARED * 16 + 3 + step, shared + [NUM_SHARED + row], row + 1, True,
                    gpu_steps.DECODE) for row in range(NUM_ROWS)]


def test_a_decode_graph_step_indexes_more_pages_than_the_pool_holds():
    glue_executor, numpy_executor = gpu_steps._executors(num_pages=NUM_POOL_PAGES)
    assert NUM_ROWS * (NUM_SHARED + 1) > NUM_POOL_PAGES + NUM_ROWS  # past the old pool + largest batch bound
    start = glue_executor.kv.data.clone()
    runs = []
    for executor, glue in ((glue_executor, gpu_steps._glue()), (numpy_executor, None)):
        executor.kv.data.copy_(start)
        runs.append([executor.collect(executor.launch(_rows(step), None, None, 0, "packed", glue)).tolist()
                     for step in range(3)])
        assert executor.num_graph_steps == 3
    assert runs[0] == runs[1]
