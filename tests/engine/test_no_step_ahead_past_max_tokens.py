"""A row whose step makes its request's last token (max_tokens) is not continued by the speculated
step N+1: one request at a time (the prefix scenario of `mstar bench kv`), the GPU runner on the
CPU with run-ahead on launches no step ahead that nobody claims. Before, every such request's last
decode step was followed by a decode step launched ahead for nothing, which the next request's
first step waited behind on a GPU."""
from __future__ import annotations

from pathlib import Path

import pytest

from mstar.plan.io import load_plan
from mstar.runtime.conductor.request import Request
from mstar.runtime.engine.gpu.runner import GpuDecoderRunner
from mstar.runtime.engine.torch_engine import TorchEngine
from mstar.runtime.serve.driver import Driver, Workload
from fast_path_cpu import fast_path_engine

PLAN = load_plan(Path(__file__).resolve().parents[2] / "generated" / "llama_chunked.plan", verify=False)


def _engine() -> tuple[TorchEngine, GpuDecoderRunner]:
    return fast_path_engine(PLAN, 256, prefix_cache=True, can_run_ahead=True)


@pytest.mark.parametrize("max_tokens", [2, 3, 6])
def test_one_request_at_a_time_launches_nothing_ahead_for_nothing(max_tokens):
    engine, runner = _engine()
    prefix = [(7 * i) % 500 for i in range(64)]
    requests = [Request(id=f"p{i}", prompt_tokens=prefix + [(11 * i + j) % 500 for j in range(5)],
                        max_tokens=max_tokens) for i in range(4)]
    driver = Driver(PLAN, engine)
    driver.run(Workload(requests, closed_concurrency=1))
    records = driver.conductor.records
    assert all(r.finish_reason == "length" and r.num_output_tokens == max_tokens for r in records.values())
    # each request's decode steps after its first are launched ahead and claimed; none past its last
    assert runner.num_ahead_rows == runner.num_claimed_rows == 4 * (max_tokens - 2)


def test_rows_laned_and_not_stop_their_chain_at_max_tokens():
    """Many rows with mixed max_tokens (laned rows and rows outside lanes in one step): every row
    launched ahead is claimed, and every request gets exactly its max_tokens."""
    engine, runner = _engine()
    requests = [Request(id=f"r{i}", prompt_tokens=[1 + i, 2, 3], max_tokens=2 + i % 5) for i in range(12)]
    driver = Driver(PLAN, engine)
    driver.run(Workload(requests, closed_concurrency=6))
    records = driver.conductor.records
    assert [records[f"r{i}"].num_output_tokens for i in range(12)] == [2 + i % 5 for i in range(12)]
    assert runner.num_ahead_rows == runner.num_claimed_rows > 0
