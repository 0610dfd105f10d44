"""Programmatic edges into cuBLAS's kernels in a captured CUDA graph (on by default where cuda-bindings 13
is installed).

Why: the fused Triton kernels launch with programmatic dependent launch (PDL, `kernels.py`), so the
kernel after one may start while it finishes and then wait on its writes. torch launches cuBLAS's
products without PDL, so a graph's edge from one of those kernels into a product is an ordinary
edge: the product launches only once the kernel before it has completed and flushed its writes, and
a decode step of Llama-3.2-1B has 65 such edges (every product follows a fused kernel). cuBLAS's
sm_90 product kernels (the `nvjet_sm90_*` family) take a programmatic dependency themselves: in
every captured step the edge from such a product into its own split-K reduction kernel is already
programmatic. In a 16-layer stand-in of the Llama-3.2-1B decode step in one CUDA graph on an H200
(a one-off `.gpuwork/pdl_edges.py`: `add_rmsnorm`, the q/k/v product, a Triton kernel, o, the
norm, gate/up, `silu_mul`, down), making the 64 edges into the products programmatic took a replay
from 0.785 to 0.720 ms at one row and from 0.874 to 0.806 ms at 64 rows (8%), the outputs bit for
bit the same over 20 replays (the kernels before the products let their successors launch before
their own stores, so a product that read its input without waiting would have read the previous
replay's values).

`make_programmatic(graph)` turns every ordinary edge between two kernel nodes whose target is a
kernel of that family into a programmatic one (a programmatic edge on the source's programmatic
port: the target may launch once the source triggers, and waits on its writes before reading);
other targets (torch's own kernels, FlashInfer's, anything cuBLAS picks outside that family) keep
their edges. `new_graph()` keeps the captured graph for that (`keep_graph`) when enabled, and
`finish(graph)` rewrites it and instantiates it. Needs cuda-bindings 13 (the GPU image has it);
without it, or off, graphs are captured and instantiated as before. In the engine (`mstar bench engine`,
Llama-3.2-1B at spec dims, two alternations in one call) it took the chained decode step from 1.111 /
1.099 to 1.033 / 1.035 ms at one row and from 1.794 / 1.782 to 1.731 / 1.731 ms at 64, so it is on;
`set_enabled(False)` turns it off (`mstar bench engine --no-blas-pdl`, a what-if).
"""
from __future__ import annotations

import functools
from typing import Any, Optional

import torch

# cuBLAS's sm_90 product kernels, which wait on a programmatic dependency (module docstring).
WAITING_KERNELS = ("nvjet_sm90_",)

ENABLED_BY_DEFAULT = True  # measured in the engine (module docstring)
_enabled = ENABLED_BY_DEFAULT
made_total = 0  # edges `finish` made programmatic since start-up or `set_enabled` (what a bench reports)


def set_enabled(enabled: bool) -> None:
    """Make the edges into cuBLAS's products programmatic in graphs captured afterwards (module
    docstring); on by default. Restarts `made_total`."""
    global _enabled, made_total
    _enabled, made_total = enabled, 0


def is_enabled() -> bool:
    return why_off() is None


def why_off() -> Optional[str]:
    """None when graphs get the rewrite; else why not (what a bench prints beside its 0 edges)."""
    if not _enabled:
        return "turned off"
    return None if _bindings() is not None else "cuda-bindings 13 is not installed"


@functools.lru_cache(maxsize=None)
def _bindings() -> Any:
    """(driver, runtime) of cuda-bindings 13, or None (then nothing is rewritten)."""
    try:
        from cuda.bindings import driver, runtime
    except ImportError:
        return None
    return (driver, runtime) if hasattr(runtime, "cudaGraphEdgeData") else None


def new_graph() -> torch.cuda.CUDAGraph:
    """A graph to capture into; kept for `finish` to rewrite when enabled."""
    return torch.cuda.CUDAGraph(keep_graph=True) if is_enabled() else torch.cuda.CUDAGraph()


def finish(graph: torch.cuda.CUDAGraph) -> int:
    """After the capture: rewrite a kept graph's edges and instantiate it; returns the edges made
    programmatic (0 when not enabled)."""
    global made_total
    if not is_enabled():
        return 0
    made = make_programmatic(graph.raw_cuda_graph())
    graph.instantiate()
    made_total += made
    return made


def waits(kernel_name: str) -> bool:
    """Whether a kernel of this name takes a programmatic dependency (a cuBLAS sm_90 product)."""
    return kernel_name.startswith(WAITING_KERNELS)


def make_programmatic(raw_graph: int) -> int:
    """Every ordinary kernel-to-kernel edge of `raw_graph` (a `cudaGraph_t`) into a kernel that
    `waits` becomes programmatic; returns how many."""
    driver, runtime = _bindings()
    lossy = getattr(runtime.cudaError_t, "cudaErrorLossyQuery", None)  # the count alone may answer so
    *_, count = _checked(runtime, runtime.cudaGraphGetEdges(raw_graph, 0), also_ok=lossy)
    sources, targets, data, _ = _checked(runtime, runtime.cudaGraphGetEdges(raw_graph, count))
    programmatic = runtime.cudaGraphEdgeData()
    programmatic.type = runtime.cudaGraphDependencyType.cudaGraphDependencyTypeProgrammatic
    programmatic.from_port = runtime.cudaGraphKernelNodePortProgrammatic
    made = 0
    for source, target, edge in zip(sources, targets, data):
        if edge.type != runtime.cudaGraphDependencyType.cudaGraphDependencyTypeDefault:
            continue
        if not (_is_kernel(runtime, source) and _is_kernel(runtime, target)):
            continue
        if not waits(_kernel_name(driver, target)):
            continue
        _checked(runtime, runtime.cudaGraphRemoveDependencies(raw_graph, [source], [target], [edge], 1))
        _checked(runtime, runtime.cudaGraphAddDependencies(raw_graph, [source], [target], [programmatic], 1))
        made += 1
    return made


def _is_kernel(runtime: Any, node: Any) -> bool:
    kind = _checked(runtime, runtime.cudaGraphNodeGetType(node))
    return kind == runtime.cudaGraphNodeType.cudaGraphNodeTypeKernel


def _kernel_name(driver: Any, node: Any) -> str:
    error, params = driver.cuGraphKernelNodeGetParams(node)
    if error != driver.CUresult.CUDA_SUCCESS:
        return ""
    error, name = driver.cuFuncGetName(params.func)
    return name.decode() if error == driver.CUresult.CUDA_SUCCESS else ""


def _checked(runtime: Any, result: Any, also_ok: Any = None) -> Any:
    """A binding's (error, *values): the values (one alone unwrapped), or a RuntimeError unless the
    error is success (or `also_ok`)."""
    error, *values = result if isinstance(result, tuple) else (result,)
    if error != runtime.cudaError_t.cudaSuccess and (also_ok is None or error != also_ok):
        raise RuntimeError(f"blas_edges: {error}")
    return values[0] if len(values) == 1 else tuple(values)
