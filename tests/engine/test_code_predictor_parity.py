"""The depth model (models/depth.py) against transformers' code predictor on a tiny random config.

transformers has no Qwen3-TTS classes; its Qwen3-Omni talker carries the same code predictor
(`Qwen3OmniMoeTalkerCodePredictorModelForConditionalGeneration`: Qwen3 layers, one codec embedding
and one LM head per further codebook), which the Talker drives with `generate(inputs_embeds=[talker
hidden, embedding of codebook 0], max_new_tokens=num_code_groups - 1)`. Its weights copy into the
depth model by name; the hidden states and the greedy codes must match."""
import pytest
import torch

from mstar.runtime.engine.models.depth import DepthDims, DepthModel

transformers = pytest.importorskip("transformers")
omni = pytest.importorskip("transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe")
omni_config = pytest.importorskip("transformers.models.qwen3_omni_moe.configuration_qwen3_omni_moe")

NUM_CODE_GROUPS = 5


def pair():
    torch.manual_seed(0)
    config = omni_config.Qwen3OmniMoeTalkerCodePredictorConfig(
        vocab_size=48, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, num_code_groups=NUM_CODE_GROUPS, rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    config._attn_implementation = "eager"
    reference = omni.Qwen3OmniMoeTalkerCodePredictorModelForConditionalGeneration(config).eval()
    with torch.no_grad():  # transformers leaves norms at 1; random scales make the test see them
        for name, param in reference.named_parameters():
            if name.endswith("norm.weight"):
                param.uniform_(0.5, 1.5)
    dims = DepthDims(num_layers=2, num_kv_heads=2, num_qo_heads=4, head_dim=16, hidden=32, intermediate=64,
                     vocab=48, depth=NUM_CODE_GROUPS - 1, outer_hidden=32)
    model = DepthModel(dims).eval()
    missing, unexpected = model.load_state_dict(reference.state_dict(), strict=False)
    assert not missing and not unexpected, (missing, unexpected)
    return reference, model


def test_hidden_states_match():
    reference, model = pair()
    inputs = torch.randn(1, 4, 32, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = reference.model(inputs_embeds=inputs).last_hidden_state[0]
        got = model.hidden_states(inputs[0])
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5)


def test_greedy_codes_match_generate():
    reference, model = pair()
    generator = torch.Generator().manual_seed(2)
    for _ in range(3):
        talker_hidden, first_embed = torch.randn(32, generator=generator), torch.randn(32, generator=generator)
        with torch.no_grad():
            out = reference.generate(inputs_embeds=torch.stack([talker_hidden, first_embed]).unsqueeze(0),
                                     max_new_tokens=NUM_CODE_GROUPS - 1, do_sample=False)
            got = model.generate(talker_hidden, first_embed, lambda k, logits: int(logits.argmax()))
        assert got == out[0, -(NUM_CODE_GROUPS - 1):].tolist()
