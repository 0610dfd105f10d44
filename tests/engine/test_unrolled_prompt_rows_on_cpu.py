"""The GPU fast path's unrolled prompt rows (`StepExecutor._unrolled`, the plan's `unroll_prompts`)
on the CPU in fp32: a step of short prompt rows replays the decode graph (a CPU stand-in that runs
exactly from the graph's buffers, graph_standins.py) with one row per query token, and gives the
same tokens, device token table and KV writes as the same step run as prompt rows (eager, one
causal prefill call); steps that do not qualify are left as they are."""
import sys
from pathlib import Path

import pytest
import torch

from engine_plans import LLM_DIMS, llm_plan
from graph_standins import CpuAttention, CpuDecodeGraphs
from mstar.plan.dims import decoder_dims
from mstar.runtime.engine.gpu.device_model import build_decoder
from mstar.runtime.engine.gpu.executor import StepExecutor
from mstar.runtime.engine.gpu.forward import DecoderForward, PagedKv
from mstar.runtime.engine.gpu.packing import RowSpec

sys.path.insert(0, str(Path(__file__).parent))
BATCH_PAD = [0, 1, 2, 4, 4] + [8] * 4 + [16] * 8  # decode graphs of 1, 2, 4, 8 and 16 rows
NUM_PAGES = 64


def _executor(unroll_prompts: int) -> StepExecutor:
    """An executor over a fresh copy of one model and KV cache (seeded), with stand-in decode graphs."""
    dims = decoder_dims(llm_plan(dict(LLM_DIMS)).nodes[0], "spec")
    device = torch.device("cpu")
    model = build_decoder(dims, device, torch.float32, position=0, seed=0)
    kv = PagedKv(dims.num_full_layers, NUM_PAGES, 16, dims.num_kv_heads, dims.head_dim, torch.float32, device)
    torch.manual_seed(1)
    kv.data.normal_()
    executor = StepExecutor(DecoderForward(model, dims, kv, 4097), kv, device, NUM_PAGES + 1, BATCH_PAD,
                            unroll_prompts=unroll_prompts)
    sizes = sorted({b for b in BATCH_PAD if b})
    executor.attention = CpuAttention(sizes, executor.max_row_pages, 16, dims.head_dim ** -0.5)
    executor.graphs = CpuDecodeGraphs(executor, executor.attention, sizes)
    return executor


def _run(executor: StepExecutor, steps: list[list[RowSpec]]) -> list[list[int]]:
    return [executor.collect(executor.launch(rows)).tolist() for rows in steps]


PROMPTS = [[3 + (7 * i) % 50 for i in range(37)], [9 + (5 * i) % 40 for i in range(20)]]
TABLES = [list(range(1, 8)), list(range(10, 14)), list(range(20, 24))]


def _steps(tail: int) -> list[list[RowSpec]]:
    """Two prompts prefilled (not unrollable: too long), a decode step of both, then a step with
    a third request's short prompt beside their decode rows (request 0's token from the host,
    request 1's from the device token table), then request 0's prompt tail after its cached tokens."""
    a, b = PROMPTS
    return [
        [RowSpec(a, 0, TABLES[0], 1), RowSpec(b, 0, TABLES[1], 2)],
        [RowSpec([11], len(a), TABLES[0], 1, True), RowSpec(None, len(b), TABLES[1], 2, True)],
        [RowSpec([12], len(a) + 1, TABLES[0], 1, True), RowSpec([4, 5, 6, 7, 8], 0, TABLES[2], 3),
         RowSpec(None, len(b) + 1, TABLES[1], 2, True)],
        [RowSpec([21 + i for i in range(tail)], len(a) + 2, TABLES[0], 1)],
    ]


@pytest.mark.parametrize("tail", [2, 6])
def test_unrolled_prompt_rows_give_the_tokens_and_kv_of_the_prompt_rows(tail):
    unrolled, whole = _executor(unroll_prompts=6), _executor(unroll_prompts=0)
    got, expected = _run(unrolled, _steps(tail)), _run(whole, _steps(tail))
    assert got == expected
    assert unrolled.num_unrolled_steps == 2 and whole.num_unrolled_steps == 0  # steps 3 and 4
    assert unrolled.num_graph_steps == whole.num_graph_steps + 2
    torch.testing.assert_close(unrolled.loop_tokens, whole.loop_tokens, rtol=0, atol=0)
    # every position the steps wrote, in every layer: the same K/V
    for table, length in ((TABLES[0], len(PROMPTS[0]) + 2 + tail), (TABLES[1], len(PROMPTS[1]) + 2),
                          (TABLES[2], 5)):
        pages = torch.tensor([table[p // 16] for p in range(length)])
        offsets = torch.arange(length) % 16
        # data: [layer, K/V, page, offset, head, dim]
        torch.testing.assert_close(unrolled.kv.data[:, :, pages, offsets], whole.kv.data[:, :, pages, offsets],
                                   rtol=1e-5, atol=1e-5)


def test_a_step_past_the_limit_or_the_largest_batch_is_not_unrolled():
    executor = _executor(unroll_prompts=6)
    long_tail = [RowSpec(list(range(3, 10)), 0, TABLES[0], 1)]  # 7 tokens: past unroll_prompts
    assert executor._unrolled(long_tail) is None
    many = [RowSpec([3, 4, 5, 6], 0, [i], i + 1) for i in range(4)] + [RowSpec(None, 3, [9], 9, True)]
    assert executor._unrolled(many) is None  # 17 rows: past the largest decode graph (16)
    assert executor._unrolled([RowSpec(None, 3, [9], 9, True)]) is None  # no prompt row
    executor.batch_pad = BATCH_PAD + [0] * 8  # a family whose cap runs past its largest batch (eager_above)
    assert executor._unrolled([RowSpec(list(range(3, 9)), 0, [1], 1)] * 3) is None  # 18 rows: eager, not unrolled
    executor.batch_pad = BATCH_PAD
    rows = executor._unrolled([RowSpec(None, 3, [9], 9, True), RowSpec([7, 8, 9], 16, [1, 2], 1)])
    assert [(r.token_ids, r.num_cached, r.row_slot) for r in rows] == [
        (None, 3, 9), ([9], 18, 1), ([7], 16, 1), ([8], 17, 1)]


def test_a_hybrid_decoders_executor_never_unrolls():
    from engine_plans import hybrid_plan
    from mstar.runtime.engine.models.gdn import LinearStates

    dims = decoder_dims(hybrid_plan().nodes[0], "spec")
    model = build_decoder(dims, torch.device("cpu"), torch.float32, position=0, seed=0)
    kv = PagedKv(dims.num_full_layers, 8, 16, dims.num_kv_heads, dims.head_dim, torch.float32, torch.device("cpu"))
    states = LinearStates.for_dims(dims, 4, torch.device("cpu"))
    executor = StepExecutor(DecoderForward(model, dims, kv, 257, states), kv, torch.device("cpu"), 9, BATCH_PAD,
                            unroll_prompts=6)
    assert executor.unroll_prompts == 0
