"""Chunked prefill under a step token budget (KeyPlan.token_budget, KeyPlan.chunk_sizes).

- a prompt cut into chunks gives the same greedy tokens as the prompt fed whole (torch, CPU, fp32);
- no step passes its key's token budget (a single row that cannot be cut excepted), every prompt
  is fed exactly once, chunk by chunk, and its request samples only after its last chunk (sim);
- the budget keeps decode rows in the step: a prompt takes only the room they leave.
Hypothesis runs a few examples by default and many more under `HYPOTHESIS_PROFILE=long`.
"""
from __future__ import annotations

import os

from hypothesis import given, settings, strategies as st

from mstar.plan.schema import Plan
from mstar.runtime.conductor.request import Request
from mstar.runtime.engine.sim import SimEngine
from mstar.runtime.engine.torch_engine import TorchEngine
from mstar.runtime.serve.driver import Driver, Workload
from runtime_plans import generated

IS_LONG = os.environ.get("HYPOTHESIS_PROFILE") == "long"


def with_chunking(plan: Plan, budget: int | None, chunk: int | None) -> Plan:
    """The plan with every kv key's budget and its prompt walk's chunk size replaced."""
    workers = []
    for worker in plan.workers:
        keys = [key.model_copy(update={
            "token_budget": budget,
            "chunk_sizes": {walk: chunk for walk in key.walks if walk == "prefill"} if chunk else {},
        }) for key in worker.keys]
        workers.append(worker.model_copy(update={"keys": keys}))
    return plan.model_copy(update={"workers": workers})


def run(plan: Plan, engine, requests: list[Request], concurrency: int) -> Driver:
    driver = Driver(plan, engine)
    driver.run(Workload(requests, closed_concurrency=concurrency))
    return driver


def tokens_of(driver: Driver) -> dict[str, list[int]]:
    return {rid: list(r.output_tokens) for rid, r in driver.conductor.records.items()}


@settings(max_examples=200 if IS_LONG else 4)
@given(st.lists(st.lists(st.integers(0, 4000), min_size=1, max_size=40), min_size=1, max_size=4),
       st.integers(1, 12), st.integers(6, 40), st.integers(1, 4))
def test_chunked_prompt_gives_the_tokens_of_the_whole_prompt(prompts, chunk, budget, concurrency):
    plan = generated("llama")
    requests = [Request(id=f"r{i}", prompt_tokens=p, max_tokens=4) for i, p in enumerate(prompts)]
    whole = tokens_of(run(plan, TorchEngine(plan, dims="tiny"), requests, concurrency))
    cut_plan = with_chunking(plan, max(budget, chunk, concurrency), chunk)
    cut = tokens_of(run(cut_plan, TorchEngine(cut_plan, dims="tiny"), requests, concurrency))
    assert cut == whole
    assert all(len(t) == 4 for t in cut.values())


@settings(max_examples=300 if IS_LONG else 25)
@given(st.lists(st.integers(1, 3000), min_size=1, max_size=30), st.integers(1, 600), st.integers(64, 1200),
       st.integers(1, 40), st.booleans())
def test_no_step_passes_its_token_budget_and_every_prompt_is_fed_once(lengths, chunk, budget, concurrency, is_spec):
    plan = with_chunking(generated("llama" if is_spec else "llama_chunked"), max(budget, chunk), chunk)
    budget = max(budget, chunk)
    requests = [Request(id=f"r{i}", prompt_tokens=[7] * n, max_tokens=3) for i, n in enumerate(lengths)]
    driver = run(plan, SimEngine(plan), requests, concurrency)
    log = driver.log
    for num_rows, num_tokens in zip(log.num_rows, log.num_tokens):
        assert num_tokens <= budget or num_rows == 1
    for record in driver.conductor.records.values():
        assert record.finish_reason == "length", record.finish_reason
        assert len(record.output_tokens) == 3
    # each prompt once (less what a prefix cache held), then 2 decode tokens
    num_cached = sum(r.num_cached_tokens for r in driver.conductor.records.values())
    assert sum(log.num_tokens) + num_cached == sum(lengths) + 2 * len(lengths)


def test_decode_rows_keep_their_place_beside_a_long_prompt():
    """40 decode rows and one 8192-token prompt under a 512-token budget: every step holds every
    decode row; the prompt advances by the room left (472 tokens a step, fewer at depth: the plan's
    budget counts a chunk token after c tokens of KV as 1 + c / N) and samples once."""
    plan = generated("llama_chunked")
    scale = plan.workers[0].keys[0].chunk_context_scale
    assert scale, "llama_chunked's budget counts context (budget_counts_context defaults on)"
    requests = [Request(id=f"d{i}", prompt_tokens=[5] * 16, max_tokens=300) for i in range(40)]
    requests.append(Request(id="long", prompt_tokens=[9] * 8192, max_tokens=2))
    driver = Driver(plan, SimEngine(plan))
    driver.run(Workload(requests, closed_concurrency=41))
    log = driver.log
    assert all(n <= 512 for n in log.num_tokens)
    # once the short prompts are in, every step of the long one holds all 40 decode rows
    prompt_steps = [i for i, rows in enumerate(log.walk_rows) if rows == {"prefill": 1, "decode": 40}]
    assert len(prompt_steps) >= 8192 // 512
    chunks = [log.num_tokens[i] - 40 for i in prompt_steps]
    depth = 8192 - sum(chunks)  # its first chunk shared a step with the short prompts
    for chunk in chunks:
        assert chunk == min(8192 - depth, max(1, 472 * scale // (scale + depth)))  # the driver told its depth
        depth += chunk
    assert driver.conductor.records["long"].finish_reason == "length"
