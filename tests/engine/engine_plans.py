"""Hand-built plans and a tiny step driver for the engine tests (no compiler needed).

`llm_plan()` is a one-node Llama plan (prefill -> decode loop); `hybrid_plan()` the same with a
gated delta-net layer pattern; `generate()` drives an engine the way the conductor would: each step
holds the prompt chunk of every newly started request and one decode row per running one.
`with_worker(plan)` gives a plan one worker with an eager key per node over every walk calling it
(one-walk steps on decode kernels for a walk that loops a token back into the node on the device,
else prefill; mixed steps packed); `step(plan, node, rows)` is the step of those rows under it.
"""
from __future__ import annotations

from typing import Optional

from plan_roles import node_plan
from mstar.compiler.lower_tables import tables_for
from mstar.compiler.walk_tree import TreeCall as CallPlan, TreeEdge as EdgePlan, TreeLoop as LoopPlan
from mstar.compiler.walk_tree import WalkTree as WalkPlan
from mstar.plan.schema import (
    DeploymentPlan, Hashes, Header, KeyPlan, KvPoolPlan, MixtureEntry, NodePlan, PartitionPlan, Plan,
    RecurrentState, StagePlan, WorkerPlan,
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
    """`walks` are section trees, lowered here into walk tables (a call runs on rank 0)."""
    plan = with_worker(Plan(header=header(model), params={}, nodes=nodes,
                            walks=tables_for(walks, partitions, nodes, []), partitions=partitions,
                            deployment=DeploymentPlan(max_seq_len=4096, max_concurrent_requests=max_concurrent,
                                                      kv_pools=kv_pools), workers=[]))
    return plan.model_copy(update={"walks": tables_for(walks, partitions, nodes, plan.workers)})


def _attention(node: NodePlan, walk) -> str:
    if node.engine == "stateless":
        return "none"
    loops_back = any(e.is_device and e.action == "loop_back" and e.dest == node.name
                     for call in walk.calls for e in call.edges)
    return "decode" if loops_back else "prefill"


def with_worker(plan: Plan, cap: int = 4096) -> Plan:
    keys, walk_to_key = [], {}
    for node in plan.nodes:
        walks = [w for w in plan.walks if any(call.node == node.name for call in w.calls)]
        if not walks:
            continue
        name = f"{node.name}:all"
        mixtures = [MixtureEntry(mask=0, walks=[], cap=0, attention="none")]
        for mask in range(1, 1 << len(walks)):
            present = [w for i, w in enumerate(walks) if mask >> i & 1]
            single = len(present) == 1
            attention = _attention(node, present[0]) if single else ("none" if node.engine == "stateless" else "packed")
            mixtures.append(MixtureEntry(mask=mask, walks=[w.name for w in present], cap=cap,
                                         label=present[0].name if single else None, attention=attention))
        keys.append(KeyPlan(name=name, node=node.name, walks=[w.name for w in walks], is_combined=len(walks) > 1,
                            mixtures=mixtures))
        walk_to_key.update({f"{node.name}/{w.name}": name for w in walks})
    worker = WorkerPlan(rank=0, placements=sorted(walk_to_key), walk_to_key=walk_to_key, keys=keys,
                        speculation=[], tp_groups=[], capture_memory_bytes=0)
    return plan.model_copy(update={"workers": [worker]})


def llm_plan(dims: Optional[dict] = None, num_pages: int = 64, page_size: int = 16,
             recurrent: Optional[RecurrentState] = None, max_concurrent: Optional[int] = None) -> Plan:
    node = node_plan("LLM", "kv", llm_walks(), dims=dims or LLM_DIMS, inputs=["text_inputs"], recurrent=recurrent)
    partition = PartitionPlan(name="LLM", stages=[StagePlan(walks=["prefill"]), StagePlan(walks=["decode"])],
                              initial_walk="prefill")
    return make_plan([node], llm_walks(), [partition],
                     [KvPoolPlan(node="LLM", page_size=page_size, num_pages=num_pages, max_seq_len=4096)],
                     max_concurrent=max_concurrent)


def hybrid_plan(num_slots: int = 9, num_pages: int = 64) -> Plan:
    dims = dict(LLM_DIMS, layers=4, layer_pattern=[0, 0, 0, 1])
    recurrent = RecurrentState(num_layers=3, num_heads=2, key_dim=16, value_dim=16, num_slots=num_slots)
    return llm_plan(dims, num_pages=num_pages, recurrent=recurrent)


def step(plan: Plan, node: str, rows: list[StepRow]) -> Step:
    """The eager step of `rows` (walks of `node`) under the plan's key for them, on the first worker
    that runs them all."""
    for worker in plan.workers:
        names = {worker.walk_to_key.get(f"{node}/{row.walk}") for row in rows}
        key = next((k for k in worker.keys if {k.name} == names), None)
        if key is not None:
            mask = 0
            for row in rows:
                mask |= 1 << key.walks.index(row.walk)
            entry = key.mixtures[mask]
            return Step(worker=worker.rank, key=key.name, node=node, mask=mask, label=entry.label, rows=rows,
                        attention=entry.attention)
    raise AssertionError(f"no worker of the plan runs {node} for walks {sorted({r.walk for r in rows})}")


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
        result = engine.run_step(step(engine.plan, node, rows)) if rows else None
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


def chunked_plan(plan: Plan, prompt_walk: str, budget: int) -> Plan:
    """`plan` with every key's step token budget `budget` and `prompt_walk`'s prompts cut in chunks
    of `budget` tokens (0: `plan` as it is)."""
    if not budget:
        return plan
    workers = [w.model_copy(update={"keys": [k.model_copy(update={"token_budget": budget,
                                                                  "chunk_sizes": {prompt_walk: budget}})
                                             for k in w.keys]}) for w in plan.workers]
    return plan.model_copy(update={"workers": workers})


def held_row_tokens(engine, prefill_walk: str, launch_ahead: bool) -> list[list[int]]:
    """Requests a and b of `engine`'s LLM decode; with `launch_ahead` a step is launched ahead for
    both, then the run loop runs b alone (a held: its request goes on), then both, twice. Each
    step's tokens: a's must not see the step launched ahead (its KV write past the sequence is
    overwritten, a hybrid's state copy undone)."""
    from mstar.runtime.conductor.request import Request

    engine.add_request("a", Request(id="a", prompt_tokens=[4, 5, 6], max_tokens=20))
    engine.add_request("b", Request(id="b", prompt_tokens=[8, 2], max_tokens=20))

    def run(walk: str, rows: list[StepRow]) -> list[int]:
        worker = engine.plan.workers[0]
        key = next(k for k in worker.keys if k.name == worker.walk_to_key[f"LLM/{walk}"])
        mask = next(m for m, entry in enumerate(key.mixtures) if entry and entry.walks == [walk])
        entry = key.mixtures[mask]
        result = engine.wait(engine.launch(Step(0, key.name, "LLM", mask, entry.label, rows, entry.attention)))
        assert all(row.error is None for row in result.rows), result.rows
        return [int(row.outputs["new_token"][0]) for row in result.rows]

    tokens = [run(prefill_walk, [StepRow("a", prefill_walk, 3, 0, {"text_inputs": [4, 5, 6]}),
                                 StepRow("b", prefill_walk, 2, 0, {"text_inputs": [8, 2]})])]
    both = [StepRow("a", "decode", 1, 0, {}), StepRow("b", "decode", 1, 0, {})]
    tokens.append(run("decode", both))
    if launch_ahead:  # the run loop speculates a and b; then only b runs
        runner = engine.runners["LLM"]
        num_ahead = runner.num_ahead_rows
        engine.launch_ahead(0, "LLM", [("a", "decode"), ("b", "decode")])
        assert runner.num_ahead_rows == num_ahead + 2
    tokens.append(run("decode", [StepRow("b", "decode", 1, 0, {})]))
    return tokens + [run("decode", both), run("decode", both)]
