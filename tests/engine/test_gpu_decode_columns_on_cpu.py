"""The GPU runner's columnar decode step (gpu/decode_columns.py) against its per-row path, on the CPU
in fp32 with the real step executor (numpy packing, torch attention): the same workload through two
engines, one with `is_columnar` off, gives after every step the same results and token columns,
KV lengths, page tables, device token table, request state (histories, counts, last tokens), pool
and admission state; the columnar run takes the columnar path for most of its decode steps. Random
finishes (max_tokens, stop tokens, seeded temperature), memory pressure (rows held, the admission
policy's slow case), the prefix cache, run-ahead on and off."""
from __future__ import annotations

import dataclasses
from pathlib import Path
from unittest import mock

import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st

from mstar.plan.io import load_plan
from mstar.runtime.conductor.request import Request
from mstar.runtime.engine.gpu import runner as runner_module
from mstar.runtime.engine.gpu.device_model import build_decoder
from mstar.runtime.engine.gpu.runner import GpuDecoderRunner, decode_family
from mstar.runtime.engine.placement import CPU
from mstar.runtime.engine.torch_engine import TorchEngine
from mstar.runtime.serve.driver import Driver, Workload

GENERATED = Path(__file__).resolve().parents[2] / "generated"
PLANS = {False: load_plan(GENERATED / "llama.plan", verify=False),
         True: load_plan(GENERATED / "llama_chunked.plan", verify=False)}  # the second caches prefixes


def _engine(is_columnar: bool, can_run_ahead: bool, num_pages: int, prefix_cache: bool
            ) -> tuple[TorchEngine, GpuDecoderRunner]:
    plan = PLANS[prefix_cache]
    engine = TorchEngine(plan, num_pages=num_pages)
    name = plan.nodes[0].name
    reference = engine.runners[name]
    model = build_decoder(reference.dims, torch.device("cpu"), torch.float32, position=0, seed=0)
    runner = GpuDecoderRunner(plan.nodes[0], reference.dims, model, reference.pool.page_size, num_pages,
                              reference.max_seq_len, 0, CPU, decode_family(plan, name), is_flashinfer=False,
                              prefix_cache=prefix_cache, can_run_ahead=can_run_ahead)
    runner.is_columnar = is_columnar
    engine.runners[name] = runner
    engine.caps = dataclasses.replace(engine.caps, can_launch_ahead=can_run_ahead)
    return engine, runner


def _snapshot(engine: TorchEngine, runner: GpuDecoderRunner, result) -> tuple:
    pool, label = runner.pool, runner.guidance.first
    requests = {rid: (pool.num_tokens((rid, label)), pool.page_table((rid, label)), dict(state.history),
                      dict(state.num_sampled), dict(state.last_token))
                for rid, state in sorted(engine.requests.items())}
    rows = [(row.request_id, {name: list(value) if isinstance(value, list) else value.tolist()
                              for name, value in row.outputs.items()}, row.is_stop, row.error)
            for row in result.rows]
    token_ids = None if result.token_ids is None else np.asarray(result.token_ids).tolist()
    return (rows, token_ids, list(result.stop_rows), list(result.allocation_failed), requests,
            pool.num_free_pages, dict(runner.admission.budgets), dict(runner.admission.held),
            runner.admission.num_outstanding, runner.executor.loop_tokens.tolist(), dict(runner._row_slots),
            runner.num_ahead_rows, runner.num_claimed_rows)


class _Clock:
    """A run clock that moves the same way in both runs (a tick a read; an idle wait jumps it), so
    the two runs schedule the same steps."""

    def __init__(self) -> None:
        self.time = 0.0

    def now(self) -> float:
        self.time += 1e-5
        return self.time

    def sleep(self, seconds: float) -> None:
        self.time += max(seconds, 0.0)


def _run(requests: list[Request], concurrency: int, is_columnar: bool, can_run_ahead: bool, num_pages: int,
         prefix_cache: bool) -> tuple[list[tuple], dict[str, tuple], int]:
    """Every step's snapshot, each request's finish and outputs, and the steps taken in columns."""
    engine, runner = _engine(is_columnar, can_run_ahead, num_pages, prefix_cache)
    trace: list[tuple] = []
    num_steady = [0]
    wait, start_steady = engine.wait, runner_module.start_steady

    def traced_wait(handle):
        result = wait(handle)
        trace.append(_snapshot(engine, runner, result))
        return result

    def counted(*args, **kwargs):
        num_steady[0] += 1
        return start_steady(*args, **kwargs)

    engine.wait = traced_wait  # type: ignore[method-assign]
    runner_module.start_steady = counted
    try:
        clock = _Clock()
        driver = Driver(engine.plan, engine, clock=clock.now)
        with mock.patch("time.sleep", clock.sleep):  # the run loop's idle waits move the clock, at once
            driver.run(Workload([dataclasses.replace(r) for r in requests], closed_concurrency=concurrency))
    finally:
        runner_module.start_steady = start_steady
    records = {rid: (record.finish_reason, [np.asarray(t).tolist() for t in record.output_tokens])
               for rid, record in sorted(driver.conductor.records.items())}
    return trace, records, num_steady[0]


