"""The split-K skinny product (`engine/gpu/skinny_products.py`) on a CUDA GPU: Llama-3.2-1B's decode
shapes at 1-64 rows against torch's product, in a CUDA graph replayed many times (the tiles' counters
go back to zero each time), down's gated operand. Skipped without a GPU."""
import pytest
import torch

from mstar.runtime.engine.gpu import kernels, skinny_products
from mstar.runtime.engine.gpu.products import Product

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

SHAPES = [(2048, 3072), (2048, 2048), (2048, 16384), (8192, 2048)]  # q/k/v, o, gate/up, down


def _relative(got: torch.Tensor, expected: torch.Tensor) -> float:
    return float((got.float() - expected.float()).abs().max() / expected.float().abs().max())


@pytest.mark.parametrize("rows", [1, 7, 16, 33, 64])
@pytest.mark.parametrize("k, n", SHAPES)
def test_the_kernel_matches_torch_at_decode_shapes(rows, k, n):
    device = torch.device("cuda")
    torch.manual_seed(rows)
    weight = torch.randn(k, n, device=device, dtype=torch.bfloat16) * k ** -0.5
    product = Product(weight, None, is_transposed=True)
    assert skinny_products.attach([product], device) == 1
    x = torch.randn(rows, k, device=device, dtype=torch.bfloat16)
    assert _relative(product(x), x.float() @ weight.float()) < 1e-2
    gate_up = torch.randn(rows, 2 * k, device=device, dtype=torch.bfloat16)
    assert _relative(product.few_rows(gate_up, gated=True), kernels.silu_mul(gate_up).float() @ weight.float()) < 1e-2


def test_a_graph_of_products_replays_the_same_bits():
    """Products one after another on one workspace, in a CUDA graph: every replay gives what the
    first gave (a counter left non-zero would skip or repeat a tile's sum)."""
    device = torch.device("cuda")
    torch.manual_seed(0)
    products = [Product(torch.randn(k, n, device=device, dtype=torch.bfloat16) * k ** -0.5, None, True)
                for k, n in SHAPES]
    skinny_products.attach(products, device)
    x = torch.randn(64, 2048, device=device, dtype=torch.bfloat16)

    def step() -> torch.Tensor:
        h = products[0](x)[:, :2048]
        h = products[1](h.contiguous())
        gate_up = products[2](h)
        return products[3].few_rows(gate_up, gated=True)

    expected = step()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    for _ in range(20):
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, expected)


@pytest.mark.parametrize("rows", [1, 16, 64])
def test_accumulate_adds_into_the_residual_on_the_kernel(rows):
    """`Product.accumulate` on the kernel (`skinny_mm(..., into=)`): the residual plus the product
    in one launch, as torch's addmm_ gives it within bf16's rounding."""
    device = torch.device("cuda")
    torch.manual_seed(rows)
    k, n = SHAPES[1]
    weight = torch.randn(k, n, device=device, dtype=torch.bfloat16) * k ** -0.5
    product = Product(weight, None, is_transposed=True)
    skinny_products.attach([product], device)
    x = torch.randn(rows, k, device=device, dtype=torch.bfloat16)
    residual = torch.randn(rows, n, device=device, dtype=torch.bfloat16)
    into = residual.clone()
    assert product.accumulate(into, x) is into
    assert _relative(into, residual.float() + x.float() @ weight.float()) < 1e-2
