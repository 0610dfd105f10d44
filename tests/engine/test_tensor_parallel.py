"""Tensor parallelism on the CPU: two ranks (spawned processes, gloo) against one process.

One spawn serves the module (`tp2`): each rank builds the plan's kv node as its shard through
`TorchEngine(plan, tp_comms=...)` and runs the same greedy steps. Shown: the Llama decoder, its
variant with one kv head replicated on both ranks, and the Qwen3.5 hybrid (gated delta-net + gated
full attention) give the one-process greedy tokens, and their logits over a prefill and decode
steps match within fp32 tolerance (also through the GPU fast path's runner and flat forward, run
on the CPU); each rank holds about half the parameter bytes; a Llama
checkpoint (several files and an index, an odd vocabulary) and a Qwen3.5 checkpoint in the
published layout (text model under `model.language_model.`, tied embeddings, a vision tower) load
as slices: each rank's tensors are its part of the one-process model, and no sharded tensor was
read whole. Without processes: the split rules, the refusals, and the plan's TP groups.
"""
import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from engine_plans import LLM_DIMS, generate, hybrid_plan, llm_plan
from tp_ranks import NUM_NEW, PROMPTS, engine_checks, greedy_logits, param_bytes, spawn_ranks
from mstar.plan.io import load_plan
from mstar.plan.dims import decoder_dims
from mstar.runtime.engine.torch_engine import EngineError, TorchEngine
from mstar.runtime.engine.tp.build import plan_tp_groups
from mstar.runtime.engine.tp.comm import TpComm
from mstar.runtime.engine.tp.layout import ShardLayout, TpError
from mstar.runtime.engine.tp import memory
from mstar.runtime.engine.tp.load import full_shapes

transformers = pytest.importorskip("transformers")
qwen3_5 = pytest.importorskip("transformers.models.qwen3_5")

ROOT = Path(__file__).resolve().parents[2]


def plans():
    return {"llama": llm_plan(), "hybrid": hybrid_plan(),
            "llama_kv1": llm_plan(dict(LLM_DIMS, kv_heads=1, qo_heads=4))}


def _randomise(model):
    with torch.no_grad():  # large enough weights that greedy picks are well separated; norms off zero
        for name, param in model.named_parameters():
            if param.dim() >= 2:
                param.normal_(0, param[0].numel() ** -0.5)
            elif "norm" in name or name.endswith(".bias"):  # (transformers makes biases zero)
                param.normal_(0, 0.1)


def llama_checkpoint(path, has_biases=False):
    """has_biases: `attention_bias` and `mlp_bias` (q/k/v and gate/up biases cut with their
    columns; o_proj's and down_proj's held by rank 0 alone, the other ranks' zeros, so the
    all-reduce adds them once)."""
    config = transformers.LlamaConfig(vocab_size=251, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, attention_bias=has_biases,
                                      mlp_bias=has_biases)
    torch.manual_seed(6)
    model = transformers.LlamaForCausalLM(config).eval()
    _randomise(model)
    model.save_pretrained(path, safe_serialization=True, max_shard_size="60KB")
    assert (path / "model.safetensors.index.json").exists() and len(list(path.glob("*.safetensors"))) > 2
    return path


def qwen3_5_checkpoint(path):
    text = dict(vocab_size=320, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
                num_key_value_heads=2, head_dim=32, linear_key_head_dim=16, linear_value_head_dim=16,
                linear_num_key_heads=2, linear_num_value_heads=4, linear_conv_kernel_dim=4, rms_norm_eps=1e-6,
                layer_types=["linear_attention"] * 3 + ["full_attention"], tie_word_embeddings=True,
                rope_parameters={"rope_type": "default", "rope_theta": 10000000, "partial_rotary_factor": 0.25,
                                 "mrope_section": [1, 1, 2], "mrope_interleaved": True})
    vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64, patch_size=4,
                  spatial_merge_size=2, temporal_patch_size=2)
    config = qwen3_5.Qwen3_5Config(text_config=text, vision_config=vision, tie_word_embeddings=True)
    torch.manual_seed(7)
    model = qwen3_5.Qwen3_5ForConditionalGeneration(config).eval()
    _randomise(model)
    model.save_pretrained(path, safe_serialization=True)
    return path


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    return {"llama_ckpt": (llm_plan(), llama_checkpoint(tmp_path_factory.mktemp("tp_llama"))),
            "llama_bias_ckpt": (llm_plan(), llama_checkpoint(tmp_path_factory.mktemp("tp_llama_bias"), True)),
            "qwen3_5_ckpt": (hybrid_plan(), qwen3_5_checkpoint(tmp_path_factory.mktemp("tp_qwen3_5")))}


