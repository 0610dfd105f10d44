"""`mstar bench attention --decode`: the decode graphs' attention per layer call, the Triton kernel
(`decode_attention.py`, the shape a graph of that many rows takes) against FlashInfer's tensor-core
(fa2) and CUDA-core decode, each as 16 layer calls captured in one CUDA graph and replayed (median
of the replays, per call), at 1, 4, 8, 16 and 64 rows of `context` positions over a shuffled bf16
page pool (page size 16, NHD), beside the floor of the KV bytes at the copy rate measured in the
same run (`bench.copy_bandwidth`, as `mstar bench engine` measures it), with the Triton output's
largest difference from FlashInfer's tensor-core output. `--spread`: rows of unequal length (a
quarter of `context` to four times it); `--split-what-ifs`: the Triton kernel also at half and
twice the graph's split count.
"""
from __future__ import annotations

import dataclasses
import itertools
import statistics
from typing import Callable

import torch

from mstar.runtime.engine.gpu import decode_attention
from mstar.runtime.engine.gpu.attention import cuda_core_refusal, decode_backend
from mstar.runtime.engine.gpu.bench import copy_bandwidth

PAGE_SIZE = 16
ROWS = (1, 4, 8, 16, 64)
LAYERS = 16  # layer calls in one graph, each over its own layer's pages


def graph_us(calls: Callable[[], object], iters: int, num_calls: int = LAYERS, blas_edges: bool = False) -> float:
    """Per layer call: the replays of a graph of `calls` (`num_calls` layer calls), timed with CUDA
    events (median). `blas_edges`: the graph's edges into cuBLAS's products made programmatic as
    the engine's graphs have them (engine/gpu/blas_edges.py; where cuda-bindings allows)."""
    from mstar.runtime.engine.gpu import blas_edges as edges

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        calls()  # compiles, plans the wrappers' first run, outside the graph
    torch.cuda.current_stream().wait_stream(stream)
    graph = edges.new_graph() if blas_edges else torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        calls()
    if blas_edges:
        edges.finish(graph)
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(iters):
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1000.0 / num_calls)
    return statistics.median(times)


def _layer_calls(attend: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], cache: torch.Tensor,
                 outs: dict[str, torch.Tensor], key: str) -> Callable[[], None]:
    """LAYERS calls of `attend(k_pages, v_pages)`, one a layer; the last output kept under `key`."""
    def calls() -> None:
        for layer in range(LAYERS):
            outs[key] = attend(cache[layer, 0], cache[layer, 1])
    return calls


