"""The GPU runner's columnar decode step (gpu/decode_columns.py) against its per-row path, on the CPU
in fp32 with the real step executor (numpy packing, torch attention): the same workload through two
engines, one with `is_columnar` off, gives after every step the same results and token columns,
KV lengths, page tables, device token table, request state (histories, counts, last tokens), pool
and admission state; the columnar run takes the columnar path for most of its decode steps. Random
finishes (max_tokens, stop tokens, seeded temperature), memory pressure (rows held, the admission
policy's slow case), the prefix cache, run-ahead on and off; chunk steps (a small step token budget
cuts long prompts, whose chunks run beside decode rows: the decode rows in columns, the chunks per
row, in one step); past a chunk step the next chunk launched ahead beside the decode rows, against
the same run without running ahead."""
from __future__ import annotations

import dataclasses
from pathlib import Path
from unittest import mock

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from mstar.plan.io import load_plan
from mstar.runtime.conductor.request import Request
from mstar.runtime.engine.gpu import runner as runner_module
from mstar.runtime.engine.gpu.runner import GpuDecoderRunner
from mstar.runtime.engine.kv.slots import node_slot_pool
from mstar.runtime.engine.torch_engine import TorchEngine
from mstar.runtime.serve.bench_kv import with_budget
from mstar.runtime.serve.driver import Driver, Workload
from fast_path_cpu import fast_path_engine
from engine_plans import chunked_plan
from tick_clock import TickClock

GENERATED = Path(__file__).resolve().parents[2] / "generated"
PLANS = {False: load_plan(GENERATED / "llama.plan", verify=False),
         True: load_plan(GENERATED / "llama_chunked.plan", verify=False)}  # the second caches prefixes
HYBRID = load_plan(GENERATED / "qwen3_5.plan", verify=False)  # gated delta-net layers: state slots


def _engine(is_columnar: bool, can_run_ahead: bool, num_pages: int, prefix_cache: bool, budget: int = 0,
            hybrid: bool = False) -> tuple[TorchEngine, GpuDecoderRunner]:
    """budget: a step token budget (and chunk size) that cuts long prompts (the chunked plan's).
    hybrid: the qwen3_5 plan (its rows' row slots are their recurrent state slots; no prefix cache)."""
    if hybrid:
        plan = chunked_plan(HYBRID, "prefill_text", budget)
    else:
        plan = with_budget(PLANS[True], budget) if budget else PLANS[prefix_cache]
    engine, runner = fast_path_engine(plan, num_pages, prefix_cache=prefix_cache, can_run_ahead=can_run_ahead,
                                      slots=node_slot_pool(plan.nodes[0].name, 12, None) if hybrid else None)
    runner.is_columnar = is_columnar
    return engine, runner


def _snapshot(engine: TorchEngine, runner: GpuDecoderRunner, result) -> tuple:
    pool, label = runner.pool, runner.guidance.first
    requests = {rid: (pool.num_tokens((rid, label)), pool.page_table((rid, label)), dict(state.history),
                      dict(state.num_sampled), dict(state.last_token))
                for rid, state in sorted(engine.requests.items())}
    rows = [(row.request_id, {name: list(value) if isinstance(value, list) else value.tolist()
                              for name, value in row.outputs.items()}, row.is_stop, row.is_length, row.error)
            for row in result.rows]
    token_ids = None if result.token_ids is None else np.asarray(result.token_ids).tolist()
    return (rows, token_ids, list(result.stop_rows), list(result.allocation_failed), requests,
            pool.num_free_pages, dict(runner.admission.budgets), dict(runner.admission.held),
            runner.admission.num_outstanding, runner.executor.loop_tokens.tolist(), dict(runner._row_slots),
            runner.num_ahead_rows, runner.num_claimed_rows, runner.num_ahead_chunks, runner.num_claimed_chunks,
            runner.num_ahead_first_chunks)


