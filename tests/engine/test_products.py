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


def _hybrid_executor(transposed: bool, monkeypatch):
    """An eager executor over Qwen3.5-style layers (full attention and gated delta-net), seeded, with
    its products' weights stored [in, out] (what a GPU holds) or in the modules' layout."""
    from engine_plans import hybrid_plan

    from mstar.plan.dims import decoder_dims
    from mstar.runtime.engine.gpu.device_model import build_decoder
    from mstar.runtime.engine.gpu.executor import StepExecutor
    from mstar.runtime.engine.gpu.forward import DecoderForward, PagedKv
    from mstar.runtime.engine.models.gdn import LinearStates

    monkeypatch.setattr(products, "stores_transposed", lambda device: transposed)
    dims = decoder_dims(hybrid_plan().nodes[0], "spec")
    cpu = torch.device("cpu")
    model = build_decoder(dims, cpu, torch.float32, position=0, seed=0)
    kv = PagedKv(dims.num_full_layers, 16, 16, dims.num_kv_heads, dims.head_dim, torch.float32, cpu)
    kv.data.zero_()
    states = LinearStates.for_dims(dims, 4, cpu)
    forward = DecoderForward(model, dims, kv, 257, states)
    assert all(p.is_transposed == transposed for _, p in forward.named_products())
    return StepExecutor(forward, kv, cpu, 17, None)


def test_a_hybrid_decoders_steps_are_the_same_with_its_weights_stored_transposed(monkeypatch):
    """Every product of a step (q/k/v, o, gate/up, down, a linear layer's in- and out-projections)
    from [in, out] weights: the same greedy tokens as from the modules' layout over prompts and
    decode steps, the recurrent states and KV within fp32 rounding."""
    from mstar.runtime.engine.gpu.packing import RowSpec

    runs = []
    for transposed in (True, False):
        executor = _hybrid_executor(transposed, monkeypatch)
        steps = [[RowSpec([3, 9, 4, 7, 1], 0, [1], 1), RowSpec([8, 2, 6], 0, [2], 2)]]
        tokens = [executor.collect(executor.launch(steps[0])).tolist()]
        for i in range(3):
            rows = [RowSpec([tokens[-1][0]], 5 + i, [1], 1, True), RowSpec([tokens[-1][1]], 3 + i, [2], 2, True)]
            tokens.append(executor.collect(executor.launch(rows)).tolist())
        runs.append((tokens, executor))
    (got, transposed_run), (expected, module_run) = runs
    assert got == expected
    torch.testing.assert_close(transposed_run.kv.data, module_run.kv.data, rtol=1e-5, atol=1e-5)
    gdn_t, gdn_m = transposed_run.forward.gdn, module_run.forward.gdn
    assert gdn_t is not None and gdn_m is not None
    for a, b in zip(gdn_t.states.ssm + gdn_t.states.conv, gdn_m.states.ssm + gdn_m.states.conv):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("transposed", [False, True])
@pytest.mark.parametrize("biases", [(False, False, False), (True, False, True)])
def test_accumulate_adds_the_product_into_its_target_in_place(transposed, biases):
    """`Product.accumulate`: the residual add in the product (norm_folding.py), bias once."""
    linears = _linears(2, biases)
    product = products.fuse(linears, transposed)
    x, into = torch.randn(4, 12), torch.randn(4, 15)
    expected = into + torch.cat([linear(x) for linear in linears], dim=-1)
    got = product.accumulate(into, x)
    assert got is into
    torch.testing.assert_close(into, expected)
