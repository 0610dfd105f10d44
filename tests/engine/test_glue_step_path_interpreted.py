"""The generated glue in the GPU fast path's step, under Triton's interpreter on the CPU.

The fast path's runner packing with the plan's generated glue (`gpu/glue_packing.py`: the row
list in one copy, the device page-table mirror, `pack_step`, `scatter_after_sampling` into the
device token table) gives the tokens the numpy packing gives, through the run loop (loop-back on
the device, sampling, run-ahead, slots reused under memory pressure) and over tests/gpu's steps
run eagerly; and for random scheduler
batches over several steps (hypothesis) the glue packer writes what `packing.pack` lays out and
what `glue_reference.pack_step` writes over the whole page table.

The cases run in a child pytest with TRITON_INTERPRET=1 (Triton reads it when first imported).
"""
from __future__ import annotations

import functools
import os
import sys
from importlib.metadata import version
from pathlib import Path
from unittest import mock

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from mstar.plan.io import load_plan
from mstar.runtime.conductor.request import Request
from mstar.runtime.engine import glue_reference as ref
from mstar.runtime.engine.glue_loader import load_plan_glue
from mstar.runtime.engine.gpu.glue_packing import GluePacker, eager_buffers
from mstar.runtime.engine.gpu.packing import RowSpec, fed_ids, pack
from mstar.runtime.engine.gpu.runner import node_glue
from mstar.runtime.engine.torch_engine import TorchEngine
from mstar.runtime.serve.driver import Driver, Workload
from fast_path_cpu import fast_path_engine
from interpreter_child import run_child
from tick_clock import TickClock

REPO = Path(__file__).resolve().parents[2]
PLAN = REPO / "generated" / "llama.plan"
IS_INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
interpreted = pytest.mark.skipif(not IS_INTERPRETED, reason="runs in the interpreter's own process (below)")


@pytest.mark.skipif(IS_INTERPRETED, reason="this is the interpreter's process")
@pytest.mark.skipif(tuple(int(part) for part in version("triton").split(".")[:2]) < (3, 9),
                    reason="Triton's interpreter before 3.9 cannot run the glue kernels (docs/glue.md)")
def test_glue_step_path_under_the_interpreter():
    """This file again under the interpreter; then its glue kernels compiled for an sm_90 GPU."""
    run_child(__file__, "10 passed")


def _glue(plan_path: Path):
    """The plan's checked-in glue, loaded as the runtime loads it (checked against the plan's hash)."""
    return load_plan_glue(plan_path, load_plan(plan_path, verify=False))


def _engine(is_glue: bool, can_run_ahead: bool, num_pages: int = 96, host_pages: int = 0, cap: int = 0
            ) -> TorchEngine:
    """cap: every mixture's cap at most this (0: the plan's), so started requests sit out steps."""
    plan = load_plan(PLAN, verify=False)
    if cap:
        workers = [w.model_copy(update={"keys": [k.model_copy(update={"mixtures": [
            m.model_copy(update={"cap": min(m.cap, cap)}) for m in k.mixtures]}) for k in w.keys]})
            for w in plan.workers]
        plan = plan.model_copy(update={"workers": workers})
    glue = node_glue(_glue(PLAN).GLUE_BY_WORKER, "LLM") if is_glue else None
    engine, _ = fast_path_engine(plan, num_pages, max_seq_len=4096, can_run_ahead=can_run_ahead, glue=glue,
                                 host_pages=host_pages)
    return engine


def _run(engine: TorchEngine, num: int, clock=None) -> dict[str, tuple]:
    """clock: the run's (default: the wall clock)."""
    # Prompts of 5 to 20 tokens and up to 21 outputs cross page boundaries (16 tokens a page);
    # every third request samples (seeded); arrivals staggered so rows join and leave mid-chain.
    requests = [Request(id=f"r{i}", prompt_tokens=[(3 + 7 * i + 5 * t) % 500 for t in range(5 + (3 * i) % 16)],
                        max_tokens=4 + (7 * i) % 18, arrival_s=0.0, temperature=0.9 if i % 3 == 1 else None, seed=i)
                for i in range(num)]
    driver = Driver(engine.plan, engine, clock=clock)
    driver.run(Workload(requests))
    return {rid: (r.finish_reason, list(r.output_tokens)) for rid, r in driver.conductor.records.items()}


@functools.lru_cache(maxsize=None)
def _numpy_run(num: int, num_pages: int, cap: int = 0) -> dict[str, tuple]:
    """The numpy-packed runner's outcome (no run-ahead), once per shape for the cases below."""
    return _run(_engine(False, False, num_pages, cap=cap), num)


