"""`mstar bench products --skinny-sweep`: the split-K skinny kernel (`skinny_products.py`) under each
of `configs()`'s launch configs against cuBLAS, per product shape of a decoder's step and row count.

Each (shape, rows) times cuBLAS on the `[in, out]` weights (down: plus `kernels.silu_mul`, and the
kernel with its gated operand beside it) and the kernel under every config, each as one CUDA graph
of 16 distinct weights (`bench_decode_attention.graph_us`, as `bench_products` times); a config the
device cannot launch (out of shared memory) is left out. Out: per case, cuBLAS's us, `config_for`'s
config and us, and the fastest configs. What docs/engine.md ("A split-K Triton product for few
rows") read from it.
"""
from __future__ import annotations

from typing import Any, Callable, Optional, Sequence

import torch

BEST_KEPT = 3  # fastest configs listed a case


def configs() -> list:
    """50 launch configs: 64- and 128-column tiles at 64-256 K a step and 1-16 pieces (128 columns
    with 4 or 8 warps), and 32-column tiles at 128 K a step; 3 stages at 256 K a step, else 4."""
    from mstar.runtime.engine.gpu.skinny_products import SkinnyConfig

    def stages(block_k: int) -> int:
        return 3 if block_k == 256 else 4

    splits, steps = (1, 2, 4, 8, 16), (64, 128, 256)
    return ([SkinnyConfig(64, k, s, 4, stages(k)) for k in steps for s in splits]
            + [SkinnyConfig(128, k, s, w, stages(k)) for k in steps for s in splits for w in (4, 8)]
            + [SkinnyConfig(32, 128, s, 4, 4) for s in splits])


def sweep(shapes: list, rows: Sequence[int], iters: int, device: Optional[torch.device] = None) -> dict:
    """Every shape but the LM head's, at each row count the kernel takes (module docstring)."""
    from mstar.runtime.engine.gpu import bench, skinny_products

    device = device or torch.device("cuda")
    sm_count = torch.cuda.get_device_properties(device).multi_processor_count
    rate = bench.copy_bandwidth()
    cases = []
    for shape in shapes:
        if "lm_head" in shape.roles:
            continue
        for is_gated in (False, True) if "down" in shape.roles else (False,):
            for num_rows in (r for r in rows if r <= skinny_products.MAX_ROWS):
                case = _case(shape.in_features, shape.out_features, num_rows, is_gated, iters, device, sm_count)
                case.update(roles=list(shape.roles), floor_us=round(shape.weight_bytes / rate * 1e6, 2))
                cases.append(case)
    return {"device": torch.cuda.get_device_name(device), "copy_tb_s": round(rate / 1e12, 3), "cases": cases}


def _case(k: int, n: int, rows: int, is_gated: bool, iters: int, device: torch.device, sm_count: int) -> dict:
    from mstar.runtime.engine.gpu import kernels, skinny_products
    from mstar.runtime.engine.gpu.bench_decode_attention import graph_us
    from mstar.runtime.engine.gpu.bench_products import WEIGHTS_A_GRAPH
    from mstar.runtime.engine.gpu.products import Product

    weights = [torch.empty(k, n, dtype=torch.bfloat16, device=device).normal_(0.0, k ** -0.5)
               for _ in range(WEIGHTS_A_GRAPH)]
    x = torch.randn(rows, 2 * k if is_gated else k, dtype=torch.bfloat16, device=device)
    cublas = [Product(w, None, True) for w in weights]
    cublas_us = graph_us(lambda: [p(kernels.silu_mul(x) if is_gated else x) for p in cublas], iters, WEIGHTS_A_GRAPH)
    workspace = skinny_products.Workspace(device)
    timed = []

    def launches(config: Any) -> Callable[[], list[torch.Tensor]]:
        return lambda: [skinny_products.skinny_mm(x, w, None, config, workspace, is_gated) for w in weights]

    for config in configs():
        workspace.reserve_for(k, n, config)
        try:
            us = graph_us(launches(config), iters, WEIGHTS_A_GRAPH)
        except Exception as error:  # a config past the device's shared memory: Triton's OutOfResources
            if type(error).__name__ != "OutOfResources":
                raise
            continue
        timed.append((round(us, 2), config))
    timed.sort(key=lambda pair: pair[0])
    heuristic = skinny_products.config_for(k, n, sm_count)
    return {"k": k, "n": n, "rows": rows, "gated": is_gated, "cublas_us": round(cublas_us, 2),
            "config_for": _name(heuristic), "config_for_us": next((us for us, c in timed if c == heuristic), None),
            "best": [[us, _name(c)] for us, c in timed[:BEST_KEPT]]}


def _name(config: Any) -> str:
    return (f"n{config.block_n} k{config.block_k} split{config.split} w{config.num_warps} "
            f"s{config.num_stages}")


def table(result: dict) -> str:
    lines = [f"the skinny kernel's launch configs on {result['device']} (copy {result['copy_tb_s']} TB/s), us a "
             "product (graphs of 16 weights): cuBLAS [in, out] (down gated: plus silu_mul), config_for's, the "
             "fastest (its ratio over cuBLAS)"]
    for case in result["cases"]:
        best_us, best_config = case["best"][0] if case["best"] else (None, "-")
        ratio = f"{best_us / case['cublas_us']:.2f}" if best_us else "-"
        what = f"{', '.join(case['roles'])}{' gated' if case['gated'] else ''} {case['k']} -> {case['n']}"
        lines.append(f"{what:<32} {case['rows']:>3} rows  floor {case['floor_us']:>6.2f}  cuBLAS "
                     f"{case['cublas_us']:>7.2f}  config_for {case['config_for_us'] or '-':>7} ({case['config_for']})"
                     f"  best {best_us or '-':>7} ({best_config}, {ratio})")
    return "\n".join(lines)
