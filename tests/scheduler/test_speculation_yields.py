"""When a speculative chain yields (docs/runtime.md "Speculation"), where the suite held nothing (a
mutation audit): to a TP leader batch queued here, and to a fresh row its next step would leave out."""
from mstar.plan.schema import DeploymentPlan, SpeculationPlan, TPGroup
from mstar.runtime.scheduler.scheduler import WorkerScheduler

from plan_factory import assemble_worker, build_key


def test_a_chain_yields_to_a_ready_follower_batch():
    """A chain on a local key while a TP leader's batch waits here with its rows ready: the chain
    yields (it stalled the group's other ranks, past the starvation bound)."""
    tp = build_key("LLM", ["decode"], {"decode": 4})
    local = build_key("codec", ["chunk"], {"chunk": 4})
    group = TPGroup(node="LLM", walks=["decode"], ranks=[0, 1], tp_size=2, sp_size=1, leader=0)
    deployment = DeploymentPlan(max_seq_len=4096, kv_pools=[], max_consecutive_follower_batches=1)
    speculation = [SpeculationPlan(node="codec", walk="chunk", can_speculate=True, mixes_walks=False)]
    leader = WorkerScheduler(assemble_worker(0, [tp, local], [], [group]), deployment, clock=lambda: 0.0)
    follower = WorkerScheduler(assemble_worker(1, [tp, local], speculation, [group]), deployment, clock=lambda: 0.0)
    follower.add_ready("c", "codec", "chunk")
    running = follower.next_batch()
    assert running.key == local.name
    leader.add_ready("a", "LLM", "decode")
    follower.register_follow(leader.next_batch())
    follower.add_ready("a", "LLM", "decode")
    assert follower.speculate(running, ["c"]) is None
    assert follower.next_batch().is_follower


def test_a_chain_past_a_chunk_step_yields_to_a_fresh_row_its_cap_leaves_out():
    """N holds d0..d2 and a chunk of p (mixed cap 4); d3 arrives while N runs: N+1 (d0..d2 and p's
    next chunk) would leave d3 waiting behind it, so the chain yields."""
    key = build_key("LLM", ["decode", "prefill"], {"decode": 8, "prefill": 4}, "mixed", 4, {},
                    mixed_capture=([1, 4], [16, 64]))
    key = key.model_copy(update={"token_budget": 16, "chunk_sizes": {"prefill": 16}})
    speculation = [SpeculationPlan(node="LLM", walk="decode", can_speculate=True, mixes_walks=True),
                   SpeculationPlan(node="LLM", walk="prefill", can_speculate=False, mixes_walks=False)]
    scheduler = WorkerScheduler(assemble_worker(0, [key], speculation, []),
                                DeploymentPlan(max_seq_len=4096, kv_pools=[]), lambda: 0.0)
    for i in range(3):
        scheduler.add_ready(f"d{i}", "LLM", "decode", 1)
    scheduler.add_ready("p", "LLM", "prefill", 40)
    step = scheduler.next_batch()
    assert list(zip(step.request_ids, step.num_tokens)) == [("d0", 1), ("d1", 1), ("d2", 1), ("p", 13)]
    scheduler.add_ready("d3", "LLM", "decode", 1)
    assert scheduler.speculate(step, ["d0", "d1", "d2"], cut=[("p", 27)]) is None