@interpreted
@pytest.mark.parametrize("can_run_ahead", [False, True])
def test_glue_runner_gives_the_numpy_runners_tokens(can_run_ahead):
    expected = _numpy_run(7, 96)
    engine = _engine(True, can_run_ahead)
    assert engine.runners["LLM"].executor.packer is not None
    assert _run(engine, 7) == expected
    if can_run_ahead:
        assert engine.runners["LLM"].num_claimed_rows > 0


@interpreted
def test_glue_runner_under_memory_pressure_reuses_slots():
    """Six pages: rows are held, requests end and their row slots pass to new requests, whose
    page-table rows the mirror must send again from the first page."""
    expected = _numpy_run(9, 6)
    engine = _engine(True, True, num_pages=6)
    assert _run(engine, 9) == expected
    assert engine.runners["LLM"].pool.num_free_pages == 6


@interpreted
def test_glue_runner_with_kv_offload_resends_the_page_tables_it_moves():
    """Six pages and a host pool: requests are moved out and back to other pages, and the mirror
    must send a restored request's page table again (`GpuDecoderRunner._move_back`); the tokens
    are those of the numpy runner, which holds rows instead."""
    expected = _numpy_run(12, 96, 2)
    engine = _engine(True, True, num_pages=6, host_pages=64, cap=2)
    # A clock that ticks a call, so which steps find rows short (and move pages) does not depend on
    # the machine's speed: a move must start more requests than it moves out (kv/offload.py), which
    # these requests' budgets allow only at some steps. An idle wait (rows held for pages) jumps it,
    # as test_offload.py's runs: the host's sleep passed real time while the clock stood still.
    clock = TickClock(1e-4)
    with mock.patch("time.sleep", clock.sleep):
        assert _run(engine, 12, clock=clock.now) == expected
    runner = engine.runners["LLM"]
    assert runner.offload.num_restored_pages > 0 and runner.pool.num_free_pages == 6


@interpreted
def test_the_gpu_tests_steps_on_the_cpu():
    """tests/gpu's step sequence (decode rows fed from the host then the device, mixed, split and
    eager steps, page crossings), every step eager with torch attention on the CPU, fp32."""
    sys.path.insert(0, str(REPO / "tests" / "gpu"))
    import test_glue_step_path_gpu as gpu_steps

    glue_executor, numpy_executor = gpu_steps._executors(device_name="cpu", is_flashinfer=False)
    gpu_steps.compare_glue_and_numpy(glue_executor, numpy_executor)


@interpreted
def test_glue_fills_the_buffers_the_graphs_and_flashinfer_read():
    """The same steps through the decode-graph and piecewise paths, with CPU stand-ins that run
    each replay from exactly the buffers the graph and FlashInfer's wrappers read (graph_standins):
    the glue writes the decode graph's inputs and the wrapper's static index buffers in place (what
    plan() gets on the host equals them), and the piecewise bucket's inputs."""
    import graph_standins

    sys.path.insert(0, str(REPO / "tests" / "gpu"))
    import test_glue_step_path_gpu as gpu_steps

    executors = gpu_steps._executors(device_name="cpu", is_flashinfer=False)
    for executor in executors:
        graph_standins.install(executor)
    gpu_steps.compare_glue_and_numpy(*executors)
    for executor in executors:
        assert (executor.num_graph_steps, executor.num_piecewise_steps, executor.num_eager_steps) == (22, 2, 2)


@interpreted
def test_glue_packs_unrolled_prompt_rows_into_the_decode_graphs_buffers():
    """Short prompt rows unrolled into the decode graph (the plan's `unroll_prompts`), packed by the
    glue into the graph stand-in's buffers: a 4-token prompt beside a decode row, a 5-token prompt
    tail after 32 tokens cached in another request's pages; the tokens and K/V of the numpy
    packer's eager prompt rows (fp32)."""
    import graph_standins

    sys.path.insert(0, str(REPO / "tests" / "gpu"))
    import test_glue_step_path_gpu as gpu_steps

    glue_executor, numpy_executor = gpu_steps._executors(device_name="cpu", is_flashinfer=False)
    for executor in (glue_executor, numpy_executor):
        graph_standins.install(executor)
    glue_executor.unroll_prompts = 6
    prefill, decode = gpu_steps.PREFILL, gpu_steps.DECODE
    tables = [list(range(20 * i, 20 * i + 20)) for i in range(3)]
    steps = [
        [RowSpec(list(range(3, 40)), 0, tables[0], 0, False, prefill)],  # 37 tokens: past the limit
        [RowSpec([41], 37, tables[0], 0, True, decode), RowSpec([5, 6, 7, 8], 0, tables[1], 1, False, prefill)],
        # request 1's first decode row takes its token from the host (the prefill walk's token is the
        # conductor's, as the plan routes it); request 0's reads the device token table
        [RowSpec(None, 38, tables[0], 0, True, decode), RowSpec([77], 4, tables[1], 1, True, decode)],
        [RowSpec([9, 10, 11, 12, 13], 32, tables[0][:2] + tables[2], 2, False, prefill)],
    ]
    start = glue_executor.kv.data.clone()
    glue = gpu_steps._glue()
    got = [glue_executor.collect(glue_executor.launch(rows, None, None, 0, "packed", glue)).tolist() for rows in steps]
    glue_kv = glue_executor.kv.data.clone()
    glue_executor.kv.data.copy_(start)
    expected = [numpy_executor.collect(numpy_executor.launch(rows)).tolist() for rows in steps]
    assert got == expected
    assert glue_executor.num_unrolled_steps == 2 and numpy_executor.num_unrolled_steps == 0
    real = glue_kv[:, :, :-1]
    assert ((real - numpy_executor.kv.data[:, :, :-1]).norm() / real.norm()).item() < 1e-5


