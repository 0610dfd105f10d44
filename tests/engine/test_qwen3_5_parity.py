"""--weights with a tiny random Qwen3.5 text checkpoint (3 gated delta-net layers : 1 gated full
attention layer) saved by transformers: the engine's greedy tokens equal transformers' greedy
generate, alone and in mixed steps; the same for a checkpoint in the published layout (the
ConditionalGeneration wrapper, tied embeddings, listed layer types, MTP tensors); the published
0.8B config.json gives its dims; a Qwen3.5 checkpoint on a plain Llama node is refused."""
import pytest
import torch

from engine_plans import generate, hybrid_plan, llm_plan
from mstar.runtime.engine.torch_engine import EngineError, TorchEngine

transformers = pytest.importorskip("transformers")
qwen3_5 = pytest.importorskip("transformers.models.qwen3_5")

PROMPTS = {"a": [7, 100, 3, 55, 21, 250, 9, 31], "b": [4, 4, 200], "c": [12, 90, 60, 30, 15, 7, 3, 1, 0, 99, 98]}
NUM_NEW = 8


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    config = qwen3_5.Qwen3_5TextConfig(
        vocab_size=320, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, linear_key_head_dim=16, linear_value_head_dim=16,
        linear_num_key_heads=2, linear_num_value_heads=4, linear_conv_kernel_dim=4, rms_norm_eps=1e-6,
    )
    torch.manual_seed(3)
    model = qwen3_5.Qwen3_5ForCausalLM(config).eval()
    with torch.no_grad():  # weights large enough that greedy picks are well separated; norms off zero
        for name, param in model.named_parameters():
            if param.dim() >= 2:
                param.normal_(0, param[0].numel() ** -0.5)
            elif "norm" in name:
                param.normal_(0, 0.1)
    path = tmp_path_factory.mktemp("qwen3_5")
    model.save_pretrained(path, safe_serialization=True)
    return path, model


def hf_greedy(model, prompt):
    ids = torch.tensor([prompt])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NUM_NEW, do_sample=False,
                         pad_token_id=0, eos_token_id=None)
    return out[0, len(prompt):].tolist()


def test_greedy_matches_transformers_alone_and_mixed(checkpoint):
    path, model = checkpoint
    expected = {rid: hf_greedy(model, prompt) for rid, prompt in PROMPTS.items()}
    alone = generate(TorchEngine(hybrid_plan(), weights_dir=str(path)), {"a": PROMPTS["a"]}, NUM_NEW)
    assert alone["a"] == expected["a"]
    mixed = generate(TorchEngine(hybrid_plan(), weights_dir=str(path)), PROMPTS, NUM_NEW, start_every=2)
    assert mixed == expected


def test_qwen3_5_checkpoint_on_llama_node_is_refused(checkpoint):
    with pytest.raises(EngineError, match="checkpoint is a Qwen3.5 gated delta-net hybrid but node LLM is a plain"):
        TorchEngine(llm_plan(), weights_dir=str(checkpoint[0]))


