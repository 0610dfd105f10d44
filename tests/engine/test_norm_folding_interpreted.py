"""Norms folded into the products after them (`engine/gpu/norm_folding.py`): the kernels' row
scales under the Triton interpreter on the CPU, and the whole fused forward with its norms folded
against the torch forward with them unfolded (fp32, norm weights drawn away from their start values,
so that folding them is not an identity)."""
import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")

from interpreter_child import parent_only, run_child, skip_unless_child  # noqa: E402

from engine_plans import hybrid_plan, llm_plan  # noqa: E402
from fused_steps import fused_forward, two_row_step  # noqa: E402
from gdn_layer import small_gdn_layer  # noqa: E402
from mstar.plan.dims import decoder_dims  # noqa: E402
from mstar.runtime.engine.gpu import kernels, norm_folding  # noqa: E402
from mstar.runtime.engine.gpu.products import Product  # noqa: E402
from mstar.runtime.engine.models.gdn import LinearStates  # noqa: E402
from mstar.runtime.engine.models.layers import RMSNorm  # noqa: E402


@pytest.fixture
def interpreted():
    skip_unless_child("test_norm_folding_under_the_interpreter")
    return kernels


@parent_only
def test_norm_folding_under_the_interpreter():
    run_child(__file__, "14 passed")


def _row_scale(x: torch.Tensor, eps: float) -> torch.Tensor:
    x32 = x.float()
    return torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)


def test_silu_mul_scales_gate_and_up_by_the_rows_norm(interpreted):
    generator = torch.Generator().manual_seed(0)
    gate_up, x = torch.randn(3, 2 * 40, generator=generator), 3 * torch.randn(3, 24, generator=generator)
    scale = _row_scale(x, 1e-5)
    gate, up = (gate_up * scale).chunk(2, dim=-1)
    got = interpreted.silu_mul(gate_up, kernels.RowNorm(x, 1e-5))
    torch.testing.assert_close(got, F.silu(gate) * up)


def test_sigmoid_gate_scales_the_gate_by_the_rows_norm(interpreted):
    generator = torch.Generator().manual_seed(1)
    out, gate = torch.randn(2, 3 * 8, generator=generator), torch.randn(2, 3, 16, generator=generator)[..., :8]
    x = torch.randn(2, 20, generator=generator)
    scale = _row_scale(x, 1e-6)
    got = interpreted.sigmoid_gate(out, gate, kernels.RowNorm(x, 1e-6))
    torch.testing.assert_close(got, out * torch.sigmoid(gate.reshape(2, -1) * scale))