@interpreted
@pytest.mark.parametrize("is_planned", [True, False], ids=["flashinfer", "triton"])
def test_glue_packs_rows_sharing_a_long_prefix_into_the_decode_graphs_buffers(is_planned):
    """A prefix-cached workload whose decode steps index more pages than the pool holds (rows share
    the prefix's pages): the glue's launch check passes, as the decode wrapper's page-index buffer
    holds rows x pages of the longest sequence, and the tokens are the reference's; unplanned (the
    Triton decode kernel's graphs), from the arrays the glue wrote alone."""
    from test_gpu_fast_path_on_cpu import SHARED_PREFIX_POOL, shared_prefix_run

    glue = node_glue(_glue(REPO / "generated" / "llama_chunked.plan").GLUE_BY_WORKER, "LLM")
    got, expected, page_sums, num_graph_steps = shared_prefix_run(glue, is_planned)
    assert {rid: outcome[:2] for rid, outcome in got.items()} == {rid: outcome[:2] for rid, outcome in expected.items()}
    assert max(page_sums) > SHARED_PREFIX_POOL + 64 and num_graph_steps > 0


PAGE_SIZE, NUM_SLOTS, PAGES_PER_SEQ, DUMMY_PAGE = 16, 12, 8, 0
DUMMY_SLOT = DUMMY_PAGE * PAGE_SIZE


@st.composite
def _steps(draw):
    """Several steps of a key's rows as the scheduler makes them: new requests' prompt chunks,
    running requests' decode rows (their token from the host or the device token table), requests
    ending (their slots reused); each step decode-only and padded to a captured batch, or a
    packed step padded to a token bucket (piecewise), or eager."""
    return [dict(num_new=draw(st.integers(0, 3)), chunks=draw(st.lists(st.integers(1, 40), min_size=3, max_size=3)),
                 num_ending=draw(st.integers(0, 2)), is_fed=draw(st.lists(st.booleans(), min_size=8, max_size=8)),
                 shape=draw(st.sampled_from(["captured", "bucket", "eager"])))
            for _ in range(draw(st.integers(1, 5)))]


