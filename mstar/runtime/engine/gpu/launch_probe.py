"""A what-if that measures what one small kernel costs inside a step's graph: extra launches a layer.

In: `set_extra_launches(n)` before a decoder's forward is built or captured (`mstar bench engine
--extra-launches N`); the fused forward then calls `after_layer(x)` after each layer, which launches
`n` small kernels, each shaped as the step's small kernels are (a program a token, reading its row
of the residual stream after the PDL wait, as `add_rmsnorm` does) and writing its row's sum into a
scratch that nothing reads, so the step computes what it computed. Out: nothing but the launches.

Why: the open decode targets rest on what a launch costs beyond its bytes inside the CUDA graphs
(docs/engine.md, "Nor does a product of our own at 64 rows": about 4-5 us a product; a few
microseconds a small kernel), and every way left to close them removes kernels (norms folded into
the products, the split merge in the attention kernel, epilogues fused into a product). Timing a
step with N x layers launches more against the same step without, in one run, gives that cost
directly: (t_N - t_0) / (N x layers) is what removing one such kernel can save at most.
"""
from __future__ import annotations

import torch

from mstar.runtime.engine.gpu.kernels import pdl_launch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU installs without Triton never launch it
    triton = None

_extra_launches = 0


def set_extra_launches(count: int) -> None:
    """Launch `count` probe kernels after each layer of fused forwards (0: none, the default)."""
    if count < 0:
        raise ValueError(f"extra launches must be 0 or more, got {count}")
    global _extra_launches
    _extra_launches = count


def extra_launches() -> int:
    return _extra_launches


def after_layer(x: torch.Tensor) -> None:
    """The probe kernels after one layer (none unless `set_extra_launches`); x `[N, hidden]` with
    contiguous columns. Each writes a fresh scratch (in a graph's capture, the graph's pool)."""
    if not _extra_launches or x.shape[0] == 0:
        return
    scratch = torch.empty(x.shape[0], dtype=torch.float32, device=x.device)
    for _ in range(_extra_launches):
        _probe_kernel[(x.shape[0],)](x, scratch, x.stride(0), x.shape[1],
                                     BLOCK=triton.next_power_of_2(x.shape[1]), num_warps=4, **pdl_launch(x))


if triton is not None:
    @triton.jit
    def _probe_kernel(x_ptr, scratch_ptr, stride_x, num_cols, BLOCK: tl.constexpr, PDL: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        if PDL:
            tl.extra.cuda.gdc_wait()
        x = tl.load(x_ptr + row * stride_x + cols, mask=cols < num_cols, other=0.0).to(tl.float32)
        if PDL:
            tl.extra.cuda.gdc_launch_dependents()
        tl.store(scratch_ptr + row, tl.sum(x, axis=0))
