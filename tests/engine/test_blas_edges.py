"""`blas_edges` on the CPU: which edges of a captured graph become programmatic, against a stand-in
of cuda-bindings' graph API (the real one needs a GPU: tests/gpu/test_blas_edges_gpu.py)."""
from enum import Enum
from types import SimpleNamespace

import pytest

from mstar.runtime.engine.gpu import blas_edges


class Dependency(Enum):
    default = 0
    programmatic = 1


class NodeType(Enum):
    kernel = 0
    memcpy = 1


class FakeGraph:
    """Nodes by handle: (node type, kernel name); edges as (source, target, edge data)."""

    def __init__(self, nodes: dict[int, tuple[NodeType, str]], edges: list[tuple[int, int, Dependency]]):
        self.nodes = nodes
        self.edges = [(a, b, SimpleNamespace(type=t, from_port=0)) for a, b, t in edges]


def _bindings(graph: FakeGraph, count_error: str = "success"):
    ok = "success"

    def get_edges(_raw, count):
        if count == 0:
            return count_error, None, None, None, len(graph.edges)
        return (ok, [a for a, _, _ in graph.edges], [b for _, b, _ in graph.edges], [d for _, _, d in graph.edges],
                len(graph.edges))

    def remove(_raw, sources, targets, data, count):
        assert count == 1
        graph.edges.remove((sources[0], targets[0], data[0]))
        return (ok,)

    def add(_raw, sources, targets, data, count):
        assert count == 1
        graph.edges.append((sources[0], targets[0], data[0]))
        return (ok,)

    runtime = SimpleNamespace(
        cudaError_t=SimpleNamespace(cudaSuccess=ok, cudaErrorLossyQuery="lossy"),
        cudaGraphDependencyType=SimpleNamespace(cudaGraphDependencyTypeDefault=Dependency.default,
                                                cudaGraphDependencyTypeProgrammatic=Dependency.programmatic),
        cudaGraphKernelNodePortProgrammatic=1,
        cudaGraphNodeType=SimpleNamespace(cudaGraphNodeTypeKernel=NodeType.kernel),
        cudaGraphEdgeData=lambda: SimpleNamespace(type=Dependency.default, from_port=0),
        cudaGraphGetEdges=get_edges, cudaGraphRemoveDependencies=remove, cudaGraphAddDependencies=add,
        cudaGraphNodeGetType=lambda node: (ok, graph.nodes[node][0]),
    )
    driver = SimpleNamespace(
        CUresult=SimpleNamespace(CUDA_SUCCESS=ok),
        cuGraphKernelNodeGetParams=lambda node: (ok, SimpleNamespace(func=graph.nodes[node][1])),
        cuFuncGetName=lambda func: (ok, func.encode()),
    )
    return driver, runtime


@pytest.fixture
def step_graph(monkeypatch):
    """A norm, a product (with its split-K reduction, already programmatic), silu, a product; a copy
    node; a torch kernel after a product."""
    graph = FakeGraph(
        {1: (NodeType.kernel, "_add_rmsnorm_kernel"),
         2: (NodeType.kernel, "nvjet_sm90_tst_64x8_64x16_2x1_v_bz_splitK_NNT"),
         3: (NodeType.kernel, "_ZN8cublasLt19splitKreduce_kernel"), 4: (NodeType.kernel, "_silu_mul_kernel"),
         5: (NodeType.kernel, "nvjet_sm90_tst_128x8_64x12_2x1_v_bz_NNT"), 6: (NodeType.memcpy, ""),
         7: (NodeType.kernel, "sm90_xmma_gemm_bf16bf16_bf16f32"), 8: (NodeType.kernel, "_ZN2at6native18elementwise")},
        [(1, 2, Dependency.default), (2, 3, Dependency.programmatic), (3, 4, Dependency.programmatic),
         (4, 5, Dependency.default), (6, 5, Dependency.default), (5, 8, Dependency.default),
         (8, 7, Dependency.default)])
    monkeypatch.setattr(blas_edges, "_bindings", lambda: _bindings(graph))
    return graph