@pytest.fixture(scope="module")
def tp2(checkpoints):
    return spawn_ranks(engine_checks, 2, (plans(), checkpoints), timeout_s=300)


@pytest.mark.parametrize("name", ["llama", "hybrid", "llama_kv1"])
def test_tp2_tokens_and_logits_equal_one_process(tp2, name):
    engine = TorchEngine(plans()[name])
    expected = generate(engine, PROMPTS, NUM_NEW, start_every=2)
    runner = engine.runners["LLM"]
    logits = greedy_logits(runner.model, runner.dims, PROMPTS["a"], 3)
    for rank in (0, 1):
        assert tp2[rank][name] == expected
        assert tp2[rank][name + "/fast"] == expected  # the GPU fast path's runner and flat forward
        torch.testing.assert_close(tp2[rank][name + "/logits"], logits, rtol=1e-5, atol=1e-5)
    assert torch.equal(tp2[0][name + "/logits"], tp2[1][name + "/logits"])  # the ranks agree exactly


@pytest.mark.parametrize("name", ["llama", "hybrid"])
def test_each_rank_holds_about_half_the_parameter_bytes(tp2, name):
    whole = param_bytes(TorchEngine(plans()[name]).runners["LLM"].model)
    for rank in (0, 1):
        # Replicated: norms and the small image-flow head (a few percent at tiny dims).
        assert 0.5 * whole <= tp2[rank][name + "/bytes"] <= 0.53 * whole


