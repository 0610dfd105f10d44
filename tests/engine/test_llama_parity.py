"""--weights: a tiny random LlamaForCausalLM saved by transformers loads into the engine, and the
engine's greedy tokens equal transformers' greedy generate on the same prompt, token for token."""
import json

import pytest
import torch

from engine_plans import generate, llm_plan
from mstar.runtime.engine.torch_engine import EngineError, TorchEngine

transformers = pytest.importorskip("transformers")

PROMPT = [5, 17, 99, 3, 250, 42, 7, 301, 12]
NUM_NEW = 12


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    config = transformers.LlamaConfig(
        vocab_size=384, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-6, tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).eval()
    with torch.no_grad():  # larger weights than HF's 0.02 init, so greedy picks are well separated
        for param in model.parameters():
            if param.dim() == 2:
                param.normal_(0, param.shape[1] ** -0.5)
    path = tmp_path_factory.mktemp("llama")
    model.save_pretrained(path, safe_serialization=True)
    return path, model


def hf_greedy(model, prompt, num_new):
    ids = torch.tensor([prompt])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=num_new, do_sample=False,
                         pad_token_id=0, eos_token_id=None)
    return out[0, len(prompt):].tolist()


def test_greedy_matches_transformers(checkpoint):
    path, model = checkpoint
    expected = hf_greedy(model, PROMPT, NUM_NEW)
    engine = TorchEngine(llm_plan(), weights_dir=str(path))
    got = generate(engine, {"r": PROMPT}, NUM_NEW)["r"]
    assert got == expected


def test_tied_checkpoint_loads(tmp_path):
    config = transformers.LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                      num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=True)
    torch.manual_seed(1)
    model = transformers.LlamaForCausalLM(config).eval()
    model.save_pretrained(tmp_path, safe_serialization=True)
    engine = TorchEngine(llm_plan(), weights_dir=str(tmp_path))
    assert generate(engine, {"r": [1, 2, 3]}, 5)["r"] == hf_greedy(model, [1, 2, 3], 5)


def test_other_architecture_is_refused(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}))
    with pytest.raises(EngineError, match="GPT2LMHeadModel is not one the engine loads"):
        TorchEngine(llm_plan(), weights_dir=str(tmp_path))


def test_missing_checkpoint_is_refused(tmp_path):
    with pytest.raises(EngineError, match="no config.json"):
        TorchEngine(llm_plan(), weights_dir=str(tmp_path / "nowhere"))


def test_llama_checkpoint_on_hybrid_node_is_refused(checkpoint):
    from engine_plans import hybrid_plan

    with pytest.raises(EngineError, match="checkpoint is a plain Llama decoder but node LLM is a Qwen3.5"):
        TorchEngine(hybrid_plan(), weights_dir=str(checkpoint[0]))
