"""`mstar bench products --chain`: a decode step's matrix products as one dependent chain (each
product reads the one before it), timed as one CUDA graph in each of four ways: cuBLAS a product
(with the engine's programmatic edges into its products where cuda-bindings has them), the split-K
`skinny_products` kernel a product (programmatic dependent launch), and `persistent_chain` (every
product a phase of one persistent launch, grid barriers between), without and with the next phase's
weights asked of L2 at the barrier. Beside them the chain's floor (its weights' bytes at the copy
rate measured in the same run) and what each way costs a product beyond it: the fixed cost that
docs/engine.md finds between the decode steps and their floors, and whether a persistent kernel
removes it.

The chain: the step's products (`bench_products.named_products`, the LM head left out) in layer
order (layer i: the i-th product of each role, roles in the order the forward first runs them),
each product's input the first K columns of the previous product's output (wider buffers where K
is larger, their extra columns zero), the first's a fixed random input. Every way's outputs are
checked product by product against the same operands' fp32 product (`max_rel_error`).
"""
from __future__ import annotations

from typing import Any, Callable, Optional, Sequence

import torch

from mstar.runtime.engine.gpu.bench_products import named_products

WAYS = ("cublas", "skinny", "persistent", "persistent_prefetch")
PREFETCH_ROWS = 256  # K rows of a next item's weight asked of L2 (64 KiB an item at 64 columns)


def chain_order(named: Sequence[tuple[str, int, int]]) -> list[tuple[str, int, int]]:
    """(role, in, out) of a step's products in layer order: layer i runs the i-th of each role."""
    by_role: dict[str, list[tuple[str, int, int]]] = {}
    for product in named:
        by_role.setdefault(product[0], []).append(product)
    layers = max(len(products) for products in by_role.values())
    return [products[i] for i in range(layers) for products in by_role.values() if i < len(products)]


def build_phases(shapes: Sequence[tuple[str, int, int]], rows: int, device: torch.device,
                 seed: int = 0) -> list:
    """The chain's `ChainPhase`s: random bf16 weights `[in, out]` scaled by in^-0.5 (outputs stay
    near unit size along the chain), each output buffer wide enough for the next product's input."""
    from mstar.runtime.engine.gpu.persistent_chain import ChainPhase

    generator = torch.Generator(device=device).manual_seed(seed)
    first = torch.randn(rows, shapes[0][1], generator=generator, device=device).to(torch.bfloat16)
    phases, previous = [], first
    for index, (_, k, n) in enumerate(shapes):
        weight = (torch.randn(k, n, generator=generator, device=device) * k ** -0.5).to(torch.bfloat16)
        width = max(n, shapes[index + 1][1] if index + 1 < len(shapes) else 0)
        out = torch.zeros(rows, width, dtype=torch.bfloat16, device=device)
        phases.append(ChainPhase(previous[:, :k], weight, out[:, :n]))
        previous = out
    return phases


def ways(phases: list, prefetch_rows: int = PREFETCH_ROWS) -> dict[str, Callable[[], None]]:
    """Each way of running the chain, as a callable that runs it once (`persistent_prefetch` only
    with `prefetch_rows`: the prefetch runs on a GPU alone)."""
    from mstar.runtime.engine.gpu import skinny_products
    from mstar.runtime.engine.gpu.persistent_chain import PersistentChain
    from mstar.runtime.engine.gpu.skinny_products import Workspace

    chain = PersistentChain(phases)
    workspace = Workspace(phases[0].x.device)
    configs = chain.configs  # the same items, a launch a product
    for phase, config in zip(phases, configs):
        workspace.reserve_for(phase.weight.shape[0], phase.weight.shape[1], config)

    def cublas() -> None:
        for phase in phases:
            torch.mm(phase.x, phase.weight, out=phase.out)

    def skinny() -> None:
        for phase, config in zip(phases, configs):
            skinny_products.skinny_mm(phase.x, phase.weight, None, config, workspace, out=phase.out)

    runs: dict[str, Callable[[], None]] = {"cublas": cublas, "skinny": skinny, "persistent": chain}
    if prefetch_rows:
        runs["persistent_prefetch"] = PersistentChain(phases, prefetch_rows=prefetch_rows)
    return runs


def max_rel_error(phases: list) -> float:
    """The largest difference, product by product, between an output and the fp32 product of the
    operands it was computed from, over that output's largest magnitude (at least 1)."""
    worst = 0.0
    for phase in phases:
        expected = phase.x.float() @ phase.weight.float()
        scale = max(float(expected.abs().max()), 1.0)
        worst = max(worst, float((phase.out.float() - expected).abs().max()) / scale)
    return worst


def run(dims, rows: Sequence[int], iters: int, device: Optional[torch.device] = None) -> dict:
    """Each way at each row count: us a chain, us a product beyond the floor, the largest error."""
    from mstar.runtime.engine.gpu import bench, bench_decode_attention

    device = device or torch.device("cuda")
    rate = bench.copy_bandwidth()
    shapes = chain_order(named_products(dims))
    floor_us = sum(k * n * 2 for _, k, n in shapes) / rate * 1e6
    cases: dict[str, Any] = {}
    for count in rows:
        phases = build_phases(shapes, count, device)
        case: dict[str, Any] = {}
        for name, run_chain in ways(phases).items():
            for phase in phases:
                phase.out.zero_()
            # the engine's programmatic edges into cuBLAS's products, as its graphs have them
            us = bench_decode_attention.graph_us(run_chain, iters, 1, blas_edges=True)
            case[name] = {"us": round(us, 2), "x_floor": round(us / floor_us, 3),
                          "beyond_floor_us_a_product": round((us - floor_us) / len(shapes), 3),
                          "max_rel_error": float(f"{max_rel_error(phases):.2e}")}
            if hasattr(run_chain, "faulted"):
                case[name]["barrier_gave_up"] = run_chain.faulted
        cases[str(count)] = case
        del phases
        torch.cuda.empty_cache()
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else str(device)
    return {"device": name, "copy_tb_s": round(rate / 1e12, 3), "products": len(shapes),
            "floor_us": round(floor_us, 2), "rows": cases}


def table(result: dict) -> str:
    """One line a row count: each way's us a chain, its multiple of the floor and us a product beyond."""
    lines = [f"a step's {result['products']} matrix products as one chain on {result['device']} (copy "
             f"{result['copy_tb_s']} TB/s; floor {result['floor_us']:.1f} us); us a chain (x floor, us a "
             "product beyond the floor)",
             f"{'rows':>5}" + "".join(f" {name:>30}" for name in WAYS)]
    for count, case in result["rows"].items():
        cells = "".join(f" {c['us']:>9.1f} ({c['x_floor']:.2f}x, {c['beyond_floor_us_a_product']:>5.2f})"
                        f"{'!' if c.get('barrier_gave_up') else ' ':>4}" for c in (case[w] for w in WAYS))
        lines.append(f"{count:>5}{cells}")
    worst = max(c["max_rel_error"] for case in result["rows"].values() for c in case.values())
    lines.append(f"largest error against each product's fp32 result: {worst:.1e}"
                 + ("; `!`: a barrier gave up waiting, that way's outputs are wrong"
                    if any(c.get("barrier_gave_up") for case in result["rows"].values() for c in case.values())
                    else ""))
    return "\n".join(lines)
