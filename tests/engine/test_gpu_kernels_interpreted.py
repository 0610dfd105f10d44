"""The GPU fast path's fused Triton kernels (`engine/gpu/kernels.py`) under the Triton interpreter
on the CPU, against the torch ops they replace, and the fused forward against the torch forward."""
import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")

from interpreter_child import parent_only, run_child, skip_unless_child  # noqa: E402

from engine_plans import hybrid_plan, llm_plan  # noqa: E402
from fused_steps import fused_forward, two_row_step  # noqa: E402
from gdn_layer import small_gdn_layer  # noqa: E402
from mstar.plan.dims import decoder_dims  # noqa: E402
from mstar.runtime.engine.gpu import kernels  # noqa: E402
from mstar.runtime.engine.models.gdn import LinearStates  # noqa: E402
from mstar.runtime.engine.models.layers import RMSNorm  # noqa: E402


@pytest.fixture
def interpreted():
    skip_unless_child("test_kernels_under_the_interpreter")
    return kernels


@parent_only
def test_kernels_under_the_interpreter():
    """Triton reads TRITON_INTERPRET when it first decorates its own library, so the kernels run
    under the interpreter in a process of their own: this file again, with the variable set."""
    run_child(__file__, "54 passed")


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


def test_add_rmsnorm_gathers_rows_and_leaves_x(interpreted):
    """The final norm of each row's last token: rows gathered by the kernel (a row twice, out of
    order), x not written."""
    torch.manual_seed(0)
    norm = RMSNorm(48, 1e-5).to(torch.bfloat16)
    norm.weight.data.normal_()
    x, delta = torch.randn(6, 48, dtype=torch.bfloat16), torch.randn(6, 48, dtype=torch.bfloat16)
    before = x.clone()
    rows = torch.tensor([4, 0, 4, 2], dtype=torch.int32)
    expected = norm((x + delta)[rows.long()])
    got = interpreted.add_rmsnorm(x, delta, norm.weight, norm.eps, rows=rows)
    assert got.shape == (4, 48) and torch.equal(x, before)
    assert (got.float() - expected.float()).abs().max() <= 0.02 * expected.float().abs().max()


@pytest.mark.parametrize("is_fed", [True, False], ids=["fed", "packed-ids"])
@pytest.mark.parametrize("is_zero_centred", [False, True])
def test_embed_rmsnorm_matches_fed_ids_the_embedding_and_the_norm(interpreted, is_zero_centred, is_fed):
    """The step's first kernel: ids read from the device token table where the source is a slot
    (`packing.fed_ids`), taken modulo the vocabulary as `Decoder.embed_tokens` (ids past it and
    negative ones), the embedding rows as x and their norm."""
    from mstar.runtime.engine.gpu.packing import fed_ids

    torch.manual_seed(3)
    vocab = 37
    table = torch.randn(vocab, 48, dtype=torch.bfloat16)
    norm = RMSNorm(48, 1e-5, is_zero_centred).to(torch.bfloat16)
    norm.weight.data.normal_()
    ids = torch.tensor([3, 40, -2, 0, 36], dtype=torch.int32)
    src = torch.tensor([-1, -1, -1, 2, 0], dtype=torch.int32)
    loop_tokens = torch.tensor([5, 9, 75, 1], dtype=torch.long)
    chosen = fed_ids(ids, src, loop_tokens) if is_fed else ids.long()
    expected_x = table[chosen % vocab]
    got_x, got = interpreted.embed_rmsnorm(ids, src if is_fed else None, loop_tokens if is_fed else None, table,
                                           norm.weight, norm.eps, is_zero_centred)
    assert torch.equal(got_x, expected_x)
    expected = norm(expected_x)
    assert (got.float() - expected.float()).abs().max() <= 0.02 * expected.float().abs().max()


