"""The fast path's admission shortcut (gpu/runner.py `_admit`): rows of started requests that need
no page and no slot skip the admission policy. Every call is checked against the base runner's
admission over all the rows, run on copies of the pool and the policy: the same rows run, the same
rows are short, and the pool and the policy end in the same state. Under memory pressure, with the
prefix cache, run-ahead on and off."""
from __future__ import annotations

import copy
from pathlib import Path

import pytest

from mstar.plan.io import load_plan
from mstar.runtime.conductor.request import Request
from mstar.runtime.engine.gpu.runner import GpuDecoderRunner
from mstar.runtime.engine.runners.decoder import DecoderRunner
from mstar.runtime.engine.torch_engine import TorchEngine
from mstar.runtime.serve.driver import Driver, Workload
from fast_path_cpu import fast_path_engine

PLAN = Path(__file__).resolve().parents[2] / "generated" / "llama_chunked.plan"  # prefix cache: pages


def _engine(can_run_ahead: bool, num_pages: int) -> tuple[TorchEngine, GpuDecoderRunner]:
    return fast_path_engine(load_plan(PLAN, verify=False), num_pages, max_seq_len=4096, can_run_ahead=can_run_ahead,
                            prefix_cache=True)


def _state(runner: GpuDecoderRunner, ready: list) -> tuple:
    admission, pool, label = runner.admission, runner.pool, runner.guidance.first
    tables = {item.row.request_id: (pool.num_tokens((item.row.request_id, label)),
                                    pool.page_table((item.row.request_id, label))) for item in ready}
    return dict(admission.budgets), dict(admission.held), admission.num_outstanding, pool.num_free_pages, tables


def _check_against_the_base(runner: GpuDecoderRunner) -> dict[str, int]:
    """Wrap the runner's `_admit` so each call is compared with the base's on copies."""
    fast, label = runner._admit, runner.guidance.first
    seen = {"calls": 0, "rows": 0, "no_need_rows": 0, "short_rows": 0}

    def admit(ready, on_host, is_partial_ok):
        seen["calls"] += 1
        seen["rows"] += len(ready)
        seen["no_need_rows"] += sum(runner.admission.is_started(item.row.request_id)
                                    and runner.pool.has_room((item.row.request_id, label), len(item.tokens_fed))
                                    for item in ready)
        pool, admission = runner.pool, runner.admission
        runner.pool, runner.admission = copy.deepcopy(pool), copy.deepcopy(admission)
        try:
            expected, expected_failed = DecoderRunner._admit(runner, ready, on_host, is_partial_ok)
            expected_state = _state(runner, ready)
        finally:
            runner.pool, runner.admission = pool, admission
        got, failed = fast(ready, on_host, is_partial_ok)
        assert [id(item) for item in got] == [id(item) for item in expected]
        assert failed == expected_failed
        assert _state(runner, ready) == expected_state
        seen["short_rows"] += len(failed)
        return got, failed

    runner._admit = admit  # type: ignore[method-assign]
    return seen


def _requests(num: int) -> list[Request]:
    # A shared 32-token prefix (two cached pages), then a few tokens of each request's own;
    # outputs long enough to cross page boundaries while decoding. r0, whose prefix pages are
    # the cached ones, decodes longest: the later requests claim them while r0 holds them (a
    # newcomer takes no free cached page while older requests wait to start, kv/admission.py).
    shared = [(5 * j) % 97 + 1 for j in range(32)]
    return [Request(id=f"r{i}", prompt_tokens=shared + [i + 1] * (1 + i % 5),
                    max_tokens=40 if i == 0 else 6 + (7 * i) % 23,
                    temperature=0.8 if i % 4 == 1 else None, seed=i) for i in range(num)]


@pytest.mark.parametrize("can_run_ahead", [True, False])
def test_the_shortcut_admits_as_the_policy_does_under_pressure(can_run_ahead):
    engine, runner = _engine(can_run_ahead, num_pages=14)
    seen = _check_against_the_base(runner)
    driver = Driver(engine.plan, engine)
    driver.run(Workload(_requests(12), closed_concurrency=8))
    records = driver.conductor.records
    assert all(r.finish_reason in ("stop", "length") for r in records.values())
    assert seen["no_need_rows"] > 0 and seen["rows"] > seen["no_need_rows"]  # both kinds of rows
    assert seen["short_rows"] > 0  # the pool ran short: rows were held
    assert runner.pool.cache is not None and runner.pool.cache.num_hits > 0
    assert runner.admission.num_outstanding == 0 and not runner.admission.budgets
    assert not runner.admission.waiting and runner.admission.num_reserved == 0
