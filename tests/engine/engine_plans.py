"""Hand-built plans and a tiny step driver for the engine tests (no compiler needed).

`llm_plan()` is a one-node Llama plan (prefill -> decode loop); `hybrid_plan()` the same with a
gated delta-net layer pattern; `generate()` drives an engine the way the conductor would: each step
holds the prompt chunk of every newly started request and one decode row per running one.
"""
from __future__ import annotations

from typing import Optional

from mstar.plan.schema import (
    CallPlan, DeploymentPlan, EdgePlan, Hashes, Header, KvPoolPlan, LoopPlan, NodePlan,
    PartitionPlan, Plan, RecurrentState, StagePlan, WalkPlan,
)
from mstar.runtime.step import Step, StepRow

HOLD_STEPS = 3
LLM_DIMS = {"layers": 2, "kv_heads": 2, "qo_heads": 4, "head_dim": 16, "hidden": 64, "vocab": 512,
            "intermediate": 128}


def header(model: str) -> Header:
    return Header(compiler_version="test", model=model, deployment=model, spec_path=f"specs/{model}.mw",
                  deployment_path=f"configs/{model}.yaml", glue_path="", hashes=Hashes(spec="", deployment="", glue=""))


def llm_walks(node: str = "LLM", max_iters: int = 64) -> list[WalkPlan]:
    prefill = WalkPlan(name="prefill", partition=node, nodes=[node], body=[CallPlan(
        node=node, inputs=["text_inputs"],
        edges=[EdgePlan(name="new_token", dest_kind="conductor", is_persist=True, is_count_tokens=True)])])
    loop_back = EdgePlan(name="text_inputs", dest_kind="node", dest=node, is_device=True, is_loop_back=True)
    decode = WalkPlan(name="decode", partition=node, nodes=[node], body=[LoopPlan(
        name="decode_loop", max_iters=max_iters, has_stop=True, nodes=[node], loop_back=[loop_back],
        is_on_device=True, outputs=[], accumulate=[], body=[CallPlan(
            node=node, inputs=["text_inputs"],
            edges=[loop_back, EdgePlan(name="new_token", dest_kind="client", modality="text")])])])
    return [prefill, decode]


def make_plan(nodes: list[NodePlan], walks: list[WalkPlan], partitions: list[PartitionPlan],
              kv_pools: list[KvPoolPlan], model: str = "test", max_concurrent: Optional[int] = None) -> Plan:
    return Plan(header=header(model), params={}, nodes=nodes, walks=walks, partitions=partitions,
                deployment=DeploymentPlan(max_seq_len=4096, max_concurrent_requests=max_concurrent,
                                          kv_pools=kv_pools), workers=[])


def llm_plan(dims: Optional[dict] = None, num_pages: int = 64, page_size: int = 16,
             recurrent: Optional[RecurrentState] = None, max_concurrent: Optional[int] = None) -> Plan:
    node = NodePlan(name="LLM", engine="kv", dims=dims or LLM_DIMS, inputs=["text_inputs"], recurrent=recurrent)
    partition = PartitionPlan(name="LLM", stages=[StagePlan(walks=["prefill"]), StagePlan(walks=["decode"])],
                              initial_walk="prefill")
    return make_plan([node], llm_walks(), [partition],
                     [KvPoolPlan(node="LLM", page_size=page_size, num_pages=num_pages, max_seq_len=4096)],
                     max_concurrent=max_concurrent)


def hybrid_plan(num_slots: int = 9, num_pages: int = 64) -> Plan:
    dims = dict(LLM_DIMS, layers=4, layer_pattern=[0, 0, 0, 1])
    recurrent = RecurrentState(num_layers=3, num_heads=2, key_dim=16, value_dim=16, num_slots=num_slots)
    return llm_plan(dims, num_pages=num_pages, recurrent=recurrent)


def step(node: str, rows: list[StepRow]) -> Step:
    return Step(worker=0, key=f"{node}:mixed", node=node, mask=0, label=None, rows=rows, attention="split")


def generate(engine, prompts: dict[str, list[int]], max_tokens: int, start_every: int = 0,
             node: str = "LLM") -> dict[str, list[int]]:
    """Greedy-run every prompt to `max_tokens` tokens; request i starts at step i * start_every.

    Rows named in allocation_failed did not run and sit out a few steps (the scheduler's hold);
    the other rows ran (partial steps, the default) or, with an all-or-nothing engine, are
    retried at once. Stops a request
    at its stop flag or at max_tokens.
    """
    from mstar.runtime.conductor.request import Request

    tokens: dict[str, list[int]] = {rid: [] for rid in prompts}
    waiting = list(prompts)
    running: set[str] = set()
    for rid in prompts:
        reason = engine.add_request(rid, Request(id=rid, prompt_tokens=prompts[rid], max_tokens=max_tokens))
        assert reason is None, reason
    # Rows that failed allocation sit out HOLD_STEPS steps (the scheduler's timed hold); with a
    # one-step hold, two unstartable newcomers could take turns failing every step forever.
    held_until: dict[str, int] = {}
    for step_index in range(10_000):
        rows = []
        for i, rid in enumerate(waiting):
            if i * start_every <= step_index and held_until.get(rid, -1) < step_index:
                rows.append(StepRow(rid, "prefill", len(prompts[rid]), 0, {"text_inputs": prompts[rid]}))
        for rid in sorted(r for r in running if held_until.get(r, -1) < step_index):
            rows.append(StepRow(rid, "decode", 1, 0, {"text_inputs": [tokens[rid][-1]]}))
        if not waiting and not running:
            return tokens
        result = engine.run_step(step(node, rows)) if rows else None
        if result is None:
            continue
        held_until.update({rid: step_index + HOLD_STEPS for rid in result.allocation_failed})
        for row in result.rows:
            assert row.error is None, row.error
            tokens[row.request_id].append(row.outputs["new_token"][0])
            if row.request_id in waiting:
                waiting.remove(row.request_id)
                running.add(row.request_id)
            if row.is_stop or len(tokens[row.request_id]) >= max_tokens:
                running.discard(row.request_id)
                engine.end_request(row.request_id)
    raise AssertionError("generate did not finish")