@pytest.mark.parametrize("norm", [None, "plain", "zero_centred"])
@pytest.mark.parametrize("rotary", [16, 8])
def test_rope_write_kv_rotates_and_writes_the_cache(interpreted, rotary, norm):
    """RoPE and the K/V write; with q/k norms (`QkNorm`) q and k are first normed per head as
    `RMSNorm` does, q then a view of [query | gate] heads (a head stride of 2 D)."""
    torch.manual_seed(1)
    n, num_q, num_kv, d = 3, 4, 2, 16
    q_width = num_q * d * (2 if norm else 1)
    qkv = torch.randn(n, q_width + 2 * num_kv * d)
    if norm:
        q = qkv[:, :q_width].view(n, num_q, 2 * d)[:, :, :d]
    else:
        q = qkv[:, :q_width].view(n, num_q, d)
    k = qkv[:, q_width:q_width + num_kv * d].view(n, num_kv, d)
    v = qkv[:, q_width + num_kv * d:].view(n, num_kv, d)
    angles = torch.rand(10, rotary // 2) * 6
    cos, sin = angles.cos(), angles.sin()
    positions = torch.tensor([7, 0, 3], dtype=torch.int32)
    slots = torch.tensor([5, 2, 9], dtype=torch.int32)
    k_cache, v_cache = torch.zeros(12, num_kv, d), torch.zeros(12, num_kv, d)
    qk_norm = None
    expected_q, expected_k = q, k
    if norm:
        q_norm, k_norm = RMSNorm(d, 1e-6, norm == "zero_centred"), RMSNorm(d, 1e-6, norm == "zero_centred")
        q_norm.weight.data.normal_(), k_norm.weight.data.normal_()
        qk_norm = interpreted.QkNorm(q_norm.weight.data, k_norm.weight.data, 1e-6, norm == "zero_centred")
        expected_q, expected_k = q_norm(q).detach(), k_norm(k).detach()
    got_q = interpreted.rope_write_kv(q, k, v, cos, sin, positions, slots, k_cache, v_cache, rotary, qk_norm)

    def rotate(x):
        c, s = cos[positions.long()].unsqueeze(1), sin[positions.long()].unsqueeze(1)
        half = rotary // 2
        first, second, rest = x[..., :half], x[..., half:rotary], x[..., rotary:]
        return torch.cat([first * c - second * s, second * c + first * s, rest], dim=-1)

    torch.testing.assert_close(got_q, rotate(expected_q))
    torch.testing.assert_close(k_cache[slots.long()], rotate(expected_k))
    torch.testing.assert_close(v_cache[slots.long()], v)
    assert k_cache.abs().sum() == k_cache[slots.long()].abs().sum()  # no other slot written


def test_sigmoid_gate_matches_torch(interpreted):
    """Qwen3.5's gated attention output: x times sigmoid of a strided [query | gate] view, bf16."""
    torch.manual_seed(2)
    x = torch.randn(3, 4 * 16, dtype=torch.bfloat16)
    gate = torch.randn(3, 4, 2 * 16, dtype=torch.bfloat16)[:, :, 16:]
    expected = x * torch.sigmoid(gate.reshape(3, -1))
    got = interpreted.sigmoid_gate(x, gate)
    assert (got.float() - expected.float()).abs().max() <= 0.02 * expected.float().abs().max()


def test_silu_mul_matches_torch(interpreted):
    gate_up = torch.randn(3, 2 * 40, dtype=torch.bfloat16)
    gate, up = gate_up.chunk(2, dim=-1)
    expected = F.silu(gate) * up
    got = interpreted.silu_mul(gate_up)
    assert (got.float() - expected.float()).abs().max() <= 0.02 * expected.float().abs().max()


@pytest.mark.parametrize("is_in_place", [True, False], ids=["in-place", "other-copy"])
def test_causal_conv_and_conv_store_match_the_torch_gather(interpreted, is_in_place):
    """The eager step's conv kernel and its store of the rows' new windows against the torch gather
    of [stored | mixed] columns: rows of 1, 2 and 6 tokens (taps and new columns in the stored
    columns and in the step) on slots read through `read`, mixed with a row stride; the new columns
    written back into the rows' slots or into other ones, no other slot touched; the conv into a
    given buffer as into a new one."""
    import numpy as np

    from mstar.runtime.engine.gpu import gdn_kernels
    from mstar.runtime.engine.gpu.gdn_forward import linear_layout

    torch.manual_seed(0)
    channels, taps = 40, 4
    layout = linear_layout(np.array([0, 1, 3, 9]), taps)
    index, state_index = (torch.from_numpy(part).long() for part in
                          np.split(layout.host, np.cumsum(layout.sizes))[:2])
    index, state_index = index.view(9, taps), state_index.view(3, taps - 1)
    conv_state = torch.randn(8, channels, taps - 1)
    read = torch.tensor([5, 2, 6])
    write = read if is_in_place else torch.tensor([1, 7, 3])
    mixed = torch.randn(9, channels + 8)[:, :channels]  # a view with a row stride, as the projection's
    weight = torch.randn(channels, taps)
    columns = torch.cat([conv_state[read].transpose(1, 2).reshape(-1, channels), mixed])
    expected = F.silu((columns[index] * weight.T).sum(1))
    expected_state = conv_state.clone()
    expected_state[write] = columns[state_index].transpose(1, 2)
    got = gdn_kernels.causal_conv(conv_state, read, mixed, index, weight)
    buffer = torch.full((9, channels), float("nan"))  # a given output buffer (a step's, reused by its layers)
    assert gdn_kernels.causal_conv(conv_state, read, mixed, index, weight, out=buffer) is buffer
    assert torch.equal(buffer, got)
    with pytest.raises(ValueError, match="out must be a contiguous"):
        gdn_kernels.causal_conv(conv_state, read, mixed, index, weight, out=torch.empty(channels, 9).T)
    gdn_kernels.conv_store(conv_state, read, write, mixed, state_index)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    assert torch.equal(conv_state, expected_state)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("block_v, value_dim, key_dim", [(0, 32, 16), (16, 32, 16), (8, 32, 16), (8, 24, 16),
                                                     (16, 24, 12)],
                         ids=["one-part", "two-parts", "four-parts", "three-parts-of-24", "a-masked-part"])
@pytest.mark.parametrize("num_value_heads", [2, 4], ids=["heads", "grouped"])
def test_decode_step_kernel_matches_the_torch_layer(interpreted, dtype, block_v, value_dim, key_dim,
                                                    num_value_heads):
    """The decode-only step's one kernel (conv, gates, rule, gated norm between the projections)
    against the torch arithmetic of the same layer: outputs, the rows' conv windows and states;
    slots of no row untouched; two padding rows on slot 0, the sink, touch nothing else; the value
    columns in 1-4 parts a head (a head of 24 in three; in parts of 16 and 8 beside q/k heads of
    12), whose arrival counters are left zero. The interpreter runs a head's parts in order, the
    kernel numbers them down: the last part to arrive is part 0, so a kernel that took the last part
    for the last to arrive would norm before the others wrote and fail here."""
    import copy

    from mstar.runtime.engine.gpu import gdn_kernels
    from mstar.runtime.engine.gpu.gdn_forward import GdnForward, LinearStep

    layer, states = small_gdn_layer(dtype, num_value_heads, value_dim, key_dim)
    before = LinearStates([t.clone() for t in states.conv], [t.clone() for t in states.ssm])
    original = [states.conv[0].clone(), states.ssm[0].clone()]
    slots = torch.tensor([3, 1, 0, 0])
    h = torch.randn(4, 48).to(dtype)
    reference = GdnForward([copy.deepcopy(layer)], before)
    reference.is_fused = False
    expected = reference(0, h, LinearStep.of(slots, before))
    fused = GdnForward([layer], states)
    proj = fused.in_proj[0](h)
    value_width = layer.num_value_heads * layer.value_dim
    mixed, z, b, a = proj.split([layer.conv_dim, value_width, layer.num_value_heads, layer.num_value_heads], dim=-1)
    counts = torch.zeros(4 * layer.num_heads, dtype=torch.int32)
    gated = gdn_kernels.decode_step(mixed, z, b, a, states.conv[0], layer.conv1d.weight[:, 0, :], layer.A_log,
                                    layer.dt_bias, states.ssm[0], slots, layer.norm.weight, layer.eps,
                                    layer.num_heads, block_v=block_v, counts=counts)
    got = torch.nn.functional.linear(gated, layer.out_proj.weight)
    assert not counts.any()
    # bf16: the interpreter rounds to bf16 by truncating (a GPU rounds to nearest), at every rounding
    # step of the torch arithmetic, so only fp32 checks the arithmetic closely.
    tolerance = 1e-5 if dtype == torch.float32 else 4e-2

    def rel(x, y):
        return ((x.float() - y.float()).norm() / y.float().norm()).item()

    assert rel(got[:2], expected[:2]) < tolerance  # rows 2 and 3: padding
    assert torch.equal(states.conv[0][1:], before.conv[0][1:])  # the stored columns are copies; slot 0: the sink
    assert rel(states.ssm[0][1:], before.ssm[0][1:]) < tolerance
    for got_state, old in zip((states.conv[0], states.ssm[0]), original):
        for slot in (2, 4, 5):  # no row's slot
            assert torch.equal(got_state[slot], old[slot])
        for slot in (1, 3):
            assert not torch.equal(got_state[slot], old[slot])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_eager_gates_and_gated_norm_match_the_torch_ops(interpreted, dtype):
    """An eager step's gates and gated norm, one launch each, against the torch ops they replace
    (inputs as the in-projection's strided views; gates with a past 20 where softplus is x)."""
    import torch.nn.functional as F

    from mstar.runtime.engine.gpu import gdn_kernels

    torch.manual_seed(0)
    rows, value_heads, value_dim = 5, 4, 24
    proj = (torch.randn(rows, value_heads * value_dim + 2 * value_heads + 3) * 3).to(dtype)
    z, b, a, _ = proj.split([value_heads * value_dim, value_heads, value_heads, 3], dim=1)
    a[0, 0] = 25.0
    a_log, dt_bias = torch.randn(value_heads) * 0.5, torch.randn(value_heads)
    g, beta = gdn_kernels.eager_gates(a, b, a_log, dt_bias)
    expected_g = -a_log.float().exp() * F.softplus(a.float() + dt_bias.float())
    assert g.dtype == torch.float32 and beta.dtype == dtype
    torch.testing.assert_close(g, expected_g, rtol=1e-5, atol=1e-6)
    # bf16: the interpreter rounds to bf16 by truncating (a GPU rounds to nearest): one unit apart
    tolerance = 1e-5 if dtype == torch.float32 else 8e-3
    torch.testing.assert_close(beta.float(), torch.sigmoid(b.float()).to(dtype).float(), rtol=tolerance, atol=1e-6)
    out = torch.randn(rows, value_heads, value_dim).to(dtype)
    weight = torch.randn(value_dim).to(dtype)
    gated = gdn_kernels.eager_gated_norm(out, z, weight, 1e-6)
    out32 = out.float()
    normed = out32 * torch.rsqrt(out32.pow(2).mean(-1, keepdim=True) + 1e-6)
    expected = (weight * normed.to(dtype) * F.silu(z.reshape(rows, value_heads, value_dim).float()).to(dtype))
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2  # bf16: a few roundings, each truncated here
    torch.testing.assert_close(gated.float(), expected.reshape(rows, -1).float(), rtol=tolerance, atol=tolerance)


def test_decode_step_forward_launches_three_kernels_a_layer(interpreted):
    """A decode-only step of a gated delta-net layer on the fused path is three launches: the
    in-projection, the one Triton kernel, out_proj (counted by `launch_count`); the forward's first
    step also zeroes the kernel's arrival counters, which every later layer and step reuses (the
    kernel leaves them zero): no allocation or memset in a decode graph."""
    from launch_count import count_launches

    from mstar.runtime.engine.gpu import gdn_kernels
    from mstar.runtime.engine.gpu.gdn_forward import GdnForward, LinearStep

    layer, states = small_gdn_layer(torch.bfloat16)
    forward = GdnForward([layer], states)
    forward.is_fused = True
    step = LinearStep.of(torch.tensor([3, 1, 0, 0]), states)
    h = torch.randn(4, 48).to(torch.bfloat16)
    launches = count_launches(lambda: forward(0, h, step), [gdn_kernels])
    assert launches == {"aten.mm": 2, "_decode_step_kernel": 1, "aten.zeros": 1}, launches
    launches = count_launches(lambda: forward(0, h, step), [gdn_kernels])
    assert launches == {"aten.mm": 2, "_decode_step_kernel": 1}, launches
    later = LinearStep.of(torch.tensor([2, 0, 0]), states)  # a later step, fewer rows: the same counters
    launches = count_launches(lambda: forward(0, h[:3], later), [gdn_kernels])
    assert launches == {"aten.mm": 2, "_decode_step_kernel": 1}, launches
    assert later.counts.data_ptr() == step.counts.data_ptr() and not later.counts.any() and not step.counts.any()


@pytest.mark.parametrize("cu, expected, again", [
    ([0, 1, 6, 7, 10], {"aten.mm": 2, "_eager_gates_kernel": 1, "_causal_conv_kernel": 1, "_conv_store_kernel": 1,
                        "aten.new_zeros": 1, "aten.index": 5, "aten.index_select": 5, "_recurrent_step_kernel": 1,
                        "aten.index_copy_": 2, "_eager_gated_norm_kernel": 1}, {"aten.index": 1}),
    ([0, 5, 9], {"aten.mm": 2, "_eager_gates_kernel": 1, "_causal_conv_kernel": 1, "_conv_store_kernel": 1,
                 "aten.index": 3, "aten.index_copy_": 1, "_eager_gated_norm_kernel": 1}, {"aten.index": 1})],
    ids=["mixed", "prompts"])
def test_eager_step_launches_of_a_layer(interpreted, cu, expected, again):
    """An eager step of a gated delta-net layer on the fused path (rows of these token counts; fla's
    chunk kernel stood in for by a function that launches nothing): the launches, counted by
    `launch_count`, in the step's first layer and in a later one (`again`: what differs). An eager
    hybrid step waits on its host's launches (docs/engine.md): the gates, the gated norm, the conv
    and the store of the rows' windows are one kernel each (they were 9, 12, 3 and 10 torch
    launches); the decode rows' kernel reads their tokens and writes their outputs in place, and
    prompts alone skip the gathers of their tokens and the scatter of the outputs; the rows' slots
    are gathered once a step; what is left is the gathers of a mixed step's prompt tokens and the
    prompt rows' states and their scatters."""
    import numpy as np
    from launch_count import count_launches

    from mstar.runtime.engine.gpu import gdn_kernels
    from mstar.runtime.engine.gpu.gdn_forward import GdnForward, linear_layout

    layer, states = small_gdn_layer(torch.bfloat16)
    forward = GdnForward([layer], states)
    forward.is_fused = True
    forward.kernels = lambda q, k, v, g, beta, initial_state, **kwargs: (torch.empty(v.shape, dtype=v.dtype),
                                                                         initial_state)
    layout = linear_layout(np.array(cu), layer.conv_kernel)
    step = layout.on_device(torch.from_numpy(layout.host), torch.arange(1, len(cu)), states)
    h = torch.randn(cu[-1], 48).to(torch.bfloat16)
    with torch.no_grad():
        first = count_launches(lambda: forward(0, h, step), [gdn_kernels])
        later = count_launches(lambda: forward(0, h, step), [gdn_kernels])
    assert first == expected, first
    assert later == dict(expected, **again), later


def _conv_qkv(tokens: int, heads: int, value_heads: int, key_dim: int, value_dim: int):
    """Random q, k, v `[T, heads, d]` as views of one conv output (row stride, heads contiguous), as
    the eager step hands them to the rule."""
    conv = torch.randn(tokens, 2 * heads * key_dim + value_heads * value_dim)
    q = conv[:, :heads * key_dim].reshape(tokens, heads, key_dim)
    k = conv[:, heads * key_dim:2 * heads * key_dim].reshape(tokens, heads, key_dim)
    return q, k, conv[:, 2 * heads * key_dim:].reshape(tokens, value_heads, value_dim)


def test_decode_recurrent_step_matches_the_torch_rule(interpreted):
    """The in-place gated delta rule against `_rule_step` on gathered states (grouped value heads,
    q/k/v views with a row stride), the slots written back, other slots untouched."""
    from mstar.runtime.engine.gpu import gdn_kernels
    from mstar.runtime.engine.gpu.gdn_forward import _prepare_qk, _rule_step

    torch.manual_seed(0)
    rows, heads, value_heads, key_dim, value_dim = 3, 2, 4, 16, 32
    q, k, v = _conv_qkv(rows, heads, value_heads, key_dim, value_dim)
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



def test_decode_step_kernel_writes_the_other_copy(interpreted):
    """With two copies of each slot (`LinearStates` versions=2) the decode step's kernel reads the
    rows' current copies, leaves them as they were and writes the others with what the in-place
    kernel leaves in the slot; the rows' bits flip (`gdn_kernels.step_slots`, the kernel too)."""
    from mstar.runtime.engine.gpu import gdn_kernels

    layer, one = small_gdn_layer(torch.bfloat16)
    two = LinearStates.zeros(1, 6, layer.conv_dim, layer.conv_kernel, layer.num_value_heads, layer.key_dim,
                             layer.value_dim, versions=2)
    assert two.version is not None
    two.version[1] = 1  # slot 1's current copy is its second one
    for got, old in zip(two.conv + two.ssm, one.conv + one.ssm):
        got[:6] = old
        got[7] = old[1]
        got[1] = float("nan")  # slot 1's other copy: written over, never read
    before = [t.clone() for t in two.conv + two.ssm]
    slots = torch.tensor([3, 1, 0, 0])
    read, write = gdn_kernels.step_slots(slots, two.version)
    assert read.tolist()[:2] == [3, 7] and write.tolist()[:2] == [9, 1] and two.version[[1, 3]].tolist() == [0, 1]
    proj = torch.nn.functional.linear(torch.randn(4, 48).to(torch.bfloat16), torch.cat(
        [layer.in_proj_qkv.weight, layer.in_proj_z.weight, layer.in_proj_b.weight, layer.in_proj_a.weight]))
    width = layer.num_value_heads * layer.value_dim
    mixed, z, b, a = proj.split([layer.conv_dim, width, layer.num_value_heads, layer.num_value_heads], dim=-1)
    args = (mixed, z, b, a)
    weights = (layer.conv1d.weight[:, 0, :], layer.A_log, layer.dt_bias)
    in_place = gdn_kernels.decode_step(*args, one.conv[0], *weights, one.ssm[0], slots, layer.norm.weight,
                                       layer.eps, layer.num_heads)
    got = gdn_kernels.decode_step(*args, two.conv[0], *weights, two.ssm[0], read, layer.norm.weight, layer.eps,
                                  layer.num_heads, write_slots=write)
    assert torch.equal(got[:2], in_place[:2])
    for tensor, old, expected in zip(two.conv + two.ssm, before, one.conv + one.ssm):
        assert torch.equal(tensor[[3, 7]], old[[3, 7]])  # the copies read
        assert torch.equal(tensor[[9, 1]], expected[[3, 1]])  # the copies written


def test_recurrent_step_kernel_reads_its_rows_tokens_among_the_steps(interpreted):
    """Decode rows among an eager step's tokens: the kernel given the rows' token indices and the
    step's output equals the kernel on the gathered tokens scattered back, and leaves the other
    tokens' outputs as they were."""
    from mstar.runtime.engine.gpu import gdn_kernels

    torch.manual_seed(0)
    num_tokens, heads, value_heads, key_dim, value_dim = 6, 2, 4, 16, 32
    q, k, v = _conv_qkv(num_tokens, heads, value_heads, key_dim, value_dim)
    g, beta = -torch.rand(num_tokens, value_heads), torch.rand(num_tokens, value_heads)
    state = torch.randn(8, value_heads, key_dim, value_dim)
    tokens, slots, write = torch.tensor([4, 1]), torch.tensor([3, 6]), torch.tensor([2, 7])
    gathered_state = state.clone()
    rows = gdn_kernels.recurrent_step(q[tokens], k[tokens], v[tokens], g[tokens], beta[tokens], gathered_state, slots,
                                      write)
    out = torch.full((num_tokens, value_heads, value_dim), 5.0)
    got = gdn_kernels.recurrent_step(q, k, v, g, beta, state, slots, write, tokens=tokens, out=out)
    assert got is out
    assert torch.equal(out[tokens], rows) and (out[[0, 2, 3, 5]] == 5.0).all()
    assert torch.equal(state, gathered_state)


def test_recurrent_step_kernel_writes_the_other_copy(interpreted):
    from mstar.runtime.engine.gpu import gdn_kernels

    torch.manual_seed(0)
    rows, heads, value_heads, key_dim, value_dim = 2, 2, 4, 16, 32
    q, k = torch.randn(rows, heads, key_dim), torch.randn(rows, heads, key_dim)
    v = torch.randn(rows, value_heads, value_dim)
    g, beta = -torch.rand(rows, value_heads), torch.rand(rows, value_heads)
    state = torch.randn(8, value_heads, key_dim, value_dim)
    in_place = state.clone()
    expected = gdn_kernels.recurrent_step(q, k, v, g, beta, in_place, torch.tensor([1, 2]))
    before = state.clone()
    got = gdn_kernels.recurrent_step(q, k, v, g, beta, state, torch.tensor([1, 2]), write_slots=torch.tensor([5, 6]))
    assert torch.equal(got, expected)
    assert torch.equal(state[:5], before[:5]) and torch.equal(state[7], before[7])
    assert torch.equal(state[[5, 6]], in_place[[1, 2]])

@pytest.mark.parametrize("is_decode", [False, True], ids=["prompts", "decode"])
@pytest.mark.parametrize("is_hybrid", [False, True], ids=["llama", "qwen3_5"])
def test_fused_forward_matches_the_torch_forward(interpreted, is_hybrid, is_decode):
    """The whole step with the fused kernels (forced on, on the CPU) against the torch ops, fp32 (a
    decode row's token read from the device token table: the fused embedding's `fed`); the
    Qwen3.5 hybrid adds zero-centred norms, partial RoPE, the gated attention output and the gated
    delta-net layers (a decode-only step: their one kernel between the projections; prompts: the
    eager step's kernels)."""
    dims = decoder_dims((hybrid_plan() if is_hybrid else llm_plan()).nodes[0], "spec")
    outputs = [two_row_step(*fused_forward(dims, is_hybrid, is_fused), is_decode) for is_fused in (False, True)]
    (logits, cache, recurrent), (fused_logits, fused_cache, fused_recurrent) = outputs
    torch.testing.assert_close(fused_logits, logits, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(fused_cache, cache, rtol=1e-4, atol=1e-4)
    for got, expected in zip(fused_recurrent, recurrent):  # every slot's conv window and state
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)


def test_keeping_every_positions_states_leaves_the_steps_logits(interpreted):
    """A step that keeps every position's final states (a prompt's log-probabilities) gives the
    logits of a step that does not, and its kept rows at the rows' last positions are the states the
    logits come from: the fused norm of every position moves x on in place, and the last positions'
    norm added the residual again (logits of norm(x + 2 delta), a wrong token on the GPU)."""
    dims = decoder_dims(llm_plan().nodes[0], "spec")
    plain, _, _ = two_row_step(*fused_forward(dims, False, True), False)
    forward, kv, states = fused_forward(dims, False, True)
    forward.keep_hidden = True
    kept, _, _ = two_row_step(forward, kv, states, False)
    torch.testing.assert_close(kept, plain, rtol=1e-5, atol=1e-5)
    last = torch.tensor([2, 4])  # the two prompts' (3 and 2 tokens) last positions
    torch.testing.assert_close(forward.lm_logits(forward.hidden[last]), plain, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("vocab", [10_000, 4096, 37])
def test_argmax_rows_takes_the_first_index_of_the_maximum_as_torch(interpreted, vocab):
    """Ties inside a chunk and across chunks go to the first column, as torch.argmax's; a row of
    -inf gives column 0; a maximum in the last column of a partial chunk is found."""
    torch.manual_seed(2)
    logits = torch.randn(5, vocab)
    logits[1, [vocab // 3, vocab - 1, 2]] = 9.0  # a tie across chunks (and inside the first)
    logits[2] = float("-inf")
    logits[3, vocab - 1] = 10.0
    logits[4] = logits[4].to(torch.bfloat16).float()  # bf16 logits: many equal values
    expected = logits.argmax(-1)
    assert torch.equal(interpreted.argmax_rows(logits), expected)
    out = torch.full((5,), -1, dtype=torch.long)
    assert interpreted.argmax_rows(logits, out) is out and torch.equal(out, expected)
    assert expected[1] == 2 and expected[2] == 0
