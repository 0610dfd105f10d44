"""A Triton matrix product for the few rows of a decode step, split along K so the GPU fills up.

`skinny_mm(x, weight, bias, gated, config, workspace)`: x `[M, K]` (or, `gated`, the gate/up product's
`[M, 2K]` whose silu(gate) * up is the input, computed as the product loads it), weight `[K, N]`
(stored `[in, out]`, as `products.py` holds it on a GPU), bias `[N]` or None -> `[M, N]` in x's dtype.

Why: at 64 rows cuBLAS ran Llama-3.2-1B's q/k/v and o products at about 2.5x the time their weights
take to read, and down (with its own split-K reduction kernel) at 1.7x (docs/engine.md, "The step's
first and last kernels"): a product of 2048 or 3072 outputs in tiles of 128 columns is 16-24 programs
on 132 SMs, each streaming its whole K. Here each tile of `BLOCK_N` columns is cut into `split` pieces
of K, one program each, so a product has `ceil(N / BLOCK_N) * split` programs. Each writes its fp32
partial tile to the workspace and counts itself in the tile's counter (an atomic, acquire-release);
the program that counts last sums the partials (in split order, so the result does not depend on
which program finished first), adds the bias, stores the tile and sets the counter back to zero for
the next product: one launch, no memset and no reduction kernel, so it can sit in a CUDA graph.

`gated` fuses SwiGLU's `silu(gate) * up` into down's operand load, rounded as `kernels.silu_mul`
(silu rounded to the activation dtype, then the product rounded), so the activation tensor and its
kernel go. With programmatic dependent launch (`kernels.pdl_launch`) the program computes its
addresses before waiting on the previous kernel, and lets the next kernel launch once its loop is done.
(Loading the first weight block before that wait was measured in a one-off sweep and did not make
it beat cuBLAS at any shape: docs/engine.md, "Nor does a product of our own at 64 rows".)

Measured on the H200, it was slower than cuBLAS in the engine (the chained 64-row decode step 1.66
-> 2.57 ms with `config_for`'s launches); the best of 50 launch configs a shape was 11% slower on
Llama-3.2-1B's q/k/v and o at 64 rows, 2-3% quicker on gate/up and down, 70% slower with down's
gated operand, and quicker on Qwen3.5's narrow products at 1-16 rows (docs/engine.md, "A split-K
Triton product for few rows"). No per-shape choice is worth wiring at those margins, so it is off
by default: `set_enabled(True)` (`mstar bench engine --skinny-products`) is the what-if.

A `Workspace` (partials and counters) belongs to one step function on one stream: products on it run
one after another (a product's programs touch it only after the previous kernel has finished).

Tests run it under the Triton interpreter on the CPU (tests/engine/test_skinny_products_interpreted.py).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Iterable, Optional

import torch

from mstar.runtime.engine.gpu import kernels
from mstar.runtime.engine.gpu.decode_attention import DOT_FP32

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU installs without Triton never call it
    triton = None

MAX_ROWS = 64  # one program holds every row of the step (BLOCK_M); more rows go to cuBLAS

ENABLED_BY_DEFAULT = False  # measured slower than cuBLAS (module docstring)
_enabled = ENABLED_BY_DEFAULT


def set_enabled(enabled: bool) -> None:
    """Serve the few-row steps of products built afterwards here (`attach`), or leave every step to
    cuBLAS (`mstar bench engine --skinny-products`, the what-if)."""
    global _enabled
    _enabled = enabled


def serves(device: torch.device) -> bool:
    """Whether `attach` gives products on `device` this kernel."""
    return _enabled and kernels.available(device)


@dataclass(frozen=True)
class SkinnyConfig:
    """One launch's shape: columns a program, K a loop iteration, pieces of K, warps, stages."""

    block_n: int
    block_k: int
    split: int
    num_warps: int = 4
    num_stages: int = 4

    def k_piece(self, k: int) -> int:
        """The K each program covers: a multiple of block_k, so only the last piece is ragged."""
        per = -(-k // self.split)
        return -(-per // self.block_k) * self.block_k

    def programs(self, k: int, n: int) -> tuple[int, int]:
        """(column tiles, pieces of K that hold any of K)."""
        return -(-n // self.block_n), -(-k // self.k_piece(k))


class Workspace:
    """The partial tiles and the tiles' counters of the products of one step function (module
    docstring); grown to the largest product it serves, the counters zero between products."""

    def __init__(self, device: torch.device):
        self.device = device
        self.partials = torch.empty(0, dtype=torch.float32, device=device)
        self.counters = torch.zeros(0, dtype=torch.int32, device=device)

    def reserve(self, partial_values: int, tiles: int) -> None:
        """Room for `partial_values` fp32 partials and `tiles` counters. Grows only outside a CUDA
        graph's capture: a step function reserves for its products at construction (`reserve_for`)."""
        if self.partials.numel() < partial_values:
            self.partials = torch.empty(partial_values, dtype=torch.float32, device=self.device)
        if self.counters.numel() < tiles:
            self.counters = torch.zeros(tiles, dtype=torch.int32, device=self.device)

    def reserve_for(self, k: int, n: int, config: SkinnyConfig) -> None:
        tiles, pieces = config.programs(k, n)
        self.reserve(pieces * MAX_ROWS * tiles * config.block_n, tiles)


def config_for(k: int, n: int, sm_count: int) -> SkinnyConfig:
    """The launch for a product of K x N on `sm_count` SMs: 64 columns a program, and pieces of K
    enough for about two programs an SM, each piece at least two loop iterations long."""
    block_n, block_k = 64, 128
    tiles = -(-n // block_n)
    split = 1
    while split * 2 * tiles <= 2 * sm_count and split * 2 * 2 * block_k <= k:
        split *= 2
    return SkinnyConfig(block_n, block_k, split)


def block_m(rows: int) -> int:
    """Rows a program holds: tl.dot's smallest tile is 16."""
    return max(16, 1 << (rows - 1).bit_length())


if triton is not None:
    from mstar.runtime.engine.gpu.kernels import arrivals_before

    @triton.jit
    def _skinny_kernel(x_ptr, w_ptr, b_ptr, out_ptr, part_ptr, count_ptr, M, N, K, K_PIECE, stride_x, stride_w,
                       stride_o, HAS_BIAS: tl.constexpr, ADDS: tl.constexpr, GATED: tl.constexpr, SPLIT: tl.constexpr,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT_FP32: tl.constexpr,
                       PDL: tl.constexpr):
        tile = tl.program_id(0)
        piece = tl.program_id(1)
        rows = tl.arange(0, BLOCK_M)
        cols = tile * BLOCK_N + tl.arange(0, BLOCK_N)
        row_mask = rows < M
        col_mask = cols < N
        k_start = piece * K_PIECE
        k_end = tl.minimum(k_start + K_PIECE, K)
        if PDL:
            tl.extra.cuda.gdc_wait()
        acc = piece_product(x_ptr, w_ptr, rows, cols, row_mask, col_mask, k_start, k_end, K, stride_x, stride_w,
                            GATED, BLOCK_M, BLOCK_N, BLOCK_K, DOT_FP32)
        if PDL:
            tl.extra.cuda.gdc_launch_dependents()
        out_ptrs = out_ptr + rows[:, None].to(tl.int64) * stride_o + cols[None, :]
        out_mask = row_mask[:, None] & col_mask[None, :]
        if SPLIT == 1:
            _store_tile(acc, b_ptr, cols, col_mask, out_ptrs, out_mask, HAS_BIAS, ADDS)
        else:
            # partial tiles: [piece, tile, BLOCK_M, BLOCK_N], each program's own block
            tile_values = BLOCK_M * BLOCK_N
            local = rows[:, None] * BLOCK_N + tl.arange(0, BLOCK_N)[None, :]
            tiles = tl.num_programs(0)
            # (the step's rows only: at one row the tile's other 15 would be 15/16 of the traffic)
            tl.store(part_ptr + (piece * tiles + tile).to(tl.int64) * tile_values + local, acc,
                     mask=row_mask[:, None])
            if arrivals_before(count_ptr + tile, SPLIT) == SPLIT - 1:
                total = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
                for other in range(0, SPLIT):  # in piece order: the sum does not depend on who came last
                    total += tl.load(part_ptr + (other * tiles + tile).to(tl.int64) * tile_values + local,
                                     mask=row_mask[:, None], other=0.0, cache_modifier=".cg")
                _store_tile(total, b_ptr, cols, col_mask, out_ptrs, out_mask, HAS_BIAS, ADDS)
                tl.atomic_xchg(count_ptr + tile, 0)

    @triton.jit
    def piece_product(x_ptr, w_ptr, rows, cols, row_mask, col_mask, k_start, k_end, K, stride_x, stride_w,
                      GATED: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                      DOT_FP32: tl.constexpr):
        """The fp32 `[BLOCK_M, BLOCK_N]` product of x's rows and the weight's columns `cols` over
        K in [k_start, k_end) (`GATED`: x holds gate and up, K apart, and the operand is
        silu(gate) * up). Also the persistent chain's item (persistent_chain.py)."""
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k in range(k_start, k_end, BLOCK_K):
            ks = k + tl.arange(0, BLOCK_K)
            k_mask = ks < k_end
            a_mask = row_mask[:, None] & k_mask[None, :]
            a_ptrs = x_ptr + rows[:, None].to(tl.int64) * stride_x + ks[None, :]
            if GATED:
                gate = tl.load(a_ptrs, mask=a_mask, other=0.0).to(tl.float32)
                up = tl.load(a_ptrs + K, mask=a_mask, other=0.0).to(tl.float32)
                # kernels.silu_mul's rounding: silu in the activation dtype, then the product
                silu = (gate * tl.sigmoid(gate)).to(x_ptr.dtype.element_ty).to(tl.float32)
                a = (silu * up).to(x_ptr.dtype.element_ty)
            else:
                a = tl.load(a_ptrs, mask=a_mask, other=0.0)
            w = tl.load(w_ptr + ks[:, None].to(tl.int64) * stride_w + cols[None, :],
                        mask=k_mask[:, None] & col_mask[None, :], other=0.0)
            if DOT_FP32:  # the interpreter's bf16 tl.dot is wrong (decode_attention.DOT_FP32)
                acc = tl.dot(a.to(tl.float32), w.to(tl.float32), acc)
            else:
                acc = tl.dot(a, w, acc)
        return acc

    @triton.jit
    def _store_tile(total, b_ptr, cols, col_mask, out_ptrs, out_mask, HAS_BIAS: tl.constexpr, ADDS: tl.constexpr):
        """A tile's sum, plus the bias, plus (ADDS) what the output held (cuBLAS's beta = 1: one
        rounding, of the fp32 sum), stored."""
        if HAS_BIAS:
            total += tl.load(b_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
        if ADDS:
            total += tl.load(out_ptrs, mask=out_mask, other=0.0).to(tl.float32)
        tl.store(out_ptrs, total.to(out_ptrs.dtype.element_ty), mask=out_mask)


def skinny_mm(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], config: SkinnyConfig,
              workspace: Workspace, gated: bool = False, into: Optional[torch.Tensor] = None,
              out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """x `[M, K]` (`gated`: `[M, 2K]`, the input being silu(gate) * up) times weight `[K, N]`, plus
    bias; M at most MAX_ROWS; x's columns and the weight's rows contiguous. `into` `[M, N]`: the
    product is added into it in place and it is returned (`Product.accumulate`); `out` `[M, N]`:
    written into it (`bench_chain`'s chain), else a new tensor."""
    m = x.shape[0]
    k, n = weight.shape
    if m > MAX_ROWS:
        raise ValueError(f"skinny_mm takes at most {MAX_ROWS} rows, got {m}")
    if x.shape[1] != (2 * k if gated else k) or x.stride(1) != 1 or weight.stride(1) != 1:
        raise ValueError(f"skinny_mm: x {tuple(x.shape)} does not fit weight {tuple(weight.shape)}"
                         f"{' (gated)' if gated else ''}, or a tensor's last dimension is strided")
    if into is not None and out is not None:
        raise ValueError("skinny_mm: give into (add) or out (write), not both")
    given, given_name = (into, "into") if into is not None else (out, "out")
    if given is not None and (given.shape != (m, n) or given.stride(1) != 1):
        raise ValueError(f"skinny_mm: {given_name} {tuple(given.shape)} is not the [{m}, {n}] output with "
                         "contiguous columns")
    out = torch.empty((m, n), dtype=x.dtype, device=x.device) if given is None else given
    if m == 0:
        return out
    tiles, pieces = config.programs(k, n)
    if pieces > 1:
        workspace.reserve_for(k, n, config)
    _skinny_kernel[(tiles, pieces)](
        x, weight, bias if bias is not None else weight, out, workspace.partials, workspace.counters,
        m, n, k, config.k_piece(k), x.stride(0), weight.stride(0), out.stride(0),
        HAS_BIAS=bias is not None, ADDS=into is not None, GATED=gated, SPLIT=pieces, BLOCK_M=block_m(m),
        BLOCK_N=config.block_n, BLOCK_K=config.block_k, DOT_FP32=DOT_FP32, num_warps=config.num_warps,
        num_stages=config.num_stages, **kernels.pdl_launch(x))
    return out


@dataclass
class FewRowsProduct:
    """One product's few-row steps on this kernel (`products.FewRows`): its weight `[K, N]`, bias,
    launch and the step function's workspace."""

    weight: torch.Tensor
    bias: Optional[torch.Tensor]
    config: SkinnyConfig
    workspace: Workspace
    max_rows: int = MAX_ROWS

    def __call__(self, x: torch.Tensor, gated: bool = False, into: Optional[torch.Tensor] = None) -> torch.Tensor:
        return skinny_mm(x, self.weight, self.bias, self.config, self.workspace, gated, into)


def attach(products: Iterable, device: torch.device, sm_count: Optional[int] = None,
           config: Optional[SkinnyConfig] = None) -> int:
    """Give each product held `[in, out]` on `device` its few-row kernel, all on one workspace
    reserved here (outside any graph's capture); returns how many took it. Products held in the
    modules' layout keep cuBLAS. `sm_count`: the device's SMs (read from it when not given);
    `config`: one launch for every product (a what-if), else `config_for`'s per shape."""
    workspace = Workspace(device)
    attached = 0
    for product in products:
        if not product.is_transposed:
            continue
        k, n = product.weight.shape
        launch = config or config_for(k, n, sm_count or _sm_count(device))
        workspace.reserve_for(k, n, launch)
        product.few_rows = FewRowsProduct(product.weight, product.bias, launch, workspace)
        attached += 1
    return attached


@functools.lru_cache(maxsize=None)
def _sm_count(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count
