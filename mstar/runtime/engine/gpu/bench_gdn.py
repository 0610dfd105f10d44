"""`mstar bench gdn`: the decode step's gated delta-net layer (`gdn_kernels.decode_step`, what a
decode graph runs between a linear layer's two matrix products) per layer call on a GPU, at a plan's
dims (default Qwen3.5's), in parts of the kernel's value block (`value_block`) against other part
widths: by default one program a (row, q/k head) over all of d_v (one part, no arrival counter) and
parts of 64. Each variant runs as one CUDA graph of the node's linear layers (each its own conv
windows and states, rows in slots 1..R, the arrival counters zeroed once a replay as
`LinearStep.counts` is), replayed and timed with CUDA events (median, per layer call), at 1, 8 and
64 rows, beside the floor: the bytes a layer call must move (each row's fp32 state and conv window
read and written, its bf16 inputs read and outputs written) at the copy rate measured in the same
run. Each variant's output, state and conv window after one call from the same states are compared
with the kernel's own (largest differences; the conv windows must be equal).

Usage: mstar bench gdn [--plan PLAN] [--node NODE] [--blocks 128,64] [--iters N] [--json]
Needs a CUDA GPU; elsewhere it says so and exits 1.
"""
from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from mstar.arg_types import ITERS, path_arg, shown_path

ROWS = (1, 8, 64)


@dataclass(frozen=True)
class GdnShape:
    """A gated delta-net layer's heads and dims (the plan's recurrent state, `DecoderDims`)."""

    num_layers: int
    num_heads: int  # q/k heads
    num_value_heads: int
    key_dim: int
    value_dim: int
    conv_kernel: int
    eps: float

    @property
    def conv_dim(self) -> int:
        return 2 * self.num_heads * self.key_dim + self.num_value_heads * self.value_dim

    def bytes_per_row(self) -> int:
        """What one layer call must move for a row: fp32 state and conv window read and written,
        [q|k|v], z, b, a read and the output written in bf16."""
        state = self.num_value_heads * self.key_dim * self.value_dim * 4
        window = self.conv_dim * (self.conv_kernel - 1) * 4
        inputs = (self.conv_dim + self.num_value_heads * (self.value_dim + 2)) * 2
        return 2 * (state + window) + inputs + self.num_value_heads * self.value_dim * 2


@dataclass
class LayerCall:
    """One layer's tensors for `decode_step`: the step's shared inputs and the layer's own."""

    shared: dict[str, torch.Tensor]
    layer: dict[str, torch.Tensor]

    def run(self, shape: GdnShape, block_v: int, counts: torch.Tensor) -> torch.Tensor:
        from mstar.runtime.engine.gpu import gdn_kernels

        return gdn_kernels.decode_step(**self.shared, **self.layer, eps=shape.eps, num_heads=shape.num_heads,
                                       block_v=block_v, counts=counts, row_norm=None)

    def zero_counts(self, shape: GdnShape) -> torch.Tensor:
        """Arrival counters for the step's rows (`decode_step`'s `counts`), all zero."""
        mixed = self.shared["mixed"]
        return torch.zeros(mixed.shape[0] * shape.num_heads, dtype=torch.int32, device=mixed.device)

    def cloned(self) -> "LayerCall":
        return LayerCall(self.shared, {name: x.clone() for name, x in self.layer.items()})


