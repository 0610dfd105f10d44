"""`blas_edges` on a CUDA GPU: a graph of the fused kernels and cuBLAS's products with the edges into
the products made programmatic gives the same outputs bit for bit as the graph as captured, replay
after replay. Skipped without a GPU or without cuda-bindings 13."""
import pytest
import torch

from mstar.runtime.engine.gpu import blas_edges, kernels

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

HIDDEN, INNER = 2048, 8192


def _layers(x: torch.Tensor, weights) -> torch.Tensor:
    """The norm, a product, silu * up, a product, twice: every product after a fused kernel."""
    delta = None
    for norm, gate_up, down in weights:
        h = kernels.add_rmsnorm(x, delta, norm, 1e-5)
        delta = torch.mm(kernels.silu_mul(torch.mm(h, gate_up)), down)
    return kernels.add_rmsnorm(x, delta, weights[0][0], 1e-5)


def _captured(x: torch.Tensor, weights, enabled: bool):
    blas_edges.set_enabled(enabled)
    try:
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            _layers(x.clone(), weights)  # cuBLAS's handles and Triton's first launches outside the graph
        torch.cuda.current_stream().wait_stream(stream)
        graph = blas_edges.new_graph()
        with torch.cuda.graph(graph):
            out = _layers(x, weights)
        made = blas_edges.finish(graph)
    finally:
        blas_edges.set_enabled(blas_edges.ENABLED_BY_DEFAULT)
    return graph, out, made


@pytest.mark.parametrize("rows", [1, 64])
def test_programmatic_edges_into_the_products_keep_the_outputs(rows):
    if blas_edges._bindings() is None:
        pytest.skip("needs cuda-bindings 13")
    torch.manual_seed(0)
    weights = [(torch.rand(HIDDEN, device="cuda", dtype=torch.bfloat16) + 0.5,
                torch.randn(HIDDEN, 2 * INNER, device="cuda", dtype=torch.bfloat16) * 0.02,
                torch.randn(INNER, HIDDEN, device="cuda", dtype=torch.bfloat16) * 0.02) for _ in range(2)]
    start = torch.randn(rows, HIDDEN, device="cuda", dtype=torch.bfloat16)
    x_plain, x_edges = start.clone(), start.clone()
    plain, out_plain, none = _captured(x_plain, weights, enabled=False)
    edges, out_edges, made = _captured(x_edges, weights, enabled=True)
    assert none == 0
    assert made >= 2  # at least the two gate/up products (cuBLAS picks the kernels by shape)
    for _ in range(10):  # the residual stream moves on each replay: stale reads would differ
        plain.replay()
        edges.replay()
        torch.cuda.synchronize()
        assert torch.equal(out_edges, out_plain) and torch.equal(x_edges, x_plain)


def test_the_engines_decode_graphs_with_the_edges_rewritten_give_the_same_logits(monkeypatch):
    """The decode graphs of a small Llama-style model captured with and without `blas_edges`: the
    same logits bit for bit and the same tokens for a padded step, and the rewrite made edges."""
    if blas_edges._bindings() is None:
        pytest.skip("needs cuda-bindings 13")
    from test_gpu_fast_path import _executor

    from mstar.runtime.engine.gpu.packing import RowSpec

    made = []
    rewrite = blas_edges.make_programmatic
    monkeypatch.setattr(blas_edges, "make_programmatic", lambda raw: made.append(rewrite(raw)) or made[-1])
    rows = [RowSpec([3 + i], 40 + 9 * i, list(range(4 * i, 4 * i + 4)), i) for i in range(3)]  # pads to 4
    runs = []
    for enabled in (False, True):
        torch.manual_seed(0)  # the same random KV for both
        blas_edges.set_enabled(enabled)
        try:
            executor = _executor([1, 2, 4, 8])
            executor.capture()
        finally:
            blas_edges.set_enabled(blas_edges.ENABLED_BY_DEFAULT)
        tokens = executor.collect(executor.launch(rows)).tolist()
        runs.append((executor.graphs.logits[4][:3].clone(), tokens))
    (plain_logits, plain_tokens), (edges_logits, edges_tokens) = runs
    assert sum(made) > 0, "cuBLAS picked no nvjet_sm90 kernel for these products"
    assert torch.equal(edges_logits, plain_logits) and edges_tokens == plain_tokens
