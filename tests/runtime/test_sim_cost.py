"""The simulated engine's roofline (engine/sim_cost.py): its figures stay near the H200 measurements
it was calibrated to (docs/engine.md, Llama-3.2-1B shape), decode rows beside a prompt chunk cost
little, and a node whose plan lacks dims falls back to the reference node scaled by its weight."""
import dataclasses
from pathlib import Path

import pytest

from mstar.plan.io import load_plan
from mstar.runtime.engine import sim_cost
from mstar.runtime.engine.sim import SimEngine
from mstar.runtime.engine.sim_cost import StepCost, node_cost
from mstar.runtime.step import Step, StepRow

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def plan():
    return load_plan(ROOT / "generated" / "llama_chunked.plan", verify=False)


def decode_rows(num: int, context: int) -> list[StepRow]:
    return [StepRow(f"d{i}", "decode", 1, context) for i in range(num)]


def decode_step(rows: list[StepRow], padded_batch: int) -> Step:
    return Step(worker=0, key="LLM:mixed", node="LLM", mask=1, label="decode", rows=rows, attention="decode",
                capture="LLM:decode", padded_batch=padded_batch)


def mixed_step(rows: list[StepRow], token_bucket: int) -> Step:
    return Step(worker=0, key="LLM:mixed", node="LLM", mask=3, label=None, rows=rows, attention="packed",
                capture="LLM:mixed", padded_batch=64, token_bucket=token_bucket)


def test_the_llama_shape_has_its_parameters_and_kv_bytes(plan):
    cost = node_cost(plan.nodes[0])
    assert not cost.is_fallback
    # 16 layers of q, k, v, o (2048 wide, 8 KV heads of 64) and a 2048 x 8192 SwiGLU; a 128256-word head.
    assert cost.layer_params == 16 * (2 * 2048 * 2048 + 2 * 2048 * 512 + 3 * 2048 * 8192)
    assert cost.lm_head_params == 128256 * 2048
    assert cost.kv_bytes_per_token == 16 * 2 * 512 * 2  # K and V, bf16, every layer
    assert cost.flops_per_key == 4 * 2048 * 16


# the decode graphs' replays on the H200 after RoPE became one program a token (docs/engine.md)
@pytest.mark.parametrize("num_rows, replay_ms", [(1, 0.996), (8, 1.096), (64, 1.629)])
def test_decode_steps_are_near_the_measured_replays(plan, num_rows, replay_ms):
    seconds = StepCost(plan).seconds(decode_step(decode_rows(num_rows, 1024), num_rows))
    assert seconds * 1e3 == pytest.approx(replay_ms, rel=0.1)


def _mixed_family_piecewise(plan):
    """The plan as specs/llama.mw had it when the piecewise kernels below were measured: the mixed
    family captured piecewise (it is captured whole now)."""
    def family(f):
        return f.model_copy(update={"is_piecewise": True}) if f.name == "LLM:mixed" else f

    workers = [w.model_copy(update={"keys": [k.model_copy(update={"captures": [family(f) for f in k.captures]})
                                             for k in w.keys]}) for w in plan.workers]
    return plan.model_copy(update={"workers": workers})


@pytest.mark.parametrize("context, kernels_ms", [(0, 2.37), (4096, 3.29), (7936, 4.39)])
def test_a_piecewise_chunk_step_is_near_the_measured_kernels(plan, context, kernels_ms):
    rows = decode_rows(40, 1180) + [StepRow("p", "prefill", 216, context)]
    seconds = StepCost(_mixed_family_piecewise(plan)).seconds(mixed_step(rows, 256))
    assert seconds * 1e3 == pytest.approx(kernels_ms, rel=0.12)


@pytest.mark.parametrize("context, kernels_ms", [(0, 2.24), (4096, 2.64), (7936, 3.10)])
def test_a_whole_graph_split_chunk_step_is_near_the_measured_kernels(plan, context, kernels_ms):
    """The plan's mixed family captured whole on the split route (`mstar bench engine`'s chunk steps'
    kernels on the H200 with the route on Triton kernels and the prefill kernel's grid and tiles for
    the key, docs/engine.md "The split route on Triton"): the roofline, the prompt rows at the Triton
    prefill kernel's rate, plus its merge."""
    rows = decode_rows(40, 1180) + [StepRow("p", "prefill", 216, context)]
    step = dataclasses.replace(mixed_step(rows, 256), attention="split")
    assert StepCost(plan).seconds(step) * 1e3 == pytest.approx(kernels_ms, rel=0.2)