def test_only_edges_into_the_waiting_products_become_programmatic(step_graph):
    made = blas_edges.make_programmatic(0)
    assert made == 2
    kinds = {(a, b): d.type for a, b, d in step_graph.edges}
    assert kinds[(1, 2)] == kinds[(4, 5)] == Dependency.programmatic  # the norm -> product, silu -> product
    assert all(d.from_port == 1 for a, b, d in step_graph.edges if (a, b) in {(1, 2), (4, 5)})
    assert kinds[(6, 5)] == Dependency.default  # not from a kernel node
    assert kinds[(5, 8)] == Dependency.default  # into torch's kernel, which does not wait
    assert kinds[(8, 7)] == Dependency.default  # into a cuBLAS kernel outside the family measured
    assert len(step_graph.edges) == 7
    assert blas_edges.make_programmatic(0) == 0  # a second pass finds nothing left to change


@pytest.mark.parametrize("count_error, made", [("lossy", 1), ("invalid", None)])
def test_the_count_query_may_be_lossy_but_not_fail(monkeypatch, count_error, made):
    graph = FakeGraph({1: (NodeType.kernel, "_silu_mul_kernel"), 2: (NodeType.kernel, "nvjet_sm90_tst_NNT")},
                      [(1, 2, Dependency.default)])
    monkeypatch.setattr(blas_edges, "_bindings", lambda: _bindings(graph, count_error))
    if made is None:
        with pytest.raises(RuntimeError, match="invalid"):
            blas_edges.make_programmatic(0)
    else:
        assert blas_edges.make_programmatic(0) == made


def test_on_by_default_but_off_or_without_bindings_graphs_are_as_captured(monkeypatch, step_graph):
    assert blas_edges.ENABLED_BY_DEFAULT and blas_edges.is_enabled()  # the stand-in bindings are present
    assert blas_edges.why_off() is None
    blas_edges.set_enabled(False)
    try:
        assert not blas_edges.is_enabled() and blas_edges.why_off() == "turned off"
        assert blas_edges.finish(SimpleNamespace()) == 0  # nothing read from a graph it does not rewrite
    finally:
        blas_edges.set_enabled(blas_edges.ENABLED_BY_DEFAULT)
    monkeypatch.setattr(blas_edges, "_bindings", lambda: None)
    assert not blas_edges.is_enabled()
    assert blas_edges.finish(SimpleNamespace()) == 0
    assert blas_edges.why_off() == "cuda-bindings 13 is not installed"


def test_the_family_is_told_by_the_kernel_name():
    assert blas_edges.waits("nvjet_sm90_tst_64x32_64x16_4x2_h_bz_NNT")
    assert not blas_edges.waits("_add_rmsnorm_kernel")
    assert not blas_edges.waits("void cublasLt::splitKreduce_kernel<32, 16>")


def test_a_failing_binding_call_raises():
    runtime = SimpleNamespace(cudaError_t=SimpleNamespace(cudaSuccess="success"))
    with pytest.raises(RuntimeError, match="blas_edges"):
        blas_edges._checked(runtime, ("cudaErrorInvalidValue", None))


def test_finish_rewrites_a_kept_graph_instantiates_it_and_counts(step_graph):
    """On (the bindings stood in): `finish` rewrites the graph torch kept, instantiates it, and adds
    to `made_total`, which `set_enabled` restarts (what `mstar bench engine` reports)."""
    calls = []
    kept = SimpleNamespace(raw_cuda_graph=lambda: calls.append("raw") or 0,
                           instantiate=lambda: calls.append("instantiate"))
    blas_edges.set_enabled(True)
    try:
        assert blas_edges.is_enabled()
        assert blas_edges.finish(kept) == 2
        assert calls == ["raw", "instantiate"]
        assert blas_edges.finish(kept) == 0 and blas_edges.made_total == 2
    finally:
        blas_edges.set_enabled(blas_edges.ENABLED_BY_DEFAULT)
    assert blas_edges.made_total == 0
