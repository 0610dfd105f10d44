"""The GPU fast path's fused Triton kernels (`engine/gpu/kernels.py`) under the Triton interpreter
on the CPU, against the torch ops they replace, and the fused forward against the torch forward."""
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")

from engine_plans import hybrid_plan, llm_plan  # noqa: E402
from mstar.runtime.engine.dims import decoder_dims  # noqa: E402
from mstar.runtime.engine.gpu import kernels  # noqa: E402
from mstar.runtime.engine.gpu.device_model import build_decoder  # noqa: E402
from mstar.runtime.engine.gpu.forward import DecoderForward, PagedKv, torch_attend  # noqa: E402
from mstar.runtime.engine.gpu.packing import RowSpec, pack  # noqa: E402
from mstar.runtime.engine.models.gdn import LinearStates  # noqa: E402
from mstar.runtime.engine.models.layers import RMSNorm  # noqa: E402


@pytest.fixture
def interpreted():
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("runs in the interpreter's own process (test_kernels_under_the_interpreter)")
    return kernels


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1", reason="this is the interpreter's process")
def test_kernels_under_the_interpreter():
    """Triton reads TRITON_INTERPRET when it first decorates its own library, so the kernels run
    under the interpreter in a process of their own: this file again, with the variable set."""
    env = dict(os.environ, TRITON_INTERPRET="1")
    result = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", __file__],
                            env=env, capture_output=True, text=True, cwd=Path(__file__).parent)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    assert "10 passed" in result.stdout, result.stdout[-2000:]


@pytest.mark.parametrize("is_zero_centred", [False, True])
def test_add_rmsnorm_matches_the_module(interpreted, is_zero_centred):
    torch.manual_seed(0)
    norm = RMSNorm(48, 1e-5, is_zero_centred).to(torch.bfloat16)
    norm.weight.data.normal_()
    x, delta = torch.randn(5, 48, dtype=torch.bfloat16), torch.randn(5, 48, dtype=torch.bfloat16)
    expected_x = x + delta
    expected = norm(expected_x)
    got = interpreted.add_rmsnorm(x, delta, norm.weight, norm.eps, is_zero_centred)
    torch.testing.assert_close(x, expected_x)  # the residual add is in place (the interpreter may round otherwise)
    assert (got.float() - expected.float()).abs().max() <= 0.02 * expected.float().abs().max()