def _run(requests: list[Request], concurrency: int, is_columnar: bool, can_run_ahead: bool, num_pages: int,
         prefix_cache: bool, budget: int = 0, is_reversed: bool = False, hybrid: bool = False
         ) -> tuple[list[tuple], dict[str, tuple], int, int]:
    """Every step's snapshot, each request's finish and outputs, the steps taken in columns, and
    those of them that held a prompt chunk beside the decode rows (the chunk row by row).
    is_reversed: the runner gets the rows of a step of several calls in reverse order (the
    scheduler puts prompt rows first; this puts the decode rows first), and its results are put
    back in step order."""
    engine, runner = _engine(is_columnar, can_run_ahead, num_pages, prefix_cache, budget, hybrid)
    if is_reversed:
        start = runner.start

        def reversed_start(rows, *args, **kwargs):
            if all(call is rows[0][1] for _, call, _ in rows):
                return start(rows, *args, **kwargs)
            known, failed, finish = start(rows[::-1], *args, **kwargs)
            return known, failed, lambda: finish()[::-1]
        runner.start = reversed_start  # type: ignore[method-assign]
    trace: list[tuple] = []
    num_steady, num_chunk_steps = [0], [0]
    wait, start_steady = engine.wait, runner_module.start_steady

    def traced_wait(handle):
        result = wait(handle)
        trace.append(_snapshot(engine, runner, result))
        return result

    def counted(runner, steady, rows, *args, **kwargs):
        num_steady[0] += 1
        num_chunk_steps[0] += any(rows[index][0].is_partial or rows[index][0].chunk_start for index in steady.others)
        return start_steady(runner, steady, rows, *args, **kwargs)

    engine.wait = traced_wait  # type: ignore[method-assign]
    runner_module.start_steady = counted
    try:
        clock = TickClock()
        driver = Driver(engine.plan, engine, clock=clock.now)
        with mock.patch("time.sleep", clock.sleep):  # the run loop's idle waits move the clock, at once
            driver.run(Workload([dataclasses.replace(r) for r in requests], closed_concurrency=concurrency))
    finally:
        runner_module.start_steady = start_steady
    records = {rid: (record.finish_reason, [np.asarray(t).tolist() for t in record.output_tokens])
               for rid, record in sorted(driver.conductor.records.items())}
    return trace, records, num_steady[0], num_chunk_steps[0]


def _requests(lengths: list[tuple[int, int]], stops: list[int], temperatures: list[bool]) -> list[Request]:
    return [Request(id=f"r{i}", prompt_tokens=[(5 * j) % 97 + 1 for j in range(prompt)] + [i + 1],
                    max_tokens=max_tokens, stop_tokens=stops if i % 2 else [],
                    temperature=0.9 if temperatures[i % len(temperatures)] else None, seed=i)
            for i, (prompt, max_tokens) in enumerate(lengths)]


def _compare(requests, concurrency, can_run_ahead, num_pages, prefix_cache, budget: int = 0,
             is_reversed: bool = False, hybrid: bool = False) -> tuple[int, int]:
    """Runs the two engines and compares them; returns the steps the columnar one took in columns
    and those of them with a prompt chunk beside the decode rows."""
    expected, expected_records, none, _ = _run(requests, concurrency, False, can_run_ahead, num_pages,
                                               prefix_cache, budget, is_reversed, hybrid)
    got, records, num_steady, num_chunk_steps = _run(requests, concurrency, True, can_run_ahead, num_pages,
                                                     prefix_cache, budget, is_reversed, hybrid)
    assert none == 0
    for index, (step_got, step_expected) in enumerate(zip(got, expected)):
        assert step_got == step_expected, f"step {index}"
    assert len(got) == len(expected)
    assert records == expected_records
    assert all(reason in ("stop", "length") for reason, _ in records.values())
    return num_steady, num_chunk_steps