def test_decode_rows_beside_a_chunk_cost_a_fraction_of_their_own_step(plan):
    cost = StepCost(plan)
    chunk = StepRow("p", "prefill", 472, 4096)
    alone = cost.seconds(mixed_step([chunk], 512))
    beside = cost.seconds(mixed_step(decode_rows(40, 64) + [chunk], 512))
    decode_alone = cost.seconds(decode_step(decode_rows(40, 64), 64))
    # The weights are read once a step: 40 decode rows add their KV reads and 40 tokens of matrix
    # products to a chunk step, far less than a decode step of their own.
    assert 0 < beside - alone < 0.1 * decode_alone


def test_context_costs_time_and_a_causal_prompt_halves_its_own_keys(plan):
    cost = StepCost(plan)
    short = cost.seconds(mixed_step([StepRow("p", "prefill", 472, 1024)], 512))
    long = cost.seconds(mixed_step([StepRow("p", "prefill", 472, 8192)], 512))
    # The plan's packed family is captured whole and the Triton kernels serve Llama's heads: the
    # prompt attends on the Triton prefill kernel, at its rate.
    assert cost.nodes["LLM"].is_triton_served
    rate = sim_cost.TRITON_PREFILL_RATE
    flops_s = 472 * 7168 * cost.nodes["LLM"].flops_per_key / rate
    assert long - short == pytest.approx(flops_s)  # compute-bound: the extra keys at the attention rate
    bidirectional = StepCost(plan.model_copy(update={"nodes": [plan.nodes[0].model_copy(
        update={"bidirectional_walks": ["prefill"]})]}))
    step = mixed_step([StepRow("p", "prefill", 472, 0)], 512)
    extra_keys = 472 * 472 - 472 * 473 // 2
    assert bidirectional.seconds(step) - cost.seconds(step) == pytest.approx(
        extra_keys * cost.nodes["LLM"].flops_per_key / rate)


def test_padding_rows_run_the_matrix_products(plan):
    cost = StepCost(plan)
    rows = [StepRow("p", "prefill", 300, 0)]
    assert cost.seconds(mixed_step(rows, 1024)) > cost.seconds(mixed_step(rows, 384))


def test_missing_dims_fall_back_to_the_reference_node_scaled_by_weight(plan):
    node = plan.nodes[0]
    half = node_cost(node.model_copy(update={"dims": {"layers": 14, "hidden": 3072}}))
    reference = node_cost(node.model_copy(update={"dims": {}}))
    assert half.is_fallback and reference.is_fallback
    assert reference.layer_params == node_cost(node.model_copy(update={"dims": sim_cost.REFERENCE_DIMS})).layer_params
    assert half.layer_params == pytest.approx(reference.layer_params / 2)
    assert half.kv_bytes_per_token == pytest.approx(reference.kv_bytes_per_token / 2)
    # Only `intermediate` missing: the torch engine's default, 4 x hidden.
    dims = {k: v for k, v in node.dims.items() if k != "intermediate"}
    no_mlp_width = node_cost(node.model_copy(update={"dims": dims}))
    assert not no_mlp_width.is_fallback
    assert no_mlp_width.layer_params - node_cost(node).layer_params == 16 * 3 * 2048 * (4 * 2048 - 8192)


def test_a_hybrid_node_keeps_kv_only_on_its_full_layers(plan):
    node = plan.nodes[0]
    hybrid = node_cost(node.model_copy(update={"dims": {**node.dims, "layer_pattern": [0, 0, 0, 1]}}))
    assert hybrid.kv_bytes_per_token == node_cost(node).kv_bytes_per_token / 4
    assert hybrid.layer_params == node_cost(node).layer_params


def test_the_engine_charges_the_model(plan):
    step = decode_step(decode_rows(3, 100), 4)
    assert SimEngine(plan).step_time(step) == StepCost(plan).seconds(step)