def row_lengths(rows: int, context: int, is_spread: bool) -> list[int]:
    """Positions a row: `context` each, or (spread) evenly from a quarter of it to four times it."""
    if not is_spread or rows == 1:
        return [context] * rows
    low, high = max(1, context // 4), 4 * context
    return [low + (high - low) * i // (rows - 1) for i in range(rows)]


def _csr(lengths: list[int], device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """kv indptr, shuffled page indices and last page lengths of rows of these lengths."""
    pages = [-(-n // PAGE_SIZE) for n in lengths]
    indptr = torch.tensor([0] + list(itertools.accumulate(pages)), dtype=torch.int32, device=device)
    indices = torch.randperm(sum(pages), device=device).to(torch.int32)
    last = torch.tensor([n - (p - 1) * PAGE_SIZE for n, p in zip(lengths, pages)], dtype=torch.int32, device=device)
    return indptr, indices, last


def _case(lengths: list[int], heads: tuple[int, int, int], iters: int, rate: float, split_what_ifs: bool) -> dict:
    hq, hkv, d = heads
    device, rows = torch.device("cuda"), len(lengths)
    indptr, indices, last = _csr(lengths, device)
    cache = torch.randn(LAYERS, 2, indices.numel(), PAGE_SIZE, hkv, d, device=device, dtype=torch.bfloat16)
    q = torch.randn(rows, hq, d, device=device, dtype=torch.bfloat16)
    outs: dict[str, torch.Tensor] = {}
    result: dict = {"floor_us": sum(lengths) * hkv * d * 2 * 2 / rate * 1e6}
    result.update(_flashinfer_us(q, cache, (indptr, indices, last), outs, iters))
    shape = decode_attention.graph_shape(hq, hkv, d, PAGE_SIZE, rows,
                                         torch.cuda.get_device_properties(device).multi_processor_count)
    result["triton_us"] = _triton_us(shape, q, cache, (indptr, indices, last), outs, iters)
    result["triton_splits"] = shape.num_splits
    if split_what_ifs:  # the same kernel at half and twice the graph's splits
        for splits in {max(1, shape.num_splits // 2), min(64, 2 * shape.num_splits)} - {shape.num_splits}:
            other = dataclasses.replace(shape, num_splits=splits)
            result[f"triton_{splits}_splits_us"] = _triton_us(other, q, cache, (indptr, indices, last), {}, iters)
    result["max_abs_diff"] = float((outs["triton"].float() - outs["flashinfer_tensor_us"].float()).abs().max())
    flashinfer_best = min(v for k, v in result.items() if k.startswith("flashinfer"))
    result["triton_vs_flashinfer"] = flashinfer_best / result["triton_us"]
    return {k: round(v, 4) if isinstance(v, float) else v for k, v in result.items()}


def _flashinfer_us(q: torch.Tensor, cache: torch.Tensor, csr: tuple, outs: dict, iters: int) -> dict[str, float]:
    """FlashInfer's tensor-core (fa2) and, where compiled for the group, CUDA-core decode."""
    import flashinfer

    indptr, indices, last = csr
    hq, hkv, d = q.shape[1], cache.shape[4], q.shape[2]
    workspace = torch.zeros(128 << 20, dtype=torch.uint8, device=q.device)
    times = {}
    for label, is_tensor in (("flashinfer_tensor_us", True), ("flashinfer_cuda_us", False)):
        if not is_tensor and cuda_core_refusal(hq, hkv):
            continue
        wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
            workspace, "NHD", use_cuda_graph=True, use_tensor_cores=is_tensor, paged_kv_indptr_buffer=indptr,
            paged_kv_indices_buffer=indices, paged_kv_last_page_len_buffer=last, **decode_backend(is_tensor))
        wrapper.plan(indptr, indices, last, hq, hkv, d, PAGE_SIZE, q_data_type=torch.bfloat16,
                     kv_data_type=torch.bfloat16)

        def run_wrapper(k_pages: torch.Tensor, v_pages: torch.Tensor, w=wrapper) -> torch.Tensor:
            return w.run(q, (k_pages, v_pages))

        times[label] = graph_us(_layer_calls(run_wrapper, cache, outs, label), iters)
    return times


def _triton_us(shape: decode_attention.DecodeShape, q: torch.Tensor, cache: torch.Tensor,
               csr: tuple[torch.Tensor, torch.Tensor, torch.Tensor], outs: dict, iters: int) -> float:
    partial = torch.empty(decode_attention.partial_numel(shape, q.shape[0]), dtype=torch.float32, device=q.device)
    counts = torch.zeros(q.shape[0] * shape.num_kv_heads, dtype=torch.int32, device=q.device)
    indptr, indices, last = csr

    def triton(k_pages: torch.Tensor, v_pages: torch.Tensor) -> torch.Tensor:
        return decode_attention.decode_attention(shape, q, k_pages, v_pages, indptr, indices, last, partial,
                                                 counts=counts)

    return graph_us(_layer_calls(triton, cache, outs, "triton"), iters)


def run(iters: int, context: int, heads: tuple[int, int, int], is_spread: bool = False,
        split_what_ifs: bool = False) -> dict:
    rate = copy_bandwidth()
    cases = {str(rows): _case(row_lengths(rows, context, is_spread), heads, iters, rate, split_what_ifs)
             for rows in ROWS}
    return {"heads": {"qo": heads[0], "kv": heads[1], "dim": heads[2]}, "context": context, "spread": is_spread,
            "page_size": PAGE_SIZE, "copy_tb_s": round(rate / 1e12, 3), "rows": cases,
            "device": torch.cuda.get_device_name()}


def table(result: dict) -> str:
    heads = result["heads"]
    positions = (f"{result['context'] // 4}..{4 * result['context']} positions over the rows" if result.get("spread")
                 else f"{result['context']} positions a row")
    lines = [f"decode attention per layer call (16 calls in a CUDA graph), {heads['qo']}/{heads['kv']} heads x "
             f"{heads['dim']}, {positions}, bf16, page size {result['page_size']}, on "
             f"{result['device']} (copy {result['copy_tb_s']} TB/s)",
             f"{'rows':>5} {'Triton us':>10} {'splits':>6} {'FI tensor':>10} {'FI cuda':>9} {'floor':>7} "
             f"{'FI best / Triton':>16} {'max diff':>9}"]
    for rows, case in result["rows"].items():
        cuda = case.get("flashinfer_cuda_us")
        lines.append(f"{rows:>5} {case['triton_us']:>10.2f} {case['triton_splits']:>6} "
                     f"{case['flashinfer_tensor_us']:>10.2f} {'-' if cuda is None else f'{cuda:.2f}':>9} "
                     f"{case['floor_us']:>7.2f} {case['triton_vs_flashinfer']:>15.2f}x {case['max_abs_diff']:>9.1e}"
                     + "".join(f"  {key[7:-10]} splits {us:.2f}" for key, us in sorted(case.items())
                               if key.startswith("triton_") and key.endswith("_splits_us")))
    return "\n".join(lines)

