"""The split-K product for a decode step's few rows (`engine/gpu/skinny_products.py`) under the
Triton interpreter on the CPU, against torch's product of the same bf16 operands."""
import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")

from interpreter_child import parent_only, run_child, skip_unless_child  # noqa: E402

from mstar.runtime.engine.gpu import skinny_products  # noqa: E402
from mstar.runtime.engine.gpu.skinny_products import SkinnyConfig, Workspace  # noqa: E402


@pytest.fixture
def skinny():
    skip_unless_child("test_skinny_products_under_the_interpreter")
    return skinny_products


@parent_only
def test_skinny_products_under_the_interpreter():
    run_child(__file__, "15 passed")


def _operands(rows: int, k: int, n: int, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, k, generator=generator).to(torch.bfloat16)
    weight = (torch.randn(k, n, generator=generator) * k ** -0.5).to(torch.bfloat16)
    return x, weight


def _close(got: torch.Tensor, expected: torch.Tensor) -> None:
    """bf16 outputs of fp32 sums taken in another order: within a few bf16 ulps of the magnitude."""
    assert got.shape == expected.shape and got.dtype == expected.dtype
    scale = expected.float().abs().max().clamp(min=1.0)
    assert (got.float() - expected.float()).abs().max() <= 0.02 * scale


@pytest.mark.parametrize("rows, k, n, config", [
    (1, 96, 40, SkinnyConfig(block_n=16, block_k=16, split=1)),  # one piece: no partials
    (5, 96, 40, SkinnyConfig(block_n=16, block_k=16, split=3)),  # ragged columns, three pieces
    (17, 100, 48, SkinnyConfig(block_n=32, block_k=16, split=4)),  # ragged K: the last piece is short
    (64, 64, 32, SkinnyConfig(block_n=16, block_k=16, split=8)),  # more pieces asked than K holds
])
def test_the_product_matches_torch(skinny, rows, k, n, config):
    x, weight = _operands(rows, k, n)
    workspace = Workspace(torch.device("cpu"))
    got = skinny.skinny_mm(x, weight, None, config, workspace)
    _close(got, (x.float() @ weight.float()).to(torch.bfloat16))
    assert not workspace.counters.any(), "the last program of a tile sets its counter back to zero"