def _requests(lengths: list[tuple[int, int]], stops: list[int], temperatures: list[bool]) -> list[Request]:
    return [Request(id=f"r{i}", prompt_tokens=[(5 * j) % 97 + 1 for j in range(24)][:prompt] + [i + 1],
                    max_tokens=max_tokens, stop_tokens=stops if i % 2 else [],
                    temperature=0.9 if temperatures[i % len(temperatures)] else None, seed=i)
            for i, (prompt, max_tokens) in enumerate(lengths)]


def _compare(requests, concurrency, can_run_ahead, num_pages, prefix_cache) -> int:
    expected, expected_records, none = _run(requests, concurrency, False, can_run_ahead, num_pages, prefix_cache)
    got, records, num_steady = _run(requests, concurrency, True, can_run_ahead, num_pages, prefix_cache)
    assert none == 0
    for index, (step_got, step_expected) in enumerate(zip(got, expected)):
        assert step_got == step_expected, f"step {index}"
    assert len(got) == len(expected)
    assert records == expected_records
    assert all(reason in ("stop", "length") for reason, _ in records.values())
    return num_steady


@pytest.mark.parametrize("can_run_ahead", [True, False])
@pytest.mark.parametrize("prefix_cache", [False, True])
def test_columns_follow_the_per_row_path(can_run_ahead, prefix_cache):
    requests = _requests([(4 + (7 * i) % 20, 5 + (11 * i) % 30) for i in range(10)], stops=list(range(0, 512, 9)),
                         temperatures=[False, True])
    num_steady = _compare(requests, 6, can_run_ahead, 512, prefix_cache)
    assert num_steady > 10  # most decode steps ran in columns


@pytest.mark.parametrize("can_run_ahead", [True, False])
def test_columns_under_memory_pressure(can_run_ahead):
    # 12 pages of 16 tokens for 8 concurrent requests of up to 60 tokens: rows are held, and the
    # pool's free pages often fall short of what started requests may claim (the per-row case)
    requests = _requests([(8 + (5 * i) % 16, 10 + (13 * i) % 28) for i in range(12)], stops=[],
                         temperatures=[False])
    assert _compare(requests, 8, can_run_ahead, 12, prefix_cache=True) > 0


@settings(max_examples=6)
@given(lengths=st.lists(st.tuples(st.integers(1, 24), st.integers(1, 40)), min_size=1, max_size=9),
       concurrency=st.integers(1, 8), stops=st.lists(st.integers(0, 511), max_size=40),
       temperatures=st.lists(st.booleans(), min_size=1, max_size=3), can_run_ahead=st.booleans(),
       prefix_cache=st.booleans(), num_pages=st.sampled_from([8, 16, 256]))
def test_columns_follow_the_per_row_path_on_random_workloads(lengths, concurrency, stops, temperatures,
                                                             can_run_ahead, prefix_cache, num_pages):
    _compare(_requests(lengths, stops, temperatures), concurrency, can_run_ahead, num_pages, prefix_cache)


def test_page_boundary_rows_are_granted_in_one_pass_with_the_per_row_outcome(monkeypatch):
    """Without run ahead every row crosses its page boundaries in the step itself: those rows'
    pages are granted in one pass (`_grant_one_page_each`), and the run still equals the per-row
    path's step by step (`_compare`)."""
    from mstar.runtime.engine.gpu import decode_columns

    bulk, granted = decode_columns._grant_one_page_each, [0]

    def counted(runner, request_ids):
        is_done = bulk(runner, request_ids)
        granted[0] += len(request_ids) if is_done else 0
        return is_done

    monkeypatch.setattr(decode_columns, "_grant_one_page_each", counted)
    requests = _requests([(14 + i % 3, 30) for i in range(6)], stops=[], temperatures=[False])
    _compare(requests, 6, False, 512, prefix_cache=False)
    assert granted[0] >= 6  # every request crossed a page boundary in a steady step


def test_a_request_at_its_page_budget_goes_through_the_policy_row_by_row():
    from mstar.runtime.engine.gpu.decode_columns import _grant_one_page_each

    _, runner = _engine(True, False, 64, False)
    admission, pool = runner.admission, runner.pool
    admission.budgets.update({"a": 3, "b": 2})
    admission.held.update({"a": 1, "b": 2})  # b holds its whole budget: the policy must decide
    admission.num_outstanding = 2
    free = pool.num_free_pages
    assert not _grant_one_page_each(runner, ["a", "b"])
    assert (admission.held, admission.num_outstanding, pool.num_free_pages) == ({"a": 1, "b": 2}, 2, free)
    assert _grant_one_page_each(runner, ["a"])
    assert (admission.held["a"], admission.num_outstanding, pool.num_free_pages) == (2, 1, free - 1)
