"""--weights with a tiny random checkpoint of each RoPE kind (default, linear, dynamic, yarn,
llama3) and of the attention details of Llama (attention and MLP biases), Qwen2 (q/k/v biases) and
Qwen3 (q/k norms): the engine's greedy tokens equal transformers' greedy generate, token for token.

The configs put the RoPE context limits (16 positions) inside the generated length, so the scaled
frequencies matter: dynamic NTK stretches once a request passes 16 positions, both in the prompt
(`LONG_PROMPT`) and while decoding; llama3 and yarn rescale the low-frequency dims.
"""
import pytest
import torch

from engine_plans import generate, llm_plan
from mstar.runtime.engine.models.rope import apply_rotary, span_lengths
from mstar.plan.dims import RopeScaling
from mstar.runtime.engine.torch_engine import EngineError, TorchEngine

transformers = pytest.importorskip("transformers")

PROMPT = [5, 17, 99, 3, 250, 42, 7, 301, 12]
LONG_PROMPT = [(i * 37 + 11) % 384 for i in range(20)]  # past the 16-position limits at once
NUM_NEW = 14
SIZES = dict(vocab_size=384, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=16, rms_norm_eps=1e-6, tie_word_embeddings=False)
ROPES = {
    "default": {"rope_type": "default", "rope_theta": 10000.0},
    "linear": {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0},
    "dynamic": {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 4.0},
    "yarn": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 16},
    "llama3": {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 16},
}


def save_random(model, path):
    """Weights larger than HF's 0.02 init (greedy picks well separated), biases and norms off their
    starting values so that a missing bias or norm changes the tokens."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.dim() == 2:
                param.normal_(0, param.shape[1] ** -0.5)
            elif name.endswith("bias"):
                param.normal_(0, 0.5)
            elif "norm" in name:
                param.normal_(1.0, 0.2)
    model.save_pretrained(path, safe_serialization=True)
    return path


def hf_greedy(model, prompt, num_new=NUM_NEW):
    ids = torch.tensor([prompt])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=num_new, do_sample=False,
                         pad_token_id=0, eos_token_id=None)
    return out[0, len(prompt):].tolist()


def engine_greedy(path, prompts, num_new=NUM_NEW):
    return generate(TorchEngine(llm_plan(), weights_dir=str(path)), prompts, num_new, start_every=1)


@pytest.mark.parametrize("kind", list(ROPES))
def test_rope_kind_matches_transformers(kind, tmp_path):
    config = transformers.LlamaConfig(**SIZES, rope_parameters=dict(ROPES[kind]))
    torch.manual_seed(11)
    model = transformers.LlamaForCausalLM(config).eval()
    save_random(model, tmp_path)
    expected = {"short": hf_greedy(model, PROMPT), "long": hf_greedy(model, LONG_PROMPT)}
    assert engine_greedy(tmp_path, {"short": PROMPT, "long": LONG_PROMPT}) == expected


@pytest.mark.parametrize("arch", ["llama_biases", "qwen2", "qwen3"])
def test_attention_details_match_transformers(arch, tmp_path):
    rope = dict(ROPES["default"], rope_theta=1000.0)
    if arch == "llama_biases":
        config = transformers.LlamaConfig(**SIZES, rope_parameters=rope, attention_bias=True, mlp_bias=True)
        model = transformers.LlamaForCausalLM(config)
    elif arch == "qwen2":
        config = transformers.Qwen2Config(**SIZES, rope_parameters=rope)
        model = transformers.Qwen2ForCausalLM(config)
    else:  # head_dim apart from hidden / heads, as Qwen3 checkpoints have it
        config = transformers.Qwen3Config(**SIZES, head_dim=32, rope_parameters=rope, attention_bias=True)
        model = transformers.Qwen3ForCausalLM(config)
    torch.manual_seed(12)
    save_random(model.eval(), tmp_path)
    expected = {"short": hf_greedy(model, PROMPT), "long": hf_greedy(model, LONG_PROMPT)}
    assert engine_greedy(tmp_path, {"short": PROMPT, "long": LONG_PROMPT}) == expected


def test_rotary_matches_transformers_embedding():
    """cos/sin of every kind equal transformers' rotary embedding at positions past the limits."""
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

    from mstar.runtime.engine.checkpoint_config import _rope_parameters, _rope_scaling

    positions = torch.arange(40)
    x = torch.randn(40, 2, 16, generator=torch.Generator().manual_seed(0))
    for kind, params in ROPES.items():
        config = transformers.LlamaConfig(**SIZES, rope_parameters=dict(params))
        cos, sin = LlamaRotaryEmbedding(config)(x, positions[None])
        expected, _ = apply_rotary_pos_emb(x.transpose(0, 1)[None], x.transpose(0, 1)[None], cos, sin)
        raw = config.to_dict()
        scaling = _rope_scaling(raw, _rope_parameters(raw))
        got = apply_rotary(x, positions, params["rope_theta"], 0, scaling, span_lengths(positions, [(0, 40)]))
        torch.testing.assert_close(got, expected[0].transpose(0, 1), rtol=1e-5, atol=1e-5, msg=kind)


def test_dynamic_length_is_per_request():
    """Dynamic NTK: a row's frequencies depend on its own length, not on a longer neighbour's."""
    rope = RopeScaling(kind="dynamic", factor=4.0, max_position=16)
    x = torch.randn(4, 1, 8, generator=torch.Generator().manual_seed(1))
    alone = apply_rotary(x[:1], torch.tensor([5]), 100.0, 0, rope, torch.tensor([6]))
    positions = torch.tensor([5, 30, 31, 32])
    beside = apply_rotary(x, positions, 100.0, 0, rope, span_lengths(positions, [(0, 1), (1, 4)]))
    torch.testing.assert_close(beside[:1], alone)


@pytest.mark.parametrize("rope, message", [
    ({"rope_type": "longrope", "factor": 2.0}, "rope_type 'longrope' is not supported"),
    ({"rope_type": "llama3", "factor": 8.0}, "missing or bad field.*low_freq_factor"),
    ({"rope_type": "linear", "factor": -1.0}, "rope factor -1.0 must be positive"),
])
def test_bad_rope_is_refused(rope, message, tmp_path):
    import json

    config = {"architectures": ["LlamaForCausalLM"], "hidden_size": 64, "num_attention_heads": 4,
              "num_hidden_layers": 2, "intermediate_size": 96, "vocab_size": 384, "max_position_embeddings": 64,
              "rope_scaling": rope}
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(EngineError, match=message):
        TorchEngine(llm_plan(), weights_dir=str(tmp_path))