@pytest.mark.parametrize("can_run_ahead", [True, False])
@pytest.mark.parametrize("prefix_cache", [False, True])
def test_columns_follow_the_per_row_path(can_run_ahead, prefix_cache):
    requests = _requests([(4 + (7 * i) % 20, 5 + (11 * i) % 30) for i in range(10)], stops=list(range(0, 512, 9)),
                         temperatures=[False, True])
    num_steady, _ = _compare(requests, 6, can_run_ahead, 512, prefix_cache)
    assert num_steady > 10  # most decode steps ran in columns


@pytest.mark.parametrize("can_run_ahead", [True, False])
def test_columns_under_memory_pressure(can_run_ahead):
    # 12 pages of 16 tokens for 8 concurrent requests of up to 60 tokens: rows are held, and the
    # pool's free pages often fall short of what started requests may claim (the per-row case)
    requests = _requests([(8 + (5 * i) % 16, 10 + (13 * i) % 28) for i in range(12)], stops=[],
                         temperatures=[False])
    assert _compare(requests, 8, can_run_ahead, 12, prefix_cache=True)[0] > 0


@settings(max_examples=6)
@given(lengths=st.lists(st.tuples(st.integers(1, 24), st.integers(1, 40)), min_size=1, max_size=9),
       concurrency=st.integers(1, 8), stops=st.lists(st.integers(0, 511), max_size=40),
       temperatures=st.lists(st.booleans(), min_size=1, max_size=3), can_run_ahead=st.booleans(),
       prefix_cache=st.booleans(), num_pages=st.sampled_from([8, 16, 256]))
def test_columns_follow_the_per_row_path_on_random_workloads(lengths, concurrency, stops, temperatures,
                                                             can_run_ahead, prefix_cache, num_pages):
    _compare(_requests(lengths, stops, temperatures), concurrency, can_run_ahead, num_pages, prefix_cache)


@pytest.mark.parametrize("is_reversed", [False, True])
@pytest.mark.parametrize("can_run_ahead", [True, False])
@pytest.mark.parametrize("prefix_cache", [False, True])
def test_chunk_steps_run_their_decode_rows_in_columns(can_run_ahead, prefix_cache, is_reversed):
    # five short requests decode while long prompts (their first 60+ tokens shared: prefix-cache
    # hits) are cut by a 16-token step budget into chunks that run beside the decode rows
    lengths = [(4 + i, 30 + 7 * i) for i in range(5)] + [(60 + 25 * i, 6 + i) for i in range(4)] + [(6, 20)] * 3
    requests = _requests(lengths, stops=list(range(0, 512, 13)), temperatures=[False, True, False])
    num_steady, num_chunk_steps = _compare(requests, 6, can_run_ahead, 512, prefix_cache, budget=16,
                                           is_reversed=is_reversed)
    assert num_chunk_steps >= 10  # the chunk steps took the columns
    assert num_steady > num_chunk_steps


def _compare_ahead(requests, concurrency, num_pages, prefix_cache, budget, is_columnar) -> tuple:
    """Runs the workload with run-ahead on and off (columns on or off in both) and compares them:
    the same step results, and after every step the same request state (KV lengths, histories,
    sampled counts, last tokens), the same finishes and tokens. Returns the last step's snapshot
    with run-ahead on. (Pages and the device token table are not compared: a step launched ahead
    reserves its pages and writes its loop-back tokens before the step before it is waited for.)"""
    expected, expected_records, _, _ = _run(requests, concurrency, is_columnar, False, num_pages, prefix_cache, budget)
    got, records, _, _ = _run(requests, concurrency, is_columnar, True, num_pages, prefix_cache, budget)

    def state(snapshot):
        rows, token_ids, stop_rows, failed, by_request = snapshot[:5]
        return rows, token_ids, stop_rows, failed, {rid: (num, history, sampled, last)
                                                    for rid, (num, _, history, sampled, last) in by_request.items()}
    assert len(got) == len(expected)
    for index, (step_got, step_expected) in enumerate(zip(got, expected)):
        assert state(step_got) == state(step_expected), f"step {index}"
    assert records == expected_records
    assert all(reason in ("stop", "length") for reason, _ in records.values())
    return got[-1]


