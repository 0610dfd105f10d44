"""`mstar bench products`: each distinct matrix product of a decoder's step, at the plan's spec dims,
timed on a GPU with its weight stored `[in, out]` (what the fast path holds: `products.py`) against
the modules' `[out, in]`, at a few row counts. Each (shape, rows, layout) runs as one CUDA graph of
16 distinct random bf16 weights of that shape (4 for a weight over 256 MiB), each read once a
replay as a step's layers read theirs, timed with CUDA events (median, per product); beside it the
floor: the weight's bytes at the copy rate measured in the same run. The last lines sum a step's
products (each shape times how many a step runs) in each variant.

The shapes come from `DecoderForward` itself, built on the meta device (`named_products`, and the
LM head), so the bench times what a step multiplies. The LM head, which the fast path keeps in the
modules' layout (its product reads the weight at its floor either way), is timed both ways too, and
a step's sum takes it in the layout of its column.

`--skinny-sweep` times the skinny kernel's launch configs instead (`skinny_sweep.py`).

Usage: mstar bench products [--plan PLAN] [--node NODE] [--rows 1,2,4,8,16,64] [--iters N] [--json]
                            [--skinny-sweep]
Needs a CUDA GPU; elsewhere it says so and exits 1.
"""
from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from typing import Any, Optional, Sequence

import torch

from mstar.arg_types import ITERS, path_arg

ROWS = (1, 2, 4, 8, 16, 64)
CHAIN_ROWS = (64, 1)
MAX_CHAIN_ROWS = 64  # skinny_products.MAX_ROWS: one tile holds the step's rows
LAYOUTS = ("stored", "module", "skinny")  # cuBLAS on [in, out], cuBLAS on [out, in], skinny_products
WEIGHTS_A_GRAPH = 16
LARGE_WEIGHT_BYTES = 256 << 20  # above this, 4 weights a graph (an LM head of 248,320 x 1024 is 485 MiB)


@dataclass(frozen=True)
class ProductShape:
    """One shape of product in a step: the roles that have it, in -> out, how many a step runs."""

    roles: tuple[str, ...]
    in_features: int
    out_features: int
    per_step: int

    @property
    def weight_bytes(self) -> int:
        return self.in_features * self.out_features * 2  # bf16


def product_shapes(dims) -> list[ProductShape]:
    """A step's products as `DecoderForward` builds them for `dims`, grouped by shape (first seen
    first), the LM head last."""
    named = named_products(dims)
    named.append(("lm_head", dims.hidden, dims.vocab))
    grouped: dict[tuple[int, int], tuple[list[str], int]] = {}
    for role, n_in, n_out in named:
        roles, count = grouped.get((n_in, n_out), ([], 0))
        if role not in roles:
            roles.append(role)
        grouped[(n_in, n_out)] = (roles, count + 1)
    return [ProductShape(tuple(roles), n_in, n_out, count) for (n_in, n_out), (roles, count) in grouped.items()]


def named_products(dims) -> list[tuple[str, int, int]]:
    """(role, in, out) of each matrix product `DecoderForward` builds for `dims` (the LM head not
    among them), in its order: built on the meta device, so no weight is allocated."""
    from mstar.runtime.engine.gpu.forward import DecoderForward, PagedKv
    from mstar.runtime.engine.models.decoder import Decoder
    from mstar.runtime.engine.models.gdn import LinearStates

    meta = torch.device("meta")
    with meta:
        model = Decoder(dims)
    kv = PagedKv(dims.num_full_layers, 1, 16, dims.num_kv_heads, dims.head_dim, torch.bfloat16, meta)
    states = LinearStates.for_dims(dims, 1, meta) if dims.has_linear_layers else None
    forward = DecoderForward(model, dims, kv, 2, states)
    return [(role, p.in_features, p.out_features) for role, p in forward.named_products()]


