"""Tiny dims keep each node's structure (head ratio, layer pattern); bad dims are refused clearly."""
import pytest

from plan_roles import node_plan
from mstar.plan.schema import RecurrentState
from mstar.plan.dims import DimsError, decoder_dims, layer_pattern


def node(**dims):
    return node_plan("LLM", "kv", [], dims=dims, inputs=["text_inputs"])


def test_tiny_keeps_head_ratio_and_spec_keeps_numbers():
    spec = node(layers=28, kv_heads=8, qo_heads=24, head_dim=128, hidden=3072, vocab=156940)
    assert decoder_dims(spec, "spec").num_layers == 28
    tiny = decoder_dims(spec, "tiny")
    assert tiny.num_qo_heads // tiny.num_kv_heads == 3 and tiny.hidden == 64 and tiny.vocab == 512


def test_tiny_keeps_one_unit_of_the_layer_pattern():
    qwen = node_plan("LLM", "kv", [], inputs=["text_inputs"],
                    dims={"layers": 24, "kv_heads": 2, "qo_heads": 8, "head_dim": 256, "layer_pattern": [0, 0, 0, 1]},
                    recurrent=RecurrentState(num_layers=18, num_heads=16, key_dim=128, value_dim=128, num_slots=9))
    assert decoder_dims(qwen, "spec").num_linear_layers == 18
    assert decoder_dims(qwen, "tiny").layer_is_full == (False, False, False, True)


def test_layer_pattern_forms():
    assert layer_pattern(node(layer_pattern="linear,full"), 4) == (False, True, False, True)
    assert layer_pattern(node(layer_pattern=[1, 0, 0]), 3) == (True, False, False)
    with pytest.raises(DimsError, match="layer_pattern"):
        layer_pattern(node(layer_pattern=[0, 2]), 4)


def test_bad_dims_are_refused():
    with pytest.raises(DimsError, match="not a multiple of kv_heads"):
        decoder_dims(node(kv_heads=3, qo_heads=4), "tiny")
    with pytest.raises(DimsError, match="positive integer"):
        decoder_dims(node(layers="many"), "tiny")
    mismatch = node_plan("LLM", "kv", [], inputs=[], dims={"layers": 8, "layer_pattern": [0, 1]},
                        recurrent=RecurrentState(num_layers=6, num_heads=2, key_dim=8, value_dim=8, num_slots=3))
    with pytest.raises(DimsError, match="recurrent state declares 6 layers"):
        decoder_dims(mismatch, "tiny")


def test_spec_dims_too_large_for_the_machine_are_refused():
    from engine_plans import LLM_DIMS, llm_plan
    from mstar.runtime.engine.torch_engine import EngineError, TorchEngine

    huge = dict(LLM_DIMS, vocab=2**40)
    with pytest.raises(EngineError, match="GiB but this machine allows"):
        TorchEngine(llm_plan(huge), dims="spec")


def test_a_depth_model_and_a_decoder_share_one_list_of_layer_fields():
    """`DepthDims` and `DecoderDims` both take the layer stack's fields from `LayerStackDims` (no
    second copy to drift), each keeping its own defaults: Qwen3's norm epsilon for a depth model."""
    import dataclasses

    from mstar.plan.dims import DecoderDims, LayerStackDims
    from mstar.runtime.engine.models.depth import DepthDims

    stack = [f.name for f in dataclasses.fields(LayerStackDims)]
    assert [f.name for f in dataclasses.fields(DepthDims)] == stack + ["depth", "outer_hidden"]
    assert [f.name for f in dataclasses.fields(DecoderDims)][:len(stack)] == stack
    shape = dict(num_layers=2, num_kv_heads=2, num_qo_heads=4, head_dim=16, hidden=32, intermediate=64, vocab=48)
    depth = DepthDims(**shape, depth=3, outer_hidden=64)
    decoder = DecoderDims(**shape, layer_is_full=(True, True))
    assert (depth.rms_eps, decoder.rms_eps) == (1e-6, 1e-5) and depth.rope_theta == decoder.rope_theta == 10000.0
