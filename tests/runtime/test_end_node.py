"""A request's memory on a kv node goes when every partition of it that calls the node has ended
(`Conductor._end_nodes`, the engines' `end_node`), not at the request's end: Qwen3-Omni's Thinker
pages while its Talker and Code2Wav still run."""
from __future__ import annotations

import os
from pathlib import Path

import torch
from hypothesis import given, settings, strategies as st

from mstar.plan.io import load_plan
from mstar.runtime.conductor.conductor import partition_kv_nodes
from mstar.runtime.conductor.request import Request
from mstar.runtime.engine.sim import SimEngine
from mstar.runtime.engine.torch_engine import TorchEngine
from mstar.runtime.serve.driver import Driver, Workload

PLAN = Path(__file__).resolve().parents[2] / "generated" / "qwen3_omni.plan"


class _Recording:
    """Wraps an engine; records end_node and end_request calls, and each kv pool's pages of the
    request just after its end_node."""

    def __init__(self, inner):
        self.inner = inner
        self.caps = inner.caps
        self.calls: list[tuple[str, ...]] = []
        self.pages_after: dict[tuple[str, str], int] = {}

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def end_node(self, request_id: str, node: str) -> None:
        self.inner.end_node(request_id, node)
        self.calls.append(("end_node", request_id, node))
        pools = getattr(self.inner, "pools", None)
        if pools is not None:
            self.pages_after[(request_id, node)] = len(pools[node].pages.sequences_of(request_id))

    def end_request(self, request_id: str) -> None:
        self.calls.append(("end_request", request_id))
        self.inner.end_request(request_id)


def _run(engine, requests, concurrency=None):
    plan = load_plan(PLAN)
    driver = Driver(plan, engine)
    driver.run(Workload(requests, closed_concurrency=concurrency))
    return plan, driver.conductor.records


def test_a_node_only_ended_partitions_call_frees_the_requests_memory_before_the_request_ends():
    plan = load_plan(PLAN)
    by_partition = partition_kv_nodes(plan, {n.name for n in plan.nodes if n.engine == "kv"})
    first = plan.partitions[0].name
    only_first = by_partition[first].difference(*(nodes for name, nodes in by_partition.items() if name != first))
    assert only_first  # the Thinker: no later partition calls it
    engine = _Recording(SimEngine(plan))
    requests = [Request(id=f"r{i}", prompt_tokens=[1 + i, 2, 3], max_tokens=4 + i) for i in range(6)]
    _, records = _run(engine, requests, concurrency=3)
    assert all(r.finish_reason in ("stop", "length") for r in records.values())
    for request in requests:
        ended = [c for c in engine.calls if c[1] == request.id]
        # before the request ends, each node once, those among them (the Talker too: Code2Wav runs on)
        early = [c[2] for c in ended[:-1]]
        assert ended[-1] == ("end_request", request.id) and len(set(early)) == len(early)
        assert set(only_first) <= set(early) and all(engine.pages_after[(request.id, node)] == 0 for node in early)


def test_ending_a_node_early_changes_no_output_and_frees_no_page_twice_on_a_tight_pool():
    """The torch engine on the CPU, a pool that holds about two requests: the same tokens and audio
    as when every node's memory is kept to the request's end, and nothing left held after."""
    requests = [Request(id=f"r{i}", prompt_tokens=[1 + i, 2, 3, 4], max_tokens=3 + i % 3) for i in range(5)]

    def outputs(is_early: bool):
        plan = load_plan(PLAN)
        engine = TorchEngine(plan, num_pages=6)
        driver = Driver(plan, engine)
        if not is_early:
            driver.conductor.partition_kv_nodes = {}
        driver.run(Workload(requests, closed_concurrency=3))
        records = driver.conductor.records
        assert all(r.finish_reason in ("stop", "length") for r in records.values())
        assert all(runner.pool.num_free_pages == runner.pool.num_pages
                   for runner in engine.runners.values() if hasattr(runner, "pool"))
        return {rid: [(e.modality, e.value.tolist() if isinstance(e.value, torch.Tensor) else e.value)
                      for e in record.emissions] for rid, record in records.items()}

    assert outputs(True) == outputs(False)


def test_an_engine_without_end_node_keeps_the_memory_to_the_requests_end(caplog):
    """An engine object of the caller's may predate end_node: nothing is logged as failed."""
    class Older:
        def __init__(self, inner):
            self.inner, self.caps = inner, inner.caps

        def __getattr__(self, name):
            if name == "end_node":
                raise AttributeError(name)
            return getattr(self.inner, name)

    plan = load_plan(PLAN)
    _, records = _run(Older(SimEngine(plan)), [Request(id="r", prompt_tokens=[1, 2, 3], max_tokens=4)])
    assert records["r"].finish_reason in ("stop", "length")
    assert not [r for r in caplog.records if "failed to release" in r.getMessage()]


@settings(max_examples=120 if os.environ.get("HYPOTHESIS_PROFILE") == "long" else 12, deadline=None)
@given(st.sampled_from(["qwen3_omni", "qwen3omni_2gpu", "orpheus", "bagel"]),
       st.lists(st.tuples(st.integers(1, 60), st.integers(1, 40)), min_size=1, max_size=14),
       st.integers(8, 40), st.integers(1, 6))