def _case(shape: ProductShape, rows: int, iters: int, device: torch.device) -> dict:
    """One shape at `rows` rows: us a product in either layout (the same weights, one stored
    transposed), and the largest difference between the two layouts' outputs."""
    from mstar.runtime.engine.gpu import bench_decode_attention, kernels, skinny_products
    from mstar.runtime.engine.gpu.products import Product

    count = WEIGHTS_A_GRAPH if shape.weight_bytes <= LARGE_WEIGHT_BYTES else 4
    module = [torch.empty(shape.out_features, shape.in_features, dtype=torch.bfloat16, device=device)
              .normal_(0.0, shape.in_features ** -0.5) for _ in range(count)]
    layouts = {"stored": [Product(w.t().contiguous(), None, True) for w in module],
               "module": [Product(w, None, False) for w in module]}
    if kernels.available(device) and rows <= skinny_products.MAX_ROWS and "lm_head" not in shape.roles:
        # the kernel as the engine would attach it; the LM head stays torch's
        layouts["skinny"] = [Product(w.weight, None, True) for w in layouts["stored"]]
        skinny_products.attach(layouts["skinny"], device)
    x = torch.randn(rows, shape.in_features, dtype=torch.bfloat16, device=device)
    case: dict = {}
    for name, calls in layouts.items():
        def products(calls: list[Product] = calls) -> list[torch.Tensor]:
            return [call(x) for call in calls]
        case[f"{name}_us"] = round(bench_decode_attention.graph_us(products, iters, count), 3)
    stored = layouts["stored"][0](x).float()
    case["max_diff"] = max(float((calls[0](x).float() - stored).abs().max()) for calls in layouts.values())
    return case


def run(shapes: list[ProductShape], rows: Sequence[int], iters: int, device: Optional[torch.device] = None) -> dict:
    from mstar.runtime.engine.gpu import bench

    device = device or torch.device("cuda")
    rate = bench.copy_bandwidth()
    measured: list[dict[str, Any]] = []
    for shape in shapes:
        cases = {str(r): _case(shape, r, iters, device) for r in rows}
        if device.type == "cuda":
            torch.cuda.empty_cache()
        measured.append({"roles": list(shape.roles), "in": shape.in_features, "out": shape.out_features,
                         "per_step": shape.per_step, "floor_us": round(shape.weight_bytes / rate * 1e6, 3),
                         "rows": cases})
    # a step's sum in each variant; a product the skinny kernel does not take counts there as the
    # engine runs it: the LM head on the modules' [out, in] (F.linear; it was counted at the [in, out]
    # time), a product of more rows than the kernel holds at cuBLAS's [in, out] time
    def fallback(m: dict, case: dict) -> float:
        return case["module_us"] if "lm_head" in m["roles"] else case["stored_us"]

    def step_sum(rows_key: str, layout: str) -> float:
        cases = [(m["per_step"], m, m["rows"][rows_key]) for m in measured]
        return round(sum(count * case.get(f"{layout}_us", fallback(m, case)) for count, m, case in cases), 1)

    step = {str(r): {layout: step_sum(str(r), layout) for layout in LAYOUTS} for r in rows}
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else str(device)
    return {"device": name, "copy_tb_s": round(rate / 1e12, 3), "shapes": measured, "step_us": step}


def table(result: dict) -> str:
    """One line a shape (us a product: cuBLAS on [in, out] / on the modules' [out, in] / the skinny
    kernel), then a step's sum."""
    rows = list(result["step_us"])
    lines = [f"a step's matrix products on {result['device']} (copy {result['copy_tb_s']} TB/s); us a product, "
             "cuBLAS with the weight stored [in, out] / cuBLAS on the modules' [out, in] / the split-K "
             "skinny kernel (`-`: not taken there)",
             f"{'product':<24} {'in -> out':>15} {'a step':>6} {'floor':>7}"
             + "".join(f" {f'{r} rows':>24}" for r in rows)]
    for shape in result["shapes"]:
        cells = "".join(f" {c['stored_us']:>7.2f} / {c['module_us']:>6.2f} / "
                        + (f"{c['skinny_us']:>6.2f}" if "skinny_us" in c else f"{'-':>6}")
                        for c in (shape["rows"][r] for r in rows))
        in_out = f"{shape['in']} -> {shape['out']}"
        lines.append(f"{', '.join(shape['roles']):<24} {in_out:>15} {shape['per_step']:>6} "
                     f"{shape['floor_us']:>7.2f}{cells}")
    worst = max(c["max_diff"] for shape in result["shapes"] for c in shape["rows"].values())
    lines.append(f"{'a step, all products':<24} {'':>15} {'':>6} {'':>7}"
                 + "".join(f" {s['stored']:>7.0f} / {s['module']:>6.0f} / {s['skinny']:>6.0f}"
                           for s in result["step_us"].values()))
    lines.append("a step's sum over cuBLAS [in, out]: "
                 + ", ".join(f"{r} rows module {s['module'] / s['stored']:.2f}x, "
                             f"skinny {s['skinny'] / s['stored']:.2f}x" for r, s in result["step_us"].items()))
    lines.append(f"largest difference from cuBLAS [in, out]'s output (the same weights): {worst:.1e}")
    return "\n".join(lines)