@pytest.mark.parametrize("has_qk_norm", [False, True])
def test_rope_write_kv_scales_q_k_and_v_by_the_rows_norm(interpreted, has_qk_norm):
    """The same as the kernel on q, k and v scaled beforehand (q/k normed after the scale)."""
    generator = torch.Generator().manual_seed(2)
    n, num_q, num_kv, d, positions = 3, 4, 2, 16, 32
    q, k, v = (torch.randn(n, h, d, generator=generator) for h in (num_q, num_kv, num_kv))
    x = 2 * torch.randn(n, 48, generator=generator)
    freqs = torch.arange(positions).float()[:, None] * torch.rand(d // 2, generator=generator)[None, :]
    cos, sin = freqs.cos(), freqs.sin()
    position, slots = torch.tensor([0, 7, 31]), torch.tensor([1, 4, 6])
    qk_norm = kernels.QkNorm(torch.rand(d, generator=generator) + 0.5, torch.rand(d, generator=generator) + 0.5,
                             1e-6, False) if has_qk_norm else None
    caches = [torch.zeros(8, num_kv, d) for _ in range(4)]
    scale = _row_scale(x, 1e-5)[:, :, None]
    expected_q = interpreted.rope_write_kv(q * scale, k * scale, v * scale, cos, sin, position, slots, caches[0],
                                           caches[1], d, qk_norm)
    got_q = interpreted.rope_write_kv(q, k, v, cos, sin, position, slots, caches[2], caches[3], d, qk_norm,
                                      kernels.RowNorm(x, 1e-5))
    torch.testing.assert_close(got_q, expected_q)
    torch.testing.assert_close(caches[2], caches[0])
    torch.testing.assert_close(caches[3], caches[1])


def _drawn_norms(model, seed: int) -> None:
    """Every RMSNorm's weight drawn away from its start value (1, or 0 zero-centred)."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, RMSNorm):
                drawn = 0.3 * torch.randn(module.weight.shape, generator=generator)
                module.weight.copy_(drawn if module.is_zero_centred else 1.0 + drawn)


def _forward(dims, is_hybrid: bool, is_fused: bool):
    """`fused_forward` with every norm's weight drawn away from its start value."""
    forward, kv, states = fused_forward(dims, is_hybrid, is_fused)
    _drawn_norms(forward.model, seed=5)
    return forward, kv, states


@pytest.mark.parametrize("is_decode", [False, True], ids=["prompts", "decode"])
@pytest.mark.parametrize("is_hybrid", [False, True], ids=["llama", "qwen3_5"])
def test_the_folded_forward_matches_the_torch_forward(interpreted, is_hybrid, is_decode):
    """Llama's plain norms; Qwen3.5's zero-centred ones, q/k norms, the gated attention output and
    gated delta-net layers (their input norm's scale in the decode kernel, a norm kernel of
    identity weight before in_proj in prompt steps; their out_proj adding into x)."""
    dims = decoder_dims((hybrid_plan() if is_hybrid else llm_plan()).nodes[0], "spec")
    torch_forward, kv, states = _forward(dims, is_hybrid, is_fused=False)
    expected = two_row_step(torch_forward, kv, states, is_decode)
    folded, kv, states = _forward(dims, is_hybrid, is_fused=True)
    assert folded.fold_norms() and folded.folds_norms
    got = two_row_step(folded, kv, states, is_decode)
    for got_part, expected_part in zip(got[:2], expected[:2]):  # logits, the KV cache
        torch.testing.assert_close(got_part, expected_part, rtol=1e-4, atol=1e-4)
    for got_state, expected_state in zip(got[2], expected[2]):
        torch.testing.assert_close(got_state, expected_state, rtol=1e-4, atol=1e-4)


def test_the_modules_compute_the_same_function_and_folding_twice_changes_nothing(interpreted):
    """The folded norms' weights become identities and their products' weights take them, so a
    layer's modules give what they gave; a second fold multiplies by ones."""
    dims = decoder_dims(llm_plan().nodes[0], "spec")
    forward, _, _ = _forward(dims, is_hybrid=False, is_fused=True)
    layer = forward.model.model.layers[1]
    x = torch.randn(3, dims.hidden)

    def outputs():
        normed = layer.post_attention_layernorm(x)
        return layer.mlp.gate_proj(normed), layer.self_attn.q_proj(layer.input_layernorm(x))

    before = outputs()
    assert forward.fold_norms()
    once = [p.weight.clone() for p in forward.gate_up + forward.qkv]
    assert torch.equal(layer.post_attention_layernorm.weight, torch.ones(dims.hidden))
    for got, expected in zip(outputs(), before):
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    assert forward.fold_norms()
    assert all(torch.equal(p.weight, w) for p, w in zip(forward.gate_up + forward.qkv, once))


def test_folding_is_refused_where_it_would_change_the_model(interpreted):
    """Not with torch's ops (no kernel takes the scale), not on a tensor-parallel shard, not into a
    product with a bias."""
    dims = decoder_dims(llm_plan().nodes[0], "spec")
    forward, _, _ = _forward(dims, is_hybrid=False, is_fused=False)
    assert not forward.fold_norms() and not forward.folds_norms
    weight = torch.randn(8, 4)
    with_bias = Product(weight, torch.zeros(4), is_transposed=True)
    assert not norm_folding.applies(forward.model, [with_bias])
    assert norm_folding.applies(forward.model, [Product(weight, None, is_transposed=True)])
    forward.model.is_sharded = True
    assert not norm_folding.applies(forward.model, [Product(weight, None, is_transposed=True)])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_gated_delta_net_decode_step_scales_all_in_proj_gave_by_the_rows_norm(interpreted, dtype):
    """The decode kernel with a row norm (the norm before in_proj folded) is the kernel on the
    in-projection's output scaled beforehand: [q|k|v] (the conv, and the window it stores), z, b
    and a; outputs and the slots' conv windows and states equal."""
    from mstar.runtime.engine.gpu import gdn_kernels

    layer, states = small_gdn_layer(dtype)
    copies = [LinearStates([t.clone() for t in states.conv], [t.clone() for t in states.ssm]) for _ in range(2)]
    generator = torch.Generator().manual_seed(6)
    proj = torch.randn(3, layer.conv_dim + layer.num_value_heads * (layer.value_dim + 2), generator=generator)
    proj, x = proj.to(dtype), (3 * torch.randn(3, 48, generator=generator)).to(dtype)
    scaled = (proj.float() * _row_scale(x, 1e-6)).to(dtype)
    slots = torch.tensor([3, 1, 4])
    weights = (layer.conv1d.weight[:, 0, :], layer.A_log, layer.dt_bias)

    def step(projection, copy, row_norm):
        split = [layer.conv_dim, layer.num_value_heads * layer.value_dim, layer.num_value_heads, layer.num_value_heads]
        return gdn_kernels.decode_step(*projection.split(split, dim=-1), copy.conv[0], *weights, copy.ssm[0], slots,
                                       layer.norm.weight, layer.eps, layer.num_heads, row_norm=row_norm)

    expected = step(scaled, copies[0], None)
    got = step(proj, copies[1], kernels.RowNorm(x, 1e-6))
    tolerance = {"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 2e-2, "atol": 2e-2}
    torch.testing.assert_close(got, expected, **tolerance)
    for got_state, expected_state in zip(copies[1].conv + copies[1].ssm, copies[0].conv + copies[0].ssm):
        torch.testing.assert_close(got_state, expected_state, **tolerance)
    assert not torch.equal(copies[1].conv[0], states.conv[0])  # the step wrote the slots


@pytest.mark.parametrize("is_hybrid", [False, True], ids=["llama", "qwen3_5"])
def test_a_folded_decode_step_launches_no_norm_but_the_final_one(interpreted, is_hybrid):
    """Counted on the CPU (`launch_count`): a decode step's every add + norm kernel goes but the
    final norm's (the first layer's norm comes with the embedding either way), a gated delta-net
    layer's norm before in_proj too (its decode kernel takes the scale); o, down and out_proj add
    into the residual stream in their product (addmm_, not mm); nothing else changes."""
    from launch_count import count_launches

    from mstar.runtime.engine.gpu import decode_attention, gdn_kernels

    dims = decoder_dims((hybrid_plan() if is_hybrid else llm_plan()).nodes[0], "spec")

    def decode_launches(fold: bool) -> dict[str, int]:
        forward, kv, states = _forward(dims, is_hybrid, is_fused=True)
        assert forward.fold_norms() if fold else not forward.folds_norms
        return count_launches(lambda: two_row_step(forward, kv, states, is_decode=True),
                              [kernels, gdn_kernels, decode_attention])

    unfolded, folded = decode_launches(False), decode_launches(True)
    num_layers = dims.num_layers
    norms = unfolded.pop("_add_rmsnorm_kernel") - folded.pop("_add_rmsnorm_kernel")
    assert norms == 2 * num_layers - 1, (unfolded, folded)
    moved = unfolded["aten.mm"] - folded.get("aten.mm", 0)
    assert moved == folded.pop("aten.addmm_") == 2 * num_layers, (unfolded, folded)
    unfolded["aten.mm"] -= moved
    assert {k: v for k, v in unfolded.items() if v} == {k: v for k, v in folded.items() if v}
