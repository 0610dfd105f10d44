"""A penalised request whose penalty table row the device has no memory for fails alone.

The table (`gpu/penalties.py`) grows when penalised requests outnumber its rows; it grew inside the
step's `penalise`, so a failed allocation raised out of the step and failed every request in it (the
fast path's runner re-runs no failed step). Now a request's row is taken at its first step, before
that step launches (`PenaltyTable.reserve` from the runner's per-row checks), and a failed
allocation fails that row alone. The device is the CPU here; an allocation fails by a stand-in
`_allocate` past a capacity, as CUDA's allocator would when the KV pool has taken the memory.
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from fast_path_cpu import fast_path_engine, run_asks
from mstar.plan.io import load_plan
from mstar.runtime.engine.gpu import penalties
from mstar.runtime.engine.gpu.penalties import PenaltyTable

ROOT = Path(__file__).resolve().parents[2]
VOCAB = 50


def limit_rows(table: PenaltyTable, max_rows: int) -> list[int]:
    """Make `table` fail any allocation of more than `max_rows` rows as out of memory; the
    capacities asked for, in order."""
    asked: list[int] = []
    allocate = table._allocate

    def limited(capacity: int, vocab: int):
        asked.append(capacity)
        if capacity > max_rows:
            raise torch.OutOfMemoryError("CUDA out of memory (a stand-in)")
        return allocate(capacity, vocab)

    table._allocate = limited  # type: ignore[method-assign]
    return asked


def test_reserve_refuses_a_row_the_device_cannot_hold_and_keeps_the_others():
    table = PenaltyTable(torch.device("cpu"))
    asked = limit_rows(table, 2)
    assert table.reserve("a", VOCAB) is None  # 8 rows asked for, then exactly 1
    assert table.reserve("b", VOCAB) is None
    problem = table.reserve("c", VOCAB)
    assert problem is not None and f"{5 * VOCAB} bytes" in problem and "2 penalised requests" in problem
    assert asked == [penalties._FIRST_CAPACITY, 1, penalties._FIRST_CAPACITY, 2, penalties._FIRST_CAPACITY, 3]
    assert table.counts is not None and table.counts.shape[0] == 2
    table.forget("a")  # its row is free: the next request takes it without growing
    assert table.reserve("c", VOCAB) is None and len(asked) == 6


def test_a_refused_free_row_goes_back_to_the_free_list():
    table = PenaltyTable(torch.device("cpu"))
    for request in "abc":
        table.reserve(request, VOCAB)
    table.forget("c")  # rows 0, 1 held; 2 free; the table holds 8
    table._allocate = lambda capacity, vocab: (_ for _ in ()).throw(RuntimeError("not memory"))  # type: ignore
    assert table.reserve("d", VOCAB) is None  # row 2, no growth asked
    with pytest.raises(RuntimeError, match="not memory"):
        table._grow(9, VOCAB)  # an error other than memory is raised as it is


def test_only_the_penalised_request_past_the_tables_room_fails():
    plan = load_plan(ROOT / "generated" / "llama.plan", verify=False)
    engine, runner = fast_path_engine(plan, 256, max_seq_len=4096)
    limit_rows(runner.executor.penalty_table, 2)
    asks = [dict(repetition_penalty=1.3), {}, dict(presence_penalty=0.5), {}, dict(frequency_penalty=0.4), {}]
    records = run_asks(plan, engine, asks, 6, 8)
    reasons = {rid: record.finish_reason for rid, record in records.items()}
    assert reasons["r4"].startswith("error") and "penalty table" in reasons["r4"], reasons
    assert all(reason == "length" for rid, reason in reasons.items() if rid != "r4"), reasons
    assert all(len(records[rid].output_tokens) == 8 for rid in reasons if rid != "r4")