def test_a_decode_step_is_the_formula_of_the_docstring(plan):
    cost = StepCost(plan)
    node = cost.nodes["LLM"]
    rows = decode_rows(5, 300) + [StepRow("x", "decode", 1, 2000)]
    step = decode_step(rows, 8)  # two padding rows
    keys = 5 * 301 + 2001
    attention = max(keys * node.kv_bytes_per_token / sim_cost.DECODE_KV_BANDWIDTH,
                    keys * node.flops_per_key / sim_cost.ATTENTION_RATE)
    mem = node.weight_bytes / sim_cost.WEIGHT_READ_BANDWIDTH
    compute = 2 * (node.layer_params * 8 + node.lm_head_params * 8) / sim_cost.MATMUL_RATE
    assert mem > compute  # a decode step is bound by its bytes
    expected = sim_cost.CAPTURED_LAUNCH_S + mem + sim_cost.RIDGE_LOSS * compute + attention
    assert cost.seconds(step) == pytest.approx(expected)
    # The same rows, one of them feeding two tokens, take the per-row path: one more token's work.
    two = [StepRow("d0", "decode", 2, 300)] + rows[1:]
    assert cost.seconds(decode_step(two, 8)) > cost.seconds(step)


def test_only_a_decode_graph_of_served_heads_reads_at_the_triton_rate(plan):
    """A decode graph's replay reads its KV at the Triton decode kernel's rate; the same rows run
    eagerly (no padded batch) or on heads the kernel does not serve (a group of 20 query heads, on
    FlashInfer) read at FlashInfer's."""
    rows = decode_rows(64, 1024)
    graph, eager = decode_step(rows, 64), decode_step(rows, 0)
    keys_bytes = 64 * 1025 * node_cost(plan.nodes[0]).kv_bytes_per_token
    cost = StepCost(plan)
    eager_gap = cost.seconds(eager) - cost.launch(eager) - (cost.seconds(graph) - cost.launch(graph))
    assert eager_gap == pytest.approx(keys_bytes / sim_cost.READ_BANDWIDTH - keys_bytes / sim_cost.DECODE_KV_BANDWIDTH)
    node = plan.nodes[0]
    wide = node.model_copy(update={"dims": {**node.dims, "qo_heads": 160, "kv_heads": 8, "head_dim": 64}})
    assert node_cost(wide).decode_kv_bandwidth == sim_cost.READ_BANDWIDTH
    assert node_cost(node).decode_kv_bandwidth == sim_cost.DECODE_KV_BANDWIDTH


def test_a_whole_packed_step_attends_on_triton_only_where_it_serves_the_heads(plan):
    """A whole packed family's replay: on heads the Triton kernels serve, its prompt tokens attend
    at the Triton prefill kernel's rate with its merge a layer; on heads they do not serve (a group
    of 20 query heads), on FlashInfer's graph-mode prefill at ATTENTION_RATE with its split-KV merge."""
    node = plan.nodes[0]
    wide = node.model_copy(update={"dims": {**node.dims, "qo_heads": 160, "kv_heads": 8, "head_dim": 64}})
    served, unserved = StepCost(plan), StepCost(plan.model_copy(update={"nodes": [wide]}))
    assert served.nodes["LLM"].is_triton_served and not unserved.nodes["LLM"].is_triton_served
    step = mixed_step([StepRow("p", "prefill", 472, 8192)], 512)
    assert served.launch(step) == pytest.approx(sim_cost.CAPTURED_LAUNCH_S + 16 * sim_cost.TRITON_GRAPH_MERGE_S)
    assert unserved.launch(step) == pytest.approx(sim_cost.CAPTURED_LAUNCH_S + 16 * sim_cost.GRAPH_MERGE_S)
    short = dataclasses.replace(step, rows=[StepRow("p", "prefill", 472, 1024)])
    extra_flops = 472 * 7168 * served.nodes["LLM"].flops_per_key
    assert served.seconds(step) - served.seconds(short) == pytest.approx(extra_flops / sim_cost.TRITON_PREFILL_RATE)
    extra_flops = 472 * 7168 * unserved.nodes["LLM"].flops_per_key
    assert unserved.seconds(step) - unserved.seconds(short) == pytest.approx(extra_flops / sim_cost.ATTENTION_RATE)