@pytest.mark.parametrize("is_columnar", [True, False])
@pytest.mark.parametrize("prefix_cache", [False, True])
def test_chunk_steps_launch_the_next_chunk_ahead(is_columnar, prefix_cache):
    # four short requests decode while one long prompt is cut by a 16-token budget: past each of
    # its chunk steps the next step (the decode rows and its next chunk) is launched ahead
    lengths = [(3, 60), (4, 50), (2, 70), (150, 20), (5, 40)]
    requests = _requests(lengths, stops=list(range(0, 512, 13)), temperatures=[False, True])
    last = _compare_ahead(requests, 5, 512, prefix_cache, 16, is_columnar)
    num_ahead_chunks, num_claimed_chunks = last[-3:-1]
    assert num_ahead_chunks >= 5  # most of the long prompt's 10 chunks ran ahead
    assert num_claimed_chunks == num_ahead_chunks  # and the steps launched for real took every one
    _compare(requests, 5, True, 512, prefix_cache, budget=16)  # columns and per-row agree with it too


@pytest.mark.parametrize("is_columnar", [True, False])
@pytest.mark.parametrize("prefix_cache", [False, True])
def test_a_prompt_arriving_beside_decode_rows_shares_their_step_launched_ahead(is_columnar, prefix_cache):
    # four requests decode; later ones arrive one at a time (closed loop) while the others' decode
    # chain runs ahead: each new prompt's first chunk is launched ahead with the decode rows (one
    # launch), not in a launch of its own after theirs, and the run is the run without running ahead
    lengths = [(3, 40), (4, 30), (2, 50), (5, 20), (60, 8), (40, 6), (70, 5)]
    requests = _requests(lengths, stops=[], temperatures=[False, True])
    last = _compare_ahead(requests, 4, 512, prefix_cache, 16, is_columnar)
    num_ahead_chunks, num_claimed_chunks, num_first_chunks = last[-3:]
    assert num_first_chunks >= 2  # later prompts arriving while the chain ran (0 before: each ran alone)
    assert num_claimed_chunks == num_ahead_chunks  # the steps launched for real took every one


@pytest.mark.parametrize("is_columnar", [True, False])
def test_chunks_ahead_under_memory_pressure(is_columnar):
    # 20 pages of 16 tokens: chunks launched ahead reserve pages the decode rows would take
    lengths = [(8 + (5 * i) % 16, 12 + (13 * i) % 28) for i in range(4)] + [(120, 6), (10, 30), (90, 4)]
    _compare_ahead(_requests(lengths, stops=[], temperatures=[False]), 5, 20, True, 24, is_columnar)


# Random chunked workloads: prompt and output lengths, concurrency, step token budget (and chunk
# size), prefix cache on or off, pool size.
CHUNKED_WORKLOADS = dict(
    lengths=st.lists(st.tuples(st.integers(1, 90), st.integers(1, 30)), min_size=2, max_size=9),
    concurrency=st.integers(2, 8), budget=st.sampled_from([8, 16, 40]), prefix_cache=st.booleans(),
    num_pages=st.sampled_from([16, 32, 256]))


@settings(max_examples=6)
@given(is_columnar=st.booleans(), **CHUNKED_WORKLOADS)
def test_chunks_ahead_follow_the_run_without_on_random_workloads(lengths, concurrency, budget, is_columnar,
                                                                 prefix_cache, num_pages):
    _compare_ahead(_requests(lengths, list(range(0, 512, 17)), [False, True]), concurrency, num_pages,
                   prefix_cache, budget, is_columnar)


@pytest.mark.parametrize("can_run_ahead", [True, False])
def test_chunk_steps_under_memory_pressure(can_run_ahead):
    # 20 pages of 16 tokens: a long prompt's pages crowd the decode rows (rows held, chunks refused)
    lengths = [(8 + (5 * i) % 16, 12 + (13 * i) % 28) for i in range(6)] + [(90, 10), (70, 12), (10, 30), (120, 4)]
    requests = _requests(lengths, stops=[], temperatures=[False])
    assert _compare(requests, 6, can_run_ahead, 20, prefix_cache=True, budget=24)[1] > 0