@pytest.mark.parametrize("name", ["llama_ckpt", "llama_bias_ckpt", "qwen3_5_ckpt"])
def test_checkpoint_loads_as_slices(tp2, checkpoints, name):
    plan, path = checkpoints[name]
    engine = TorchEngine(plan, weights_dir=str(path))
    assert all(tp2[rank][name] == generate(engine, PROMPTS, NUM_NEW, start_every=2) for rank in (0, 1))
    model = engine.runners["LLM"].model
    layout_dims = engine.decoder_dims["LLM"]
    full = model.state_dict()
    for rank in (0, 1):
        layout = ShardLayout(layout_dims, rank, 2)
        shapes = full_shapes(layout)
        state = tp2[rank][name + "/state"]
        assert state.keys() == full.keys()
        for key, tensor in full.items():
            assert torch.equal(state[key], layout.take(key, tensor, shapes[key])), key
        assert tp2[rank][name + "/whole"] == []  # every tensor was read as a slice
        read = tp2[rank][name + "/read"]
        cut = [key for key in read if "norm" not in key and "visual" not in key]
        assert cut and all(read[key] <= _numel(path, key) // 2 + 64 for key in cut), read


def _numel(path, key):
    from safetensors import safe_open

    index = path / "model.safetensors.index.json"
    file = path / json.loads(index.read_text())["weight_map"][key] if index.exists() else path / "model.safetensors"
    with safe_open(str(file), framework="pt") as handle:
        shape = handle.get_slice(key).get_shape()
    return int(torch.tensor(shape).prod())


def test_shards_of_all_ranks_rebuild_every_parameter():
    """Rank parts put back together (cuts concatenated in head order, first-rank biases summed)
    give each full tensor, for every parameter of both decoder styles (Llama's with and without
    its biases) and 1, 2 and 4 ranks."""
    llama = decoder_dims(llm_plan(dict(LLM_DIMS, kv_heads=4, qo_heads=8)).nodes[0], "tiny")
    cases = [(llama, (1, 2, 4)), (replace(llama, has_qkv_bias=True, has_o_bias=True, has_mlp_bias=True), (2, 4)),
             (decoder_dims(hybrid_plan().nodes[0], "tiny"), (1, 2))]
    kinds = set()
    for dims, sizes in cases:
        for size in sizes:
            layouts = [ShardLayout(dims, rank, size) for rank in range(size)]
            for name, shape in full_shapes(layouts[0]).items():
                full = torch.randn(shape)
                parts = [layout.take(name, full, shape) for layout in layouts]
                shard = layouts[0].shard_of(name)
                kinds.add(shard.kind)
                if shard.kind == "whole":
                    assert all(torch.equal(part, full) for part in parts), name
                elif shard.kind == "first_rank":
                    assert torch.equal(sum(parts), full), name
                else:
                    assert torch.equal(_unsplit(parts, layouts, name, shape), full), name
    assert kinds == {"whole", "cut", "first_rank"}  # (no case had a first-rank bias before)


def _unsplit(parts, layouts, name, shape):
    out = torch.zeros(shape)
    for part, layout in zip(parts, layouts):
        shard = layout.shard_of(name)
        offset = 0
        for start, end in shard.ranges:
            index = (slice(None),) * shard.axis + (slice(start, end),)
            out[index] = part[(slice(None),) * shard.axis + (slice(offset, offset + end - start),)]
            offset += end - start
    return out


def test_unsplittable_dims_are_refused_by_name():
    dims = decoder_dims(llm_plan(dict(LLM_DIMS, kv_heads=3, qo_heads=6)).nodes[0], "spec")
    with pytest.raises(TpError, match="kv_heads=3: each rank needs whole kv heads"):
        ShardLayout(dims, 0, 2, "LLM")
    dims = decoder_dims(llm_plan(dict(LLM_DIMS, qo_heads=6, kv_heads=2)).nodes[0], "spec")
    with pytest.raises(TpError, match="qo_heads=6 is not a multiple of 4"):
        ShardLayout(dims, 0, 4, "LLM")
    hybrid = decoder_dims(hybrid_plan().nodes[0], "tiny")
    with pytest.raises(TpError, match="gated delta-net's 2 q/k heads"):
        ShardLayout(hybrid, 0, 4, "LLM")
    # Through the engine: a clear start-up refusal before any collective runs.
    with pytest.raises(EngineError, match="cannot split the model over 2 tensor-parallel ranks"):
        TorchEngine(llm_plan(dict(LLM_DIMS, kv_heads=3, qo_heads=6)), dims="spec", tp_comms={"LLM": TpComm(0, 2)})


def test_kv_heads_fewer_than_ranks_are_replicated():
    dims = decoder_dims(llm_plan(dict(LLM_DIMS, kv_heads=2, qo_heads=8)).nodes[0], "spec")
    starts = [ShardLayout(dims, rank, 4).kv_head_start for rank in range(4)]
    assert starts == [0, 0, 1, 1]  # query heads 0-3 read kv head 0, 4-7 kv head 1
    assert ShardLayout(dims, 3, 4).local_dims.num_kv_heads == 1


def test_plan_tp_groups():
    plan = load_plan(ROOT / "generated" / "orpheus_tp2.plan")
    groups = plan_tp_groups(plan)
    assert [(g.node, g.ranks) for g in groups] == [("LLM", [0, 1])]
    assert plan_tp_groups(load_plan(ROOT / "generated" / "orpheus.plan")) == []


def test_memory_report(capsys):
    assert memory.main(["--plan", str(ROOT / "generated" / "orpheus_tp2.plan")]) == 0
    assert "LLM (spec dims, TP2): whole 7233.7 MiB; per rank 3626.1, 3626.1 MiB (0.501 of the whole)" in \
        capsys.readouterr().out
    assert memory.main(["--plan", str(ROOT / "generated" / "orpheus_tp2.plan"), "--tp", "5"]) == 1
    assert "error: node LLM: cannot split the model over 5 tensor-parallel ranks" in capsys.readouterr().err
    assert memory.main(["--plan", str(ROOT / "no.plan")]) == 1
    assert "does not exist" in capsys.readouterr().err