def layer_calls(shape: GdnShape, rows: int, device: torch.device, seed: int = 0) -> list[LayerCall]:
    """Random bf16 projections of `rows` rows (views of one matrix, as the in-projection writes them)
    and, per layer, fp32 conv windows and states of rows + 1 slots (slot 0 unused)."""
    generator = torch.Generator().manual_seed(seed)

    def rand(*size: int, scale: float = 1.0, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return (torch.randn(*size, generator=generator) * scale).to(device, dtype)

    hv, dv = shape.num_value_heads, shape.value_dim
    proj = rand(rows, shape.conv_dim + hv * dv + 2 * hv, dtype=torch.bfloat16)
    mixed, z, b, a = proj.split([shape.conv_dim, hv * dv, hv, hv], dim=1)
    shared = dict(mixed=mixed, z=z, b=b, a=a, slots=torch.arange(1, rows + 1, dtype=torch.int32, device=device))
    return [LayerCall(shared, dict(
        conv_state=rand(rows + 1, shape.conv_dim, shape.conv_kernel - 1),
        conv_weight=rand(shape.conv_dim, shape.conv_kernel, scale=0.3, dtype=torch.bfloat16),
        a_log=rand(hv, scale=0.5), dt_bias=rand(hv, scale=0.5),
        state=rand(rows + 1, hv, shape.key_dim, dv, scale=0.05), norm_weight=rand(dv, dtype=torch.bfloat16)))
        for _ in range(shape.num_layers)]


def compare(shape: GdnShape, call: LayerCall, blocks: Sequence[int], reference_block: int) -> dict[int, dict]:
    """Per block width: the largest differences of one call's output and state from the reference
    width's, from the same states, and whether the conv windows came out equal."""
    counts = call.zero_counts(shape)
    reference = call.cloned()
    expected = reference.run(shape, reference_block, counts).float()
    differences = {}
    for block_v in blocks:
        other = call.cloned()
        out = other.run(shape, block_v, counts).float()
        differences[block_v] = {
            "max_out_diff": float((out - expected).abs().max()),
            "max_state_diff": float((other.layer["state"] - reference.layer["state"]).abs().max()),
            "conv_equal": bool(torch.equal(other.layer["conv_state"], reference.layer["conv_state"])),
            "counts_left_zero": not bool(counts.any())}
    return differences


def _variant_us(shape: GdnShape, calls: list[LayerCall], block_v: int, iters: int) -> float:
    from mstar.runtime.engine.gpu.bench_decode_attention import graph_us

    counts = calls[0].zero_counts(shape)

    def step() -> None:
        counts.zero_()  # once a step, as LinearStep.counts
        for call in calls:
            call.run(shape, block_v, counts)

    return graph_us(step, iters, len(calls))


def run(shape: GdnShape, blocks: Sequence[int], iters: int) -> dict:
    from mstar.runtime.engine.gpu import gdn_kernels
    from mstar.runtime.engine.gpu.bench import copy_bandwidth

    device = torch.device("cuda")
    rate = copy_bandwidth()
    own = gdn_kernels.value_block(shape.value_dim)
    others = [block for block in dict.fromkeys(blocks) if block != own]
    cases = {}
    for rows in ROWS:
        calls = layer_calls(shape, rows, device)
        case: dict = {"floor_us": round(rows * shape.bytes_per_row() / rate * 1e6, 3),
                      "kernel_us": round(_variant_us(shape, calls, own, iters), 3)}
        differences = compare(shape, calls[0], others, own)
        for block_v in others:
            us = _variant_us(shape, calls, block_v, iters)
            case[str(block_v)] = dict(differences[block_v], us=round(us, 3),
                                      over_kernel=round(us / case["kernel_us"], 3))
        cases[str(rows)] = case
        del calls
        torch.cuda.empty_cache()
    return {"shape": vars(shape), "value_block": own, "copy_tb_s": round(rate / 1e12, 3), "rows": cases,
            "device": torch.cuda.get_device_name()}


def table(result: dict) -> str:
    s = result["shape"]
    own = result["value_block"]
    first = next(iter(result["rows"].values()))
    others = [key for key in first if key.isdigit()]
    lines = [f"gated delta-net decode_step per layer call ({s['num_layers']} calls in a CUDA graph), "
             f"{s['num_heads']} q/k heads and {s['num_value_heads']} value heads, d_k {s['key_dim']}, d_v "
             f"{s['value_dim']}, on {result['device']} (copy {result['copy_tb_s']} TB/s)",
             f"{'rows':>5} {'floor us':>9} {f'parts of {own} us':>16} {'x floor':>8}"
             + "".join(f" {_label(int(key), s['value_dim']):>23}" for key in others)]
    for rows, case in result["rows"].items():
        lines.append(f"{rows:>5} {case['floor_us']:>9.2f} {case['kernel_us']:>16.2f} "
                     f"{case['kernel_us'] / case['floor_us']:>7.2f}x"
                     + "".join(f" {case[key]['us']:>14.2f} ({case[key]['over_kernel']:.2f}x)" for key in others))
    lines.append("largest differences from the kernel's own width (output, state; conv windows equal): "
                 + "; ".join(f"{key}: {max(c[key]['max_out_diff'] for c in result['rows'].values()):.1e}, "
                             f"{max(c[key]['max_state_diff'] for c in result['rows'].values()):.1e}, "
                             f"{all(c[key]['conv_equal'] for c in result['rows'].values())}" for key in others))
    return "\n".join(lines)


def _label(block_v: int, value_dim: int) -> str:
    """A variant's column: its microseconds (its time over the kernel's)."""
    return "one a head us (ratio)" if block_v >= value_dim else f"parts of {block_v} us (ratio)"


def shape_of(node) -> GdnShape:
    from mstar.plan.dims import decoder_dims

    dims = decoder_dims(node, "spec")
    return GdnShape(dims.num_linear_layers, dims.num_linear_heads, dims.num_linear_value_heads, dims.linear_key_dim,
                    dims.linear_value_dim, dims.conv_kernel, dims.rms_eps)


def _blocks(text: str) -> list[int]:
    try:
        blocks = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated powers of two, got {text!r}") from None
    if not blocks or any(b < 1 or b & (b - 1) for b in blocks):
        raise argparse.ArgumentTypeError(f"expected comma-separated powers of two, got {text!r}")
    return blocks


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="mstar bench gdn", description=__doc__.split("\n")[0])
    parser.add_argument("--plan", type=path_arg, default="generated/qwen3_5.plan")
    parser.add_argument("--node", help="the kv node with gated delta-net layers (default: the plan's first)")
    parser.add_argument("--blocks", type=_blocks, default=None, metavar="N,N",
                        help="value columns a program takes in the variants set against the kernel's own "
                             "(default: d_v, one program a head, and 64)")
    parser.add_argument("--iters", type=ITERS, default=30, help="graph replays a variant")
    parser.add_argument("--json", action="store_true", help="print one JSON object and nothing else")
    args = parser.parse_args(argv)
    shape = _plan_shape(args)
    if shape is None:
        return 1
    from mstar.runtime.engine.gpu.bench import says_no_gpu

    if says_no_gpu("mstar bench gdn"):
        return 1
    blocks = args.blocks or [shape.value_dim, 64]
    if max(blocks) > 2 * shape.value_dim:
        parser.error(f"--blocks: at most twice d_v ({shape.value_dim}) makes sense")
    result = run(shape, blocks, args.iters)
    print(json.dumps(result, sort_keys=True) if args.json else table(result))
    return 0


def _plan_shape(args: argparse.Namespace) -> Optional[GdnShape]:
    """The gated delta-net shape of the node `--node` names (default: the plan's first kv node with
    linear layers), or None after saying why."""
    from mstar.plan.dims import DimsError, decoder_dims
    from mstar.plan.io import PlanError, load_plan

    try:
        plan = load_plan(args.plan)
        nodes = [n for n in plan.nodes if n.engine == "kv" and decoder_dims(n, "spec").has_linear_layers]
    except (PlanError, DimsError) as error:
        print(f"mstar bench gdn: {error}", file=sys.stderr)
        return None
    node = next((n for n in nodes if n.name == args.node), None) if args.node else next(iter(nodes), None)
    if node is None:
        wanted = (f"no node {args.node!r} with gated delta-net layers (those with: "
                  f"{', '.join(n.name for n in nodes) or 'none'})") if args.node else \
            "no kv node with gated delta-net layers"
        print(f"mstar bench gdn: {shown_path(args.plan)} has {wanted}", file=sys.stderr)
        return None
    return shape_of(node)


if __name__ == "__main__":
    sys.exit(main())
