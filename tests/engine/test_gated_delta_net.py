"""Gated delta-net layers carry their recurrent state across steps: a prompt then decode steps, or a
prompt in chunks, computes the same as one pass over the whole sequence; the recurrence agrees with
transformers' Qwen3.5 reference."""
import pytest
import torch

from engine_plans import hybrid_plan, step, with_worker
from mstar.compiler.lower_tables import tables_for
from mstar.compiler.walk_tree import TreeCall as CallPlan, TreeEdge as EdgePlan, WalkTree as WalkPlan
from mstar.plan.schema import OutputPlan
from mstar.runtime.engine.torch_engine import TorchEngine
from mstar.runtime.conductor.request import Request
from mstar.runtime.step import StepRow

SEQUENCE = [11, 3, 250, 77, 9, 140, 2, 33, 400, 5, 61, 18]


def states_plan():
    """The hybrid plan plus a walk `states` whose call returns every token's hidden state."""
    plan = hybrid_plan()
    walk = WalkPlan(name="states", partition="LLM", nodes=["LLM"], body=[CallPlan(
        node="LLM", inputs=["text_inputs"], edges=[EdgePlan(name="hidden_states", dest_kind="conductor")])])
    (table,) = tables_for([walk], plan.partitions, plan.nodes, [])
    (node,) = plan.nodes
    node = node.model_copy(update={"outputs": node.outputs + [OutputPlan(name="hidden_states", role="hidden")]})
    return with_worker(plan.model_copy(update={"walks": plan.walks + [table], "nodes": [node]}))


def run_chunks(chunks):
    engine = TorchEngine(states_plan())
    engine.add_request("r", Request(id="r", prompt_tokens=SEQUENCE, max_tokens=4))
    outs = []
    for chunk in chunks:
        rows = [StepRow("r", "states", len(chunk), 0, {"text_inputs": chunk})]
        result = engine.run_step(step(engine.plan, "LLM", rows))
        outs.append(result.rows[0].outputs["hidden_states"])
    return torch.cat(outs), engine


def test_prefill_then_decode_equals_one_pass():
    whole, _ = run_chunks([SEQUENCE])
    split, _ = run_chunks([SEQUENCE[:8]] + [[t] for t in SEQUENCE[8:]])
    torch.testing.assert_close(split, whole, atol=1e-5, rtol=1e-5)


def test_chunked_prefill_equals_one_pass():
    whole, _ = run_chunks([SEQUENCE])
    split, _ = run_chunks([SEQUENCE[:5], SEQUENCE[5:7], SEQUENCE[7:]])
    torch.testing.assert_close(split, whole, atol=1e-5, rtol=1e-5)


def test_state_lives_in_the_request_slot_and_is_zeroed_for_a_new_request():
    _, engine = run_chunks([SEQUENCE[:4]])
    runner = engine.runners["LLM"]
    slot = runner.slots.slot_of("r")
    assert slot != 0 and runner.states.ssm[0][slot].abs().sum() > 0
    assert runner.states.ssm[0][0].abs().sum() == 0  # the sink slot is untouched
    engine.end_request("r")
    engine.add_request("s", Request(id="s", prompt_tokens=SEQUENCE, max_tokens=4))
    fresh = engine.run_step(step(engine.plan, "LLM", [StepRow("s", "states", 12, 0, {"text_inputs": SEQUENCE})]))
    whole, _ = run_chunks([SEQUENCE])
    assert runner.slots.slot_of("s") == slot  # the freed slot is reused ...
    torch.testing.assert_close(fresh.rows[0].outputs["hidden_states"], whole)  # ... from zero


def test_recurrence_matches_transformers_reference():
    qwen = pytest.importorskip("transformers.models.qwen3_5.modeling_qwen3_5")
    from mstar.runtime.engine.models.gdn import GatedDeltaNet

    torch.manual_seed(0)
    layer = GatedDeltaNet(hidden=32, num_heads=2, key_dim=8, value_dim=8, conv_kernel=4, eps=1e-6)
    cols = torch.randn(6, layer.conv_dim)
    g, beta = -torch.rand(6, 2), torch.rand(6, 2)
    state = torch.zeros(1, 2, 8, 8)
    ours = layer._recur(cols, g, beta, state, 0)
    q = cols[:, :16].view(1, 6, 2, 8)
    k = cols[:, 16:32].view(1, 6, 2, 8)
    v = cols[:, 32:].view(1, 6, 2, 8)
    theirs, final = qwen.torch_recurrent_gated_delta_rule(q, k, v, g[None], beta[None], initial_state=None,
                                                         output_final_state=True, use_qk_l2norm_in_kernel=True)
    torch.testing.assert_close(ours, theirs[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(state[0], final[0], atol=1e-5, rtol=1e-5)
