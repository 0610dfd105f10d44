"""`products.py`: the decoder's matrix products with their weights stored [out, in] or [in, out]."""
import pytest
import torch
from torch import nn

from mstar.runtime.engine.gpu import products


def _linears(seed: int, biases: tuple[bool, ...]) -> list[nn.Linear]:
    torch.manual_seed(seed)
    return [nn.Linear(12, width, bias=bias) for width, bias in zip((5, 7, 3), biases)]


@pytest.mark.parametrize("transposed", [False, True])
@pytest.mark.parametrize("biases", [(False, False, False), (True, False, True)])
def test_a_fused_product_computes_the_linears_side_by_side(transposed, biases):
    linears = _linears(0, biases)
    x = torch.randn(4, 12)
    expected = torch.cat([linear(x) for linear in linears], dim=-1)
    product = products.fuse(linears, transposed)
    assert product.is_transposed == transposed and product.out_features == 15
    assert product.weight.shape == ((12, 15) if transposed else (15, 12))
    assert product.weight.is_contiguous()
    torch.testing.assert_close(product(x), expected)
    # the modules compute the same as before, from views of the stored weight
    torch.testing.assert_close(torch.cat([linear(x) for linear in linears], dim=-1), expected)


@pytest.mark.parametrize("transposed", [False, True])
def test_the_modules_parameters_are_views_of_the_one_stored_weight(transposed):
    linears = _linears(1, (True, True, True))
    product = products.fuse(linears, transposed)
    storage = product.weight.untyped_storage().data_ptr()
    for linear in linears:
        assert linear.weight.untyped_storage().data_ptr() == storage
    with torch.no_grad():
        product.weight.zero_()
        assert product.bias is not None
        product.bias.zero_()
    assert all(torch.count_nonzero(linear(torch.randn(2, 12))) == 0 for linear in linears)


def test_a_single_linear_stored_transposed_twice_is_not_copied_again():
    (linear,) = _linears(2, (False,))[:1]
    first = products.fuse([linear], True)
    second = products.fuse([linear], True)
    assert second.weight.data_ptr() == first.weight.data_ptr()
    assert linear.weight.data_ptr() == first.weight.data_ptr()


def test_only_a_gpu_stores_transposed_and_the_what_if_turns_it_off():
    assert not products.stores_transposed(torch.device("cpu"))
    assert products.stores_transposed(torch.device("cuda"))
    products.set_transposed(False)
    try:
        assert not products.stores_transposed(torch.device("cuda"))
    finally:
        products.set_transposed(True)
