"""--weights with a tiny random Qwen3.5 text checkpoint (3 gated delta-net layers : 1 gated full
attention layer) saved by transformers: the engine's greedy tokens equal transformers' greedy
generate, alone and in mixed steps; a Qwen3.5 checkpoint on a plain Llama node is refused."""
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
