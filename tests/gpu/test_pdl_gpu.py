"""The fused Triton kernels under programmatic dependent launch (`kernels.py`): each waits for its
predecessor's writes, so a CUDA graph of matrix products and fused kernels replayed with PDL gives
bit for bit what the same graph captured without it gives, replay after replay (CUDA GPU only;
PDL itself needs a Hopper or newer GPU, else both graphs run without it)."""
import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def _chain(x, weights, norm_weight):
    """Layers of: the norm with its residual add, a product to gate/up, silu * up, a product back;
    then the argmax of a last product: each fused kernel reads what the product before it wrote."""
    from mstar.runtime.engine.gpu import kernels

    delta = None
    for gate_up, down in weights:
        h = kernels.add_rmsnorm(x, delta, norm_weight, 1e-5)
        delta = kernels.silu_mul(h @ gate_up) @ down
    h = kernels.add_rmsnorm(x, delta, norm_weight, 1e-5)
    return kernels.argmax_rows(h @ weights[0][0]), h


def _graph_outputs(use_pdl: bool, seed: int, replays: int):
    from mstar.runtime.engine.gpu import kernels

    kernels.set_pdl(use_pdl)
    try:
        gen = torch.Generator(device="cuda").manual_seed(seed)
        hidden, inner = 512, 1024
        weights = [(torch.randn(hidden, 2 * inner, device="cuda", generator=gen, dtype=torch.bfloat16) / 20,
                    torch.randn(inner, hidden, device="cuda", generator=gen, dtype=torch.bfloat16) / 30)
                   for _ in range(4)]
        norm_weight = torch.rand(hidden, device="cuda", generator=gen, dtype=torch.bfloat16) + 0.5
        start = torch.randn(8, hidden, device="cuda", generator=gen, dtype=torch.bfloat16)
        x = start.clone()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            _chain(x, weights, norm_weight)  # warm-up: compile before capture
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        x.copy_(start)
        with torch.cuda.graph(graph):
            ids, h = _chain(x, weights, norm_weight)
        outputs = []
        for _ in range(replays):
            x.copy_(start)  # the residual stream is updated in place: each replay starts over
            graph.replay()
            outputs.append((ids.clone(), h.clone()))
        torch.cuda.synchronize()
        return outputs
    finally:
        kernels.set_pdl(True)


def test_launch_arguments_follow_the_device():
    from mstar.runtime.engine.gpu import kernels

    on_gpu = kernels.pdl_launch(torch.empty(1, device="cuda"))
    assert on_gpu["PDL"] == (torch.cuda.get_device_capability()[0] >= 9)
    assert on_gpu.get("launch_pdl", False) == on_gpu["PDL"]
    assert kernels.pdl_launch(torch.empty(1)) == {"PDL": False}
    kernels.set_pdl(False)
    try:
        assert kernels.pdl_launch(torch.empty(1, device="cuda")) == {"PDL": False}
    finally:
        kernels.set_pdl(True)


@pytest.mark.parametrize("seed", [0, 1])
def test_graph_with_pdl_equals_graph_without(seed):
    with_pdl = _graph_outputs(True, seed, 20)
    without = _graph_outputs(False, seed, 1)[0]
    for ids, h in with_pdl:
        assert torch.equal(ids, without[0])
        assert torch.equal(h, without[1])