@pytest.fixture(scope="module")
def real_layout(tmp_path_factory):
    """The published checkpoints' structure at tiny sizes: Qwen3_5ForConditionalGeneration (the text
    model under `model.language_model.`, a vision tower), layer_types listed (two units of 3 linear
    + 1 full), tied embeddings (no lm_head tensor), head_dim apart from hidden / heads, as many
    linear value heads as key heads, M-RoPE fields beside partial rotary 0.25, a large rope_theta,
    and multi-token-prediction tensors (`mtp.*`) that transformers' model does not build."""
    from safetensors.torch import load_file, save_file

    text = dict(
        vocab_size=320, hidden_size=64, intermediate_size=96, num_hidden_layers=8, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, linear_key_head_dim=16, linear_value_head_dim=16,
        linear_num_key_heads=4, linear_num_value_heads=4, linear_conv_kernel_dim=4, rms_norm_eps=1e-6,
        layer_types=(["linear_attention"] * 3 + ["full_attention"]) * 2, tie_word_embeddings=True,
        rope_parameters={"rope_type": "default", "rope_theta": 10000000, "partial_rotary_factor": 0.25,
                         "mrope_section": [1, 1, 2], "mrope_interleaved": True},
    )
    vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64, patch_size=4,
                  spatial_merge_size=2, temporal_patch_size=2)
    config = qwen3_5.Qwen3_5Config(text_config=text, vision_config=vision, tie_word_embeddings=True)
    torch.manual_seed(5)
    model = qwen3_5.Qwen3_5ForConditionalGeneration(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.dim() >= 2:
                param.normal_(0, param[0].numel() ** -0.5)
            elif "norm" in name:
                param.normal_(0, 0.1)
    path = tmp_path_factory.mktemp("qwen3_5_real")
    model.save_pretrained(path, safe_serialization=True)
    weights = load_file(path / "model.safetensors")
    assert "lm_head.weight" not in weights and any(k.startswith("model.visual.") for k in weights)
    weights["mtp.layers.0.mlp.up_proj.weight"] = torch.randn(96, 64)
    weights["mtp.fc.weight"] = torch.randn(64, 128)
    save_file(weights, str(path / "model.safetensors"), metadata={"format": "pt"})
    return path, model


def test_real_layout_matches_transformers(real_layout):
    path, model = real_layout
    expected = {rid: hf_greedy(model, prompt) for rid, prompt in PROMPTS.items()}
    engine = TorchEngine(hybrid_plan(), weights_dir=str(path))
    dims = engine.decoder_dims["LLM"]
    assert (dims.num_full_layers, dims.num_linear_layers, dims.rotary_dim, dims.is_tied_embeddings) == (2, 6, 8, True)
    assert generate(engine, PROMPTS, NUM_NEW, start_every=2) == expected


# The fields of Qwen/Qwen3.5-0.8B's config.json that the engine reads (values as published).
QWEN3_5_0_8B = {
    "architectures": ["Qwen3_5ForConditionalGeneration"], "model_type": "qwen3_5", "tie_word_embeddings": True,
    "text_config": {
        "model_type": "qwen3_5_text", "hidden_size": 1024, "num_hidden_layers": 24, "full_attention_interval": 4,
        "layer_types": ["linear_attention"] * 3 + ["full_attention"], "num_attention_heads": 8,
        "num_key_value_heads": 2, "head_dim": 256, "attn_output_gate": True, "attention_bias": False,
        "linear_num_key_heads": 16, "linear_num_value_heads": 16, "linear_key_head_dim": 128,
        "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4, "intermediate_size": 3584, "hidden_act": "silu",
        "vocab_size": 248320, "tie_word_embeddings": True, "rms_norm_eps": 1e-6, "max_position_embeddings": 262144,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000000, "partial_rotary_factor": 0.25,
                            "mrope_section": [11, 11, 10], "mrope_interleaved": True},
        "mamba_ssm_dtype": "float32", "mtp_num_hidden_layers": 1, "eos_token_id": 248044,
    },
}


def test_published_config_gives_its_dims(tmp_path):
    import json

    from mstar.runtime.engine.weights import read_checkpoint_config

    config = json.loads(json.dumps(QWEN3_5_0_8B))
    config["text_config"]["layer_types"] *= 6
    (tmp_path / "config.json").write_text(json.dumps(config))
    dims = read_checkpoint_config(str(tmp_path))
    assert [i for i, full in enumerate(dims.layer_is_full) if full] == [3, 7, 11, 15, 19, 23]
    shape = (dims.style, dims.hidden, dims.num_qo_heads, dims.num_kv_heads, dims.head_dim)
    assert shape == ("qwen3_5", 1024, 8, 2, 256)
    assert (dims.num_linear_heads, dims.num_linear_value_heads, dims.linear_key_dim, dims.linear_value_dim,
            dims.conv_kernel) == (16, 16, 128, 128, 4)
    assert (dims.rotary_dim, dims.rope_theta, dims.rope.kind, dims.is_tied_embeddings) == (64, 1e7, "default", True)
    assert (dims.intermediate, dims.vocab, dims.rms_eps) == (3584, 248320, 1e-6)
    del config["text_config"]["layer_types"]  # then the interval decides, as in transformers
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert read_checkpoint_config(str(tmp_path)).layer_is_full == dims.layer_is_full


def test_the_device_paths_loader_reads_the_real_layout_as_the_reference(real_layout):
    """The GPU fast path's loader (run on the CPU) takes the text model from under
    `model.language_model.`, the tied head from the embedding, and skips the vision tower and the
    MTP tensors, as the reference loader does: the same parameters."""
    from mstar.runtime.engine.gpu.device_model import build_decoder
    from mstar.runtime.engine.models.decoder import Decoder
    from mstar.runtime.engine.weights import load_decoder, read_checkpoint_config

    path, _ = real_layout
    dims = read_checkpoint_config(str(path))
    reference = load_decoder(lambda: Decoder(dims), str(path), dims.is_tied_embeddings)
    device = build_decoder(dims, torch.device("cpu"), torch.float32, position=0, seed=0, weights_dir=str(path))
    expected = dict(reference.named_parameters())
    for name, param in device.named_parameters():
        if not name.startswith("flow."):
            assert torch.equal(param, expected.get(name, expected["model.embed_tokens.weight"])), name