def _rows(text: str) -> list[int]:
    try:
        rows = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated row counts, got {text!r}") from None
    if not rows or any(r < 1 for r in rows):
        raise argparse.ArgumentTypeError(f"expected comma-separated row counts of at least 1, got {text!r}")
    return list(dict.fromkeys(rows))


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="mstar bench products", description=__doc__.split("\n")[0])
    parser.add_argument("--plan", type=path_arg, default="generated/llama.plan")
    parser.add_argument("--node", help="the kv node (default: the plan's first)")
    parser.add_argument("--rows", type=_rows, metavar="N,N",
                        help=f"row counts to time (default {','.join(map(str, ROWS))}; with --chain "
                             f"{','.join(map(str, CHAIN_ROWS))})")
    parser.add_argument("--iters", type=ITERS, default=30, help="graph replays a case")
    parser.add_argument("--json", action="store_true", help="print one JSON object and nothing else")
    parser.add_argument("--skinny-sweep", action="store_true",
                        help="instead: the split-K skinny kernel under each of its 50 launch configs against "
                             "cuBLAS, per shape and row count of at most 64 (minutes; try --rows 64,16,1)")
    parser.add_argument("--chain", action="store_true",
                        help="instead: the step's products as one dependent chain, a kernel a product (cuBLAS, "
                             "the skinny kernel) against one persistent kernel (bench_chain.py)")
    args = parser.parse_args(argv)
    if args.chain and args.skinny_sweep:
        parser.error("--chain and --skinny-sweep are two different runs: give one")
    if args.rows is None:
        args.rows = list(CHAIN_ROWS if args.chain else ROWS)
    elif args.chain and max(args.rows) > MAX_CHAIN_ROWS:
        parser.error(f"--chain takes at most {MAX_CHAIN_ROWS} rows (the kernels hold a step's rows in one tile)")
    dims = _plan_dims(args)
    if dims is None:
        return 1
    from mstar.runtime.engine.gpu.bench import says_no_gpu

    if says_no_gpu("mstar bench products"):
        return 1
    if args.chain:
        from mstar.runtime.engine.gpu import bench_chain

        chained = bench_chain.run(dims, args.rows, args.iters)
        print(json.dumps(chained, sort_keys=True) if args.json else bench_chain.table(chained))
        return 0
    if args.skinny_sweep:
        from mstar.runtime.engine.gpu import skinny_sweep

        swept = skinny_sweep.sweep(product_shapes(dims), args.rows, args.iters)
        print(json.dumps(swept, sort_keys=True) if args.json else skinny_sweep.table(swept))
        return 0
    result = run(product_shapes(dims), args.rows, args.iters)
    print(json.dumps(result, sort_keys=True) if args.json else table(result))
    return 0


def _plan_dims(args: argparse.Namespace) -> Any:
    """The spec dims of the kv node `--node` names (default: the plan's first), or None after
    saying why."""
    from mstar.plan.dims import DimsError, decoder_dims
    from mstar.plan.io import PlanError, load_plan
    from mstar.runtime.engine.gpu.bench import kv_node

    try:
        plan = load_plan(args.plan)
    except PlanError as error:
        print(f"mstar bench products: {error}", file=sys.stderr)
        return None
    node = kv_node(plan, args, "mstar bench products")
    if node is None:
        return None
    try:
        return decoder_dims(node, "spec")
    except DimsError as error:
        print(f"mstar bench products: node {node.name}: {error}", file=sys.stderr)
        return None


if __name__ == "__main__":
    sys.exit(main())