@pytest.mark.parametrize("rotary", [16, 8])
def test_rope_write_kv_rotates_and_writes_the_cache(interpreted, rotary):
    torch.manual_seed(1)
    n, num_q, num_kv, d = 3, 4, 2, 16
    qkv = torch.randn(n, (num_q + 2 * num_kv) * d)
    q = qkv[:, :num_q * d].view(n, num_q, d)
    k = qkv[:, num_q * d:(num_q + num_kv) * d].view(n, num_kv, d)
    v = qkv[:, (num_q + num_kv) * d:].view(n, num_kv, d)
    angles = torch.rand(10, rotary // 2) * 6
    cos, sin = angles.cos(), angles.sin()
    positions = torch.tensor([7, 0, 3], dtype=torch.int32)
    slots = torch.tensor([5, 2, 9], dtype=torch.int32)
    k_cache, v_cache = torch.zeros(12, num_kv, d), torch.zeros(12, num_kv, d)
    got_q = interpreted.rope_write_kv(q, k, v, cos, sin, positions, slots, k_cache, v_cache, rotary)

    def rotate(x):
        c, s = cos[positions.long()].unsqueeze(1), sin[positions.long()].unsqueeze(1)
        half = rotary // 2
        first, second, rest = x[..., :half], x[..., half:rotary], x[..., rotary:]
        return torch.cat([first * c - second * s, second * c + first * s, rest], dim=-1)

    torch.testing.assert_close(got_q, rotate(q))
    torch.testing.assert_close(k_cache[slots.long()], rotate(k))
    torch.testing.assert_close(v_cache[slots.long()], v)
    assert k_cache.abs().sum() == k_cache[slots.long()].abs().sum()  # no other slot written


def test_silu_mul_matches_torch(interpreted):
    gate_up = torch.randn(3, 2 * 40, dtype=torch.bfloat16)
    gate, up = gate_up.chunk(2, dim=-1)
    expected = F.silu(gate) * up
    got = interpreted.silu_mul(gate_up)
    assert (got.float() - expected.float()).abs().max() <= 0.02 * expected.float().abs().max()


def test_causal_conv_matches_the_torch_gather(interpreted):
    """The eager step's conv kernel against the torch gather of [stored | mixed] columns: rows of
    1, 2 and 6 tokens (taps in the stored columns and in the step), mixed with a row stride."""
    import numpy as np

    from mstar.runtime.engine.gpu import gdn_kernels
    from mstar.runtime.engine.gpu.gdn_forward import linear_layout

    torch.manual_seed(0)
    channels, taps = 40, 4
    layout = linear_layout(np.array([0, 1, 3, 9]), np.array([1, 2, 3]), taps)
    index = torch.from_numpy(layout.host[:layout.sizes[0]]).long().view(9, taps)
    stored = torch.randn(3 * (taps - 1), channels)
    mixed = torch.randn(9, channels + 8)[:, :channels]  # a view with a row stride, as the projection's
    weight = torch.randn(channels, taps)
    got = gdn_kernels.causal_conv(stored, mixed, index, weight)
    columns = torch.cat([stored, mixed])
    expected = F.silu((columns[index] * weight.T).sum(1))
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_decode_conv_step_updates_the_slots_in_place(interpreted):
    """A decode step's conv kernel against the torch window (stored columns + the token): outputs,
    each row's slot moved one column on, other slots untouched; two padding rows share slot 0."""
    from mstar.runtime.engine.gpu import gdn_kernels

    torch.manual_seed(0)
    channels, taps = 40, 4
    state = torch.randn(6, channels, taps - 1)
    slots = torch.tensor([3, 1, 0, 0])
    mixed = torch.randn(4, channels + 8)[:, :channels]  # a row stride, as the projection's
    weight = torch.randn(channels, taps)
    expected_state = state.clone()
    window = torch.cat([state[slots[:2]], mixed[:2].unsqueeze(-1)], dim=-1)
    expected = F.silu((window * weight).sum(-1))
    expected_state[slots[:2]] = window[:, :, 1:]
    got = gdn_kernels.conv_step(mixed, state, slots, weight)
    torch.testing.assert_close(got[:2], expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(state[1:], expected_state[1:], rtol=0, atol=0)  # slot 0: the sink


def test_decode_recurrent_step_matches_the_torch_rule(interpreted):
    """The in-place gated delta rule against `_rule_step` on gathered states (grouped value heads,
    q/k/v views with a row stride), the slots written back, other slots untouched."""
    from mstar.runtime.engine.gpu import gdn_kernels
    from mstar.runtime.engine.gpu.gdn_forward import _prepare_qk, _rule_step

    torch.manual_seed(0)
    rows, heads, value_heads, key_dim, value_dim = 3, 2, 4, 16, 32
    conv = torch.randn(rows, 2 * heads * key_dim + value_heads * value_dim)
    q = conv[:, :heads * key_dim].reshape(rows, heads, key_dim)
    k = conv[:, heads * key_dim:2 * heads * key_dim].reshape(rows, heads, key_dim)
    v = conv[:, 2 * heads * key_dim:].reshape(rows, value_heads, value_dim)
    g = -torch.rand(rows, value_heads)
    beta = torch.rand(rows, value_heads)
    state = torch.randn(5, value_heads, key_dim, value_dim)
    slots = torch.tensor([4, 1, 2])
    qn, kn = _prepare_qk(q, k, value_heads)
    expected, expected_rows = _rule_step(qn, kn, v, g, beta, state[slots])
    expected_state = state.clone()
    expected_state[slots] = expected_rows
    got = gdn_kernels.recurrent_step(q, k, v, g, beta, state, slots)
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(state, expected_state, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("is_hybrid", [False, True], ids=["llama", "qwen3_5"])
def test_fused_forward_matches_the_torch_forward(interpreted, is_hybrid):
    """The whole step with the fused kernels (forced on, on the CPU) against the torch ops, fp32; the
    Qwen3.5 hybrid adds zero-centred norms, partial RoPE, the gated attention output and the gated
    delta-net layers."""
    dims = decoder_dims((hybrid_plan() if is_hybrid else llm_plan()).nodes[0], "spec")
    outputs = []
    for is_fused in (False, True):
        model = build_decoder(dims, torch.device("cpu"), torch.float32, position=0, seed=0)
        kv = PagedKv(dims.num_full_layers, 16, 16, dims.num_kv_heads, dims.head_dim, torch.float32,
                     torch.device("cpu"))
        kv.data.zero_()
        states = LinearStates.for_dims(dims, 4) if is_hybrid else None
        forward = DecoderForward(model, dims, kv, 256, states)
        forward.is_fused = is_fused
        if forward.gdn is not None:  # the eager step's conv kernel too
            forward.gdn.is_fused = is_fused
        rows = [RowSpec([3, 5, 7], 0, [0], 1), RowSpec([9, 2], 0, [1], 2)]
        packed = pack(rows, 16, kv.dummy_page)
        data = torch.from_numpy(packed.host)
        ids, positions, slots, _, last_index, row_slot = data.split(packed.field_sizes())
        layout = forward.linear_layout(packed)
        linear = None if layout is None else layout.on_device(torch.from_numpy(layout.host), row_slot)
        attend = torch_attend(packed.qo_indptr.tolist(), packed.kv_indptr.tolist(), packed.kv_indices,
                              packed.last_page_len.tolist(), 16, dims.head_dim ** -0.5)
        outputs.append((forward(ids.long(), positions, slots, last_index, attend, linear), kv.data.clone()))
    (logits, cache), (fused_logits, fused_cache) = outputs
    torch.testing.assert_close(fused_logits, logits, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(fused_cache, cache, rtol=1e-4, atol=1e-4)