@settings(max_examples=6)
@given(can_run_ahead=st.booleans(), **CHUNKED_WORKLOADS)
def test_chunk_steps_follow_the_per_row_path_on_random_workloads(lengths, concurrency, budget, can_run_ahead,
                                                                 prefix_cache, num_pages):
    _compare(_requests(lengths, list(range(0, 512, 17)), [False, True]), concurrency, can_run_ahead, num_pages,
             prefix_cache, budget)


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


# ------------------------------------------------------------------ a hybrid decoder (state slots)


@pytest.mark.parametrize("can_run_ahead", [True, False])
def test_hybrid_columns_follow_the_per_row_path(can_run_ahead):
    """A Qwen3.5 hybrid's steady rows take the columns too (their row slots are their state slots):
    the same steps, results and request state as the per-row path, run ahead or not."""
    lengths = [(3, 20), (9, 14), (2, 25), (14, 9), (5, 18), (7, 12)]
    requests = _requests(lengths, stops=list(range(0, 512, 23)), temperatures=[False, True])
    num_steady, _ = _compare(requests, 4, can_run_ahead, 96, False, hybrid=True)
    assert num_steady > 10


@pytest.mark.parametrize("can_run_ahead", [True, False])
def test_hybrid_chunk_steps_in_columns(can_run_ahead):
    lengths = [(3, 30), (4, 25), (40, 8), (2, 30), (33, 6)]
    requests = _requests(lengths, stops=[], temperatures=[False, True])
    num_steady, num_chunk_steps = _compare(requests, 4, can_run_ahead, 96, False, budget=8, hybrid=True)
    assert num_steady > 10 and num_chunk_steps > 0


def test_hybrid_columns_under_memory_pressure():
    lengths = [(8 + (5 * i) % 16, 12 + (13 * i) % 28) for i in range(6)]
    _compare(_requests(lengths, stops=[], temperatures=[False]), 6, True, 12, False, hybrid=True)


@pytest.mark.parametrize("can_run_ahead", [True, False])
def test_a_steady_row_past_the_pool_ends_its_request_as_on_the_per_row_path(monkeypatch, can_run_ahead):
    """A started request whose rows would take its KV sequence past the pool's pages can never get
    them: the per-row path ends it alone (`DecoderRunner._past_pool`); a steady decode row in columns
    was held instead, until the run loop called the request stalled 30 s on, the pool held all the
    while. Now the columns end it with the same error at the same step. The GPU runner's rows feed
    tokens only, so their budget counts them all; the budget here counts the prompt alone, as the
    declared media tokens (an estimate) undercount what a request's media feed on the per-row
    runner: "long" (10 + 30 tokens, a budget of 1 page) grows into the second of the pool's 2
    pages once "short" ends, and its row at the third page ends it; "short" finishes."""
    monkeypatch.setattr(GpuDecoderRunner, "_budget_tokens", lambda self, request: len(request.prompt_tokens))
    requests = [Request(id="long", prompt_tokens=list(range(1, 11)), max_tokens=30),
                Request(id="short", prompt_tokens=list(range(1, 11)), max_tokens=4)]
    expected, expected_records, _, _ = _run(requests, 2, False, can_run_ahead, 2, False)
    got, records, num_steady, _ = _run(requests, 2, True, can_run_ahead, 2, False)
    assert expected_records["long"][0] == ("error: node LLM: the request's KV sequences would grow to 3 pages of 16 "
                                           "tokens, past the pool's 2: its rows fed more tokens than its start "
                                           "budget of 1 pages counted (its prompt, max_tokens and the node's "
                                           "declared media tokens, cut to the pool)")
    assert records == expected_records and expected_records["short"][0] == "length"
    assert num_steady > 0 and got == expected  # step by step as the per-row path, the last step in columns
    assert got[-1][0][0][4] == expected_records["long"][0][len("error: "):]