def test_bias_is_added_once(skinny):
    x, weight = _operands(3, 64, 24)
    bias = torch.randn(24, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    got = skinny.skinny_mm(x, weight, bias, SkinnyConfig(16, 16, 4), Workspace(torch.device("cpu")))
    _close(got, (x.float() @ weight.float() + bias.float()).to(torch.bfloat16))


def test_gated_input_is_silu_mul_of_gate_and_up(skinny):
    """down's operand: silu(gate) * up of the gate/up product's output, rounded as the kernel it replaces."""
    generator = torch.Generator().manual_seed(1)
    gate_up = torch.randn(6, 2 * 80, generator=generator).to(torch.bfloat16)
    _, weight = _operands(6, 80, 32, seed=2)
    gate, up = gate_up.chunk(2, dim=-1)
    act = F.silu(gate) * up  # torch's bf16 rounding, as kernels.silu_mul
    got = skinny.skinny_mm(gate_up, weight, None, SkinnyConfig(16, 16, 3), Workspace(torch.device("cpu")), gated=True)
    _close(got, (act.float() @ weight.float()).to(torch.bfloat16))


@pytest.mark.parametrize("config", [SkinnyConfig(16, 16, 1), SkinnyConfig(16, 16, 3)], ids=["one piece", "split"])
def test_into_adds_the_product_and_the_bias_into_the_output_in_place(skinny, config):
    """`Product.accumulate` on the kernel: `into += x @ W + b` in one launch, one rounding of the
    fp32 sum (cuBLAS's beta = 1)."""
    from mstar.runtime.engine.gpu.products import Product

    x, weight = _operands(5, 64, 40)
    generator = torch.Generator().manual_seed(2)
    bias = torch.randn(40, generator=generator).to(torch.bfloat16)
    residual = torch.randn(5, 40, generator=generator).to(torch.bfloat16)
    expected = (residual.float() + x.float() @ weight.float() + bias.float()).to(torch.bfloat16)
    into = residual.clone()
    assert skinny.skinny_mm(x, weight, bias, config, Workspace(torch.device("cpu")), into=into) is into
    _close(into, expected)
    product = Product(weight, bias, is_transposed=True)
    assert skinny.attach([product], torch.device("cpu"), sm_count=8, config=config) == 1
    into = residual.clone()
    assert product.accumulate(into, x) is into
    _close(into, expected)
    with pytest.raises(ValueError, match="into"):
        skinny.skinny_mm(x, weight, None, config, Workspace(torch.device("cpu")), into=residual[:, :8])


def test_one_workspace_serves_products_one_after_another(skinny):
    """A step's products share their function's workspace: partials of one never leak into the next."""
    workspace = Workspace(torch.device("cpu"))
    for seed, (k, n) in enumerate([(64, 48), (128, 16), (64, 48)]):
        x, weight = _operands(9, k, n, seed)
        got = skinny.skinny_mm(x, weight, None, SkinnyConfig(16, 16, 4), workspace)
        _close(got, (x.float() @ weight.float()).to(torch.bfloat16))


def test_rows_past_the_limit_and_mismatched_shapes_are_refused(skinny):
    workspace = Workspace(torch.device("cpu"))
    x, weight = _operands(65, 32, 16)
    with pytest.raises(ValueError, match="at most 64 rows"):
        skinny.skinny_mm(x, weight, None, SkinnyConfig(16, 16, 1), workspace)
    with pytest.raises(ValueError, match="does not fit"):
        skinny.skinny_mm(x[:4, :16], weight, None, SkinnyConfig(16, 16, 1), workspace)


def test_no_rows_launch_nothing(skinny):
    x, weight = _operands(0, 32, 16)
    got = skinny.skinny_mm(x, weight, None, SkinnyConfig(16, 16, 2), Workspace(torch.device("cpu")))
    assert got.shape == (0, 16)


def test_a_product_takes_its_few_rows_steps_and_leaves_the_rest(skinny):
    """`attach`: steps of at most 64 rows on the kernel (the gated call too), more rows on torch's product."""
    from mstar.runtime.engine.gpu.products import Product

    _, weight = _operands(1, 64, 48)
    product = Product(weight, None, is_transposed=True)
    module_layout = Product(weight.t(), None, is_transposed=False)
    assert skinny.attach([product, module_layout], torch.device("cpu"), sm_count=8) == 1
    assert module_layout.few_rows is None and product.few_rows is not None
    for rows in (3, 64, 65):
        x, _ = _operands(rows, 64, 48, seed=rows)
        _close(product(x), (x.float() @ weight.float()).to(torch.bfloat16))
    few_rows = product.few_rows_for(64)
    assert few_rows is not None and product.few_rows_for(65) is None
    # seeded: an unseeded draw was past the 2% tolerance about once in a thousand runs (CI saw 2.03%:
    # the operand's silu * up rounds to bf16 on both sides, an ulp apart now and then)
    gate_up = torch.randn(4, 128, generator=torch.Generator().manual_seed(4)).to(torch.bfloat16)
    gate, up = gate_up.chunk(2, dim=-1)
    _close(few_rows(gate_up, gated=True), ((F.silu(gate) * up).float() @ weight.float()).to(torch.bfloat16))


@pytest.mark.parametrize("is_hybrid", [False, True])
def test_the_fused_forward_on_the_kernel_matches_it_on_torch_products(skinny, is_hybrid):
    """A whole fp32 step of a few rows with every product on the kernel (down's silu * up inside
    it; the hybrid's gated delta-net projections too) against the same step on torch's products."""
    from engine_plans import hybrid_plan, llm_plan
    from fused_steps import fused_forward, two_row_step
    from mstar.plan.dims import decoder_dims

    dims = decoder_dims((hybrid_plan() if is_hybrid else llm_plan()).nodes[0], "spec")
    logits = []
    for on_kernel in (False, True):
        forward, kv, states = fused_forward(dims, is_hybrid, is_fused=True)
        if on_kernel:  # the GPU's layout, [in, out], then the kernel
            for _, product in forward.named_products():
                product.weight, product.is_transposed = product.weight.t().contiguous(), True
            assert skinny.attach((p for _, p in forward.named_products()), torch.device("cpu"), sm_count=8) > 0
        logits.append(two_row_step(forward, kv, states, is_decode=False)[0])
    torch.testing.assert_close(logits[1], logits[0], rtol=1e-4, atol=1e-4)


def test_out_is_written_in_place_and_not_beside_into(skinny):
    x, weight = _operands(3, 64, 24)
    wide = torch.zeros(3, 40, dtype=torch.bfloat16)
    got = skinny.skinny_mm(x, weight, None, SkinnyConfig(16, 16, 2), Workspace(torch.device("cpu")), out=wide[:, :24])
    assert got.data_ptr() == wide.data_ptr() and not wide[:, 24:].any()
    _close(wide[:, :24], (x.float() @ weight.float()).to(torch.bfloat16))
    with pytest.raises(ValueError, match="not both"):
        skinny.skinny_mm(x, weight, None, SkinnyConfig(16, 16, 2), Workspace(torch.device("cpu")),
                         into=wide[:, :24], out=wide[:, :24])