@interpreted
@settings(max_examples=15, deadline=None)
@given(steps=_steps(), seed=st.integers(0, 2 ** 16))
def test_glue_packer_matches_numpy_packing_over_scheduler_steps(steps, seed):
    module = _glue(PLAN)
    glue = module.GLUE_BY_WORKER[0]["LLM:mixed"]
    constants = glue.constants
    decode = constants.walks.index("decode")
    rng = np.random.default_rng(seed)
    # Two slot rows at first: the mirror grows as higher slots arrive, keeping what it mirrored.
    packer = GluePacker(PAGE_SIZE, NUM_SLOTS, PAGES_PER_SEQ, DUMMY_SLOT, torch.device("cpu"), initial_rows=2)
    loop_back = torch.from_numpy(rng.integers(0, 999, NUM_SLOTS).astype(np.int32))
    free_slots, free_pages = list(range(1, NUM_SLOTS)), list(range(1, 200))
    rng.shuffle(free_pages)
    live: dict[int, dict] = {}  # slot -> {"pages", "cached"}
    for spec in steps:
        for slot in list(live)[:spec["num_ending"]]:
            free_pages.extend(live.pop(slot)["pages"])
            free_slots.append(slot)
            packer.forget(slot)
        rows: list[RowSpec] = []
        for index, (slot, seq) in enumerate(live.items()):
            fed = spec["is_fed"][index % 8]
            rows.append(RowSpec(None if fed else [int(rng.integers(0, 999))], seq["cached"], seq["pages"], slot,
                                True, decode))
        if spec["shape"] != "captured":
            for chunk in spec["chunks"][:spec["num_new"]]:
                if free_slots:
                    slot = free_slots.pop()
                    live[slot] = {"pages": [], "cached": 0}
                    rows.append(RowSpec(list(rng.integers(0, 999, chunk)), 0, live[slot]["pages"], slot, False, 0))
        rows = rows[:8]
        if not rows:
            continue
        for row in rows:  # the grant: pages for this step's tokens
            seq = live[row.row_slot]
            while len(seq["pages"]) * PAGE_SIZE < row.num_cached + row.num_tokens:
                seq["pages"].append(free_pages.pop())
        total = sum(row.num_tokens for row in rows)
        padded_batch, bucket = len(rows), total
        if spec["shape"] == "captured":
            padded_batch = bucket = min(b for b in constants.batch_sizes if b >= len(rows))
        elif spec["shape"] == "bucket":
            bucket = min(t for t in constants.token_buckets if t >= total)
        _compare_step(glue, packer, rows, padded_batch, bucket, loop_back)
        for row in rows:
            live[row.row_slot]["cached"] += row.num_tokens
            loop_back[row.row_slot] = int(rng.integers(0, 999))


def _compare_step(glue, packer, rows, padded_batch, bucket, loop_back):
    step = packer.host_step(glue, rows, padded_batch)
    data = packer.row_buffer(step.host.shape[0], bucket)
    data.copy_(torch.from_numpy(step.host))
    out = eager_buffers(bucket, padded_batch, step.num_pages, torch.device("cpu"))
    inputs = packer.launch(glue, step, data, bucket, out, loop_back)

    expected = pack(rows, PAGE_SIZE, DUMMY_PAGE, padded_rows=padded_batch if padded_batch > len(rows) else 0,
                    padded_tokens=bucket)
    t, r, n = expected.num_padded_tokens, expected.num_padded_rows, step.num_tokens
    ids, positions, slots, src, last, _ = torch.from_numpy(expected.host.astype(np.int64)).split([t] * 4 + [r] * 2)
    assert out.tokens[:n].tolist() == fed_ids(ids, src, loop_back)[:n].tolist()
    assert out.positions[:n].tolist() == positions[:n].tolist()
    assert out.kv_slots[:n].tolist() == slots[:n].tolist()
    # Padding tokens write the dummy page (both packers), at position 0.
    assert set(out.kv_slots[n:bucket].tolist()) <= {DUMMY_SLOT} and set(out.positions[n:bucket].tolist()) <= {0}
    num_rows, num_pages = len(rows), step.num_pages
    assert out.logits_index[:num_rows].tolist() == last[:num_rows].tolist()
    assert out.kv_indices[:num_pages].tolist() == expected.kv_indices[:num_pages].tolist()
    for host, device, numpy_side in ((step.qo_indptr, out.qo_indptr, expected.qo_indptr),
                                     (step.kv_indptr, out.kv_indptr, expected.kv_indptr)):
        assert host.tolist() == device[:padded_batch + 1].tolist()  # plan() reads what the kernel wrote
        assert host[:num_rows + 1].tolist() == numpy_side[:num_rows + 1].tolist()
        assert host[num_rows + 1:].tolist() == [host[num_rows]] * (padded_batch - num_rows)  # zero-length padding
    assert step.last_page_len.tolist() == out.kv_last_page_len[:padded_batch].tolist()
    assert step.last_page_len[:num_rows].tolist() == expected.last_page_len[:num_rows].tolist()
    assert step.last_page_len[num_rows:].tolist() == [0] * (padded_batch - num_rows)
    # The mirror holds what the whole page table would: the reference over full tables agrees.
    full = torch.zeros(NUM_SLOTS, PAGES_PER_SEQ, dtype=torch.int32)
    for row in rows:
        full[row.row_slot, :len(row.page_table)] = torch.tensor(row.page_table, dtype=torch.int32)
    want = eager_buffers(bucket, padded_batch, num_pages, torch.device("cpu"))
    ref.pack_step(glue.constants, num_rows, padded_batch, bucket, inputs, full, loop_back, want, DUMMY_SLOT, num_pages)
    for field in ("tokens", "positions", "kv_slots", "kv_indices"):
        assert getattr(want, field)[:bucket if field != "kv_indices" else num_pages].tolist() == \
            getattr(out, field)[:bucket if field != "kv_indices" else num_pages].tolist(), field
