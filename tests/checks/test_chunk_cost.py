"""KeyPlan.chunk_context_scale (compiler/chunk_cost.py): a chunk token's weight at depth comes from
the node's dims, only on keys that cut prompts under a budget, and only while the deployment's
budget counts context."""
from pathlib import Path

from mstar.compiler.chunk_cost import ATTENTION_RATE_FRACTION, context_scale
from mstar.compiler.driver import compile_spec
from mstar.lang.diagnostics import Diagnostics
from mstar.plan.dims import decoder_dims
from mstar.plan.io import load_plan
from mstar.plan.schema import NodePlan
ROOT = Path(__file__).resolve().parents[2]


def _keys(plan):
    return [key for worker in plan.workers for key in worker.keys]


def test_the_scale_is_the_products_work_over_attention_work_per_cached_token():
    plan = load_plan(ROOT / "generated" / "llama_chunked.plan")
    node = next(n for n in plan.nodes if n.engine == "kv")
    dims = decoder_dims(node, "spec")
    q, kv, d, h = dims.num_qo_heads, dims.num_kv_heads, dims.head_dim, dims.hidden
    per_layer = h * (q + 2 * kv) * d + q * d * h + 3 * h * dims.intermediate
    flops_per_token = 2 * dims.num_layers * per_layer
    attention_per_cached_token = 4 * q * d * dims.num_layers  # QK^T and PV
    expected = round(flops_per_token / attention_per_cached_token * ATTENTION_RATE_FRACTION)
    assert [k.chunk_context_scale for k in _keys(plan) if k.chunk_sizes] == [expected]
    assert 6000 < expected < 8000  # Llama-3.2-1B: a token 8192 deep costs about twice a shallow one


def test_only_keys_that_cut_prompts_under_a_budget_get_a_scale():
    for name in ("llama", "orpheus", "qwen3_omni"):
        assert all(k.chunk_context_scale is None for k in _keys(load_plan(ROOT / "generated" / f"{name}.plan")))


def test_a_deployment_can_count_every_chunk_token_one(tmp_path):
    config = (ROOT / "configs" / "llama_chunked.yaml").read_text() + "budget_counts_context: false\n"
    (tmp_path / "flat.yaml").write_text(config)
    diags = Diagnostics()
    result = compile_spec(ROOT / "specs" / "llama.mw", tmp_path / "flat.yaml", diags, tmp_path)
    assert result is not None, diags
    keys = _keys(result.plan)
    assert any(k.chunk_sizes for k in keys) and all(k.chunk_context_scale is None for k in keys)


def test_a_node_without_full_attention_layers_has_no_scale():
    """Gated delta-net layers read a fixed-size state: no chunk costs more at depth."""
    linear = NodePlan.model_construct(name="lin", engine="kv", dims={"layers": 4, "layer_pattern": [0]},
                                      recurrent=None)
    assert context_scale(linear) is None
    hybrid = NodePlan.model_construct(name="hyb", engine="kv", dims={"layers": 8, "layer_pattern": [0, 0, 0, 1],
                                                                    "qo_heads": 8, "kv_heads": 2, "head_dim": 64},
                                      recurrent=None)
    full = NodePlan.model_construct(name="full", engine="kv", dims={"layers": 8, "qo_heads": 8, "kv_heads": 2,
                                                                   "head_dim": 64}, recurrent=None)
    assert context_scale(hybrid) > context_scale(full)  # a quarter of the layers attend over the context