def test_tight_pools_of_multi_partition_plans_end_with_every_page_back(name, shapes, num_pages, clients):
    """Random requests on a tight pool (offloading where the plan has a host pool), memory freed per
    node as partitions end: every request ends, and every pool ends with all its pages free, nobody
    waiting or started, and nothing left on the host."""
    plan = load_plan(Path(__file__).resolve().parents[2] / "generated" / f"{name}.plan")
    engine = SimEngine(plan, num_pages=num_pages)
    driver = Driver(plan, engine)
    requests = [Request(id=f"r{i}", prompt_tokens=[1 + (i + j) % 97 for j in range(size)], max_tokens=out)
                for i, (size, out) in enumerate(shapes)]
    driver.run(Workload(requests, closed_concurrency=clients))
    reasons = [r.finish_reason or "" for r in driver.conductor.records.values()]
    assert len(reasons) == len(requests)
    assert all(r in ("stop", "length") or r.startswith("error: can never fit") for r in reasons), reasons
    for node, pool in engine.pools.items():
        assert pool.pages.num_free_pages == pool.num_pages, node
        assert not pool.admission.waiting and not pool.admission.budgets, node
        assert pool.offload is None or not pool.offload.offloaded, node


def test_a_request_cancelled_after_its_thinker_ended_frees_the_rest():
    """Cancelled while its Talker still holds pages and its Thinker's are freed already (end_node),
    or at its first delta, with both running: the end frees whatever is left."""
    import asyncio
    import time

    from mstar import LLM, SamplingParams

    async def cancel_when(llm, is_thinker_done: bool) -> dict:
        stream = llm.stream([1, 2, 3, 4], SamplingParams(max_tokens=60))
        seen: dict = {}
        async for delta in stream:
            pages = llm.engine.kv_pages()
            if delta.finish_reason is None and (pages["Thinker"][0] == 0) == is_thinker_done:
                seen = pages
                break
        await stream.aclose()
        return seen

    # paced to the wall clock, so each delta comes as its step ends and the pages read are the step's
    with LLM(str(PLAN), engine="sim", kv_pages=64, sim_pace=1.0) as llm:
        for is_thinker_done in (False, True):
            seen = asyncio.run(cancel_when(llm, is_thinker_done))
            assert seen and (seen["Thinker"][0] == 0) == is_thinker_done  # (the Talker held 4 pages then, unloaded)
            deadline = time.monotonic() + 10.0  # the cancel lands at the run loop's next step boundary
            while any(in_use for in_use, _ in llm.engine.kv_pages().values()) and time.monotonic() < deadline:
                time.sleep(0.01)
            assert all(in_use == 0 for in_use, _ in llm.engine.kv_pages().values()), llm.engine.kv_pages()


def test_rows_held_for_memory_try_again_when_a_node_is_freed():
    """Memory a request frees on a node before its end wakes the rows held for memory, as a
    request's end does (they waited out their backoff before): after every end_node a wake comes
    before the next step is launched. A tight Qwen3-Omni pool on the sim, where rows are held."""
    plan = load_plan(PLAN)
    engine = _Recording(SimEngine(plan, num_pages=24))
    events = engine.calls
    launch = engine.inner.launch

    def launching(step):
        events.append(("launch",))
        return launch(step)

    engine.launch = launching
    driver = Driver(plan, engine)
    for scheduler in driver.schedulers.values():
        wake = scheduler.wake_holds

        def waking(wake=wake):
            events.append(("wake",))
            wake()

        scheduler.wake_holds = waking
    requests = [Request(id=f"r{i}", prompt_tokens=[1 + i] * 60, max_tokens=8 + i % 4) for i in range(12)]
    driver.run(Workload(requests, closed_concurrency=6))
    assert all(r.finish_reason in ("stop", "length") for r in driver.conductor.records.values())
    assert sum(driver.log.num_held_rows) > 0  # rows were held for memory in this run
    kinds = [e[0] for e in events]
    assert "end_node" in kinds
    for index, kind in enumerate(kinds):
        if kind == "end_node":
            rest = kinds[index + 1:]
            next_launch = rest.index("launch") if "launch" in rest else len(rest)
            assert "wake" in rest[:next_launch], f"no wake after the end_node at event {index}"


def test_a_node_two_partitions_call_is_freed_only_when_both_have_ended():
    """A kv node called by a partition still running keeps the request's memory: here the Talker's
    partition is taken to call the Thinker too (no checked-in plan shares a node between
    partitions), so the Thinker's memory goes with the Talker's, once, after the Thinker ended."""
    plan = load_plan(PLAN)
    engine = _Recording(SimEngine(plan))
    driver = Driver(plan, engine)
    shared = dict(driver.conductor.partition_kv_nodes)
    assert shared["Thinker"] == {"Thinker"} and shared["Talker"] == {"Talker"}
    shared["Talker"] = frozenset({"Talker", "Thinker"})
    driver.conductor.partition_kv_nodes = shared
    requests = [Request(id=f"r{i}", prompt_tokens=[1 + i, 2, 3], max_tokens=4 + i) for i in range(4)]
    driver.run(Workload(requests, closed_concurrency=2))
    assert all(r.finish_reason in ("stop", "length") for r in driver.conductor.records.values())
    for request in requests:
        ended = [c for c in engine.calls if c[1] == request.id]
        assert ended == [("end_node", request.id, "Talker"), ("end_node", request.id, "Thinker"),
                         ("end_request", request.id)], ended
