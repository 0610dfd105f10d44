"""Chunk steps in columns on a CUDA GPU (skipped without one): the llama_chunked plan at spec dims,
its steps packed by the plan's generated glue, a 64-token step budget that cuts long prompts into
chunks beside decode rows (`bench_kv.with_budget`); the same greedy workload with the runner's
columns on and off (`GpuDecoderRunner.is_columnar`), on a run clock that moves the same way in
both runs, gives after every step the same rows, KV lengths, page tables and pool, every request
the same finish, token count and first token, and the chunk steps took the columns beside the
chunk (the glue packs the steady rows' and the chunk's `RowSpec`s in one step). Both runs run
ahead (the GPU's default): past a chunk step the next chunk is launched ahead beside the decode
rows, and every chunk launched ahead is taken by the step launched for real."""
import dataclasses
import gc
from pathlib import Path
from unittest import mock

import pytest
import torch

from mstar.plan.io import load_plan
from tick_clock import TickClock

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]
GENERATED = Path(__file__).resolve().parents[2] / "generated"


def _run(is_columnar: bool) -> tuple[list[tuple], dict[str, tuple], int, tuple[int, int]]:
    from mstar.runtime.conductor.request import Request
    from mstar.runtime.engine.glue_loader import load_plan_glue
    from mstar.runtime.engine.gpu import runner as runner_module
    from mstar.runtime.engine.torch_engine import TorchEngine
    from mstar.runtime.serve.bench_kv import with_budget
    from mstar.runtime.serve.driver import Driver, Workload

    chunked = load_plan(str(GENERATED / "llama_chunked.plan"))
    plan = with_budget(chunked, 64)
    engine = TorchEngine(plan, dims="spec", device="cuda", num_pages=1024,
                         glue=load_plan_glue(GENERATED / "llama_chunked.plan", chunked))
    runner = engine.runners["LLM"]
    assert isinstance(runner, runner_module.GpuDecoderRunner) and runner.glue is not None
    runner.is_columnar = is_columnar
    label = runner.guidance.first
    trace: list[tuple] = []
    num_chunk_steps = [0]
    wait, start_steady = engine.wait, runner_module.start_steady

    def traced_wait(handle):
        result = wait(handle)
        pool = runner.pool
        trace.append(([(row.request_id, row.is_stop, row.error) for row in result.rows], list(result.allocation_failed),
                      {rid: (pool.num_tokens((rid, label)), pool.page_table((rid, label)))
                       for rid in sorted(engine.requests)}, pool.num_free_pages))
        return result

    def counted(runner, steady, rows, *args, **kwargs):
        num_chunk_steps[0] += any(rows[index][0].is_partial or rows[index][0].chunk_start for index in steady.others)
        return start_steady(runner, steady, rows, *args, **kwargs)

    engine.wait = traced_wait  # type: ignore[method-assign]
    runner_module.start_steady = counted
    requests = [Request(id=f"d{i}", prompt_tokens=[1 + i, 2, 3, 4], max_tokens=40) for i in range(6)]
    requests += [Request(id=f"long{i}", prompt_tokens=[(7 * j + i) % 500 + 1 for j in range(300 + 100 * i)],
                         max_tokens=3) for i in range(2)]
    try:
        clock = TickClock()
        driver = Driver(plan, engine, clock=clock.now)
        with mock.patch("time.sleep", clock.sleep):
            driver.run(Workload([dataclasses.replace(r) for r in requests], closed_concurrency=7))
    finally:
        runner_module.start_steady = start_steady
    records = {rid: (r.finish_reason, r.num_output_tokens, [int(t) for t in list(r.output_tokens)[:1]])
               for rid, r in sorted(driver.conductor.records.items())}
    return trace, records, num_chunk_steps[0], (runner.num_ahead_chunks, runner.num_claimed_chunks)


def test_chunk_steps_in_columns_follow_the_per_row_path_on_the_gpu():
    expected, expected_records, none, expected_ahead = _run(is_columnar=False)
    gc.collect()  # the first engine's weights and pages (an engine and its wrapped wait form a cycle)
    torch.cuda.empty_cache()
    got, records, num_chunk_steps, ahead = _run(is_columnar=True)
    assert none == 0 and num_chunk_steps >= 5
    assert ahead == expected_ahead and ahead[0] >= 1 and ahead[1] == ahead[0]  # chunks ran ahead, all taken
    assert len(got) == len(expected)
    for index, (step_got, step_expected) in enumerate(zip(got, expected)):
        assert step_got == step_expected, f"step {index}"
    assert records == expected_records
    assert all(reason == "length" for reason, _, _ in records.values())
