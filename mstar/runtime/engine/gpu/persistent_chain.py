"""A chain of matrix products in one persistent kernel, phases apart by a grid barrier: the probe of
whether a decode step's per-product fixed cost goes when its products stop being kernels.

Why: each product of a decode step pays 4-6 us beyond its bytes whichever kernel runs it (cuBLAS,
the split-K `skinny_products` kernel; docs/engine.md, "Nor does a product of our own at 64 rows"),
and a Llama-3.2-1B step holds 65 of them. The path the measurements leave is fewer kernels a step:
a layer's work in one persistent kernel. Before building that, this measures its core: the step's
products as phases of one launch. The grid is one program an SM (all resident at once, so a spin
barrier cannot deadlock); in phase p each program takes the (column tile, piece of K) items
`item = program, program + programs, ...` of product p, split along K as `skinny_products` does (the
last piece of a tile to arrive sums the fp32 partials in piece order and stores the bf16 tile); then
every program counts itself in at the grid barrier and waits until all have, so phase p + 1 reads
phase p's outputs. With `prefetch_rows`, a program that reaches the barrier first asks L2 for the
first rows of its next items' weights while it waits (weights are no phase's output, so that is
safe), which a kernel boundary cannot do.

`PersistentChain(phases, ...)` holds the phase table (addresses, shapes, strides, pieces: int64, one
row a phase), the tile counters, the barrier's two counters and the partials; calling it launches
the chain. Under the Triton interpreter (which runs a grid's programs one after another, so no
barrier could be passed) the same kernel runs one launch a phase without the barrier: the tests
check the arithmetic there (tests/engine/test_persistent_chain_interpreted.py); the barrier and the
prefetch run only on a GPU (tests/gpu/test_persistent_chain_gpu.py, `mstar bench products --chain`).

A spin that waits past `MAX_SPINS` polls (a program missing, which one program an SM should never
allow) stops waiting and sets `fault`, and later barriers then do not wait at all, so a wrong launch
gives wrong numbers and a flag within about a second, not a hang. The flag stays set.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from mstar.runtime.engine.gpu.decode_attention import DOT_FP32
from mstar.runtime.engine.gpu.skinny_products import MAX_ROWS, SkinnyConfig, block_m

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU installs without Triton never call it
    triton = None

FIELDS = 12  # int64 columns of a phase's row in the table (the kernel's `_phase_fields` reads them)
MAX_SPINS = 1 << 20  # barrier polls (about a second) before a program gives up waiting (module docstring)
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


@dataclass(frozen=True)
class ChainPhase:
    """One product of the chain: out `[M, N]` = x `[M, K]` @ weight `[K, N]` (the weight stored
    `[in, out]`, as `products.py` holds it); x may be a column slice of an earlier phase's output."""

    x: torch.Tensor
    weight: torch.Tensor
    out: torch.Tensor


def split_for(k: int, n: int, programs: int, block_n: int, block_k: int) -> int:
    """Pieces of K for a product on `programs` programs: the most (a power of two) whose items still
    fit one round of the grid, each piece at least two K blocks long."""
    tiles = -(-n // block_n)
    split = 1
    while tiles * split * 2 <= programs and split * 2 * 2 * block_k <= k:
        split *= 2
    return split


if triton is not None:
    from mstar.runtime.engine.gpu.skinny_products import piece_product

    @triton.jit
    def _phase_fields(entry):
        """A phase's row of the table: (x, weight, out, K, N, stride_x, stride_w, stride_o, split,
        k_piece, first counter). Values read from memory carry none of the divisibility a launch's
        arguments are specialised on, without which the loads compile element by element and the
        K loop is not pipelined (checked offline on sm_90: no cp.async); the host guarantees these
        multiples (`_check_phases`). A pointer's hint goes on the pointer: on the integer before the
        cast it is lost."""
        x_ptr = tl.multiple_of(tl.load(entry + 0).to(tl.pointer_type(tl.bfloat16)), 16)
        w_ptr = tl.multiple_of(tl.load(entry + 1).to(tl.pointer_type(tl.bfloat16)), 16)
        out_ptr = tl.multiple_of(tl.load(entry + 2).to(tl.pointer_type(tl.bfloat16)), 16)
        return (x_ptr, w_ptr, out_ptr, tl.multiple_of(tl.load(entry + 3), 16), tl.multiple_of(tl.load(entry + 4), 16),
                tl.multiple_of(tl.load(entry + 5), 16), tl.multiple_of(tl.load(entry + 6), 16),
                tl.multiple_of(tl.load(entry + 7), 16), tl.load(entry + 8), tl.multiple_of(tl.load(entry + 9), 16),
                tl.load(entry + 10))

    @triton.jit
    def _item(x_ptr, w_ptr, out_ptr, part_ptr, count_ptr, K, N, stride_x, stride_w, stride_o, split, k_piece,
              tile, piece, tiles, M, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
              DOT_FP32: tl.constexpr):
        """One (column tile, piece of K) of a product, as `skinny_products._skinny_kernel` computes it."""
        rows = tl.arange(0, BLOCK_M)
        cols = tile * BLOCK_N + tl.arange(0, BLOCK_N)
        row_mask = rows < M
        col_mask = cols < N
        k_start = piece * k_piece
        k_end = tl.minimum(k_start + k_piece, K)
        acc = piece_product(x_ptr, w_ptr, rows, cols, row_mask, col_mask, k_start, k_end, K, stride_x, stride_w,
                            False, BLOCK_M, BLOCK_N, BLOCK_K, DOT_FP32)
        out_ptrs = out_ptr + rows[:, None].to(tl.int64) * stride_o + cols[None, :]
        out_mask = row_mask[:, None] & col_mask[None, :]
        if split == 1:
            tl.store(out_ptrs, acc.to(tl.bfloat16), mask=out_mask)
        else:
            tile_values = BLOCK_M * BLOCK_N
            local = rows[:, None] * BLOCK_N + tl.arange(0, BLOCK_N)[None, :]
            tl.store(part_ptr + (piece * tiles + tile).to(tl.int64) * tile_values + local, acc,
                     mask=row_mask[:, None])
            tl.debug_barrier()  # every thread's partial before the count (kernels.arrivals_before)
            arrived = tl.atomic_add(count_ptr + tile, 1, sem="acq_rel")
            tl.debug_barrier()
            if arrived == split - 1:
                total = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
                for other in range(0, split):  # in piece order: the sum does not depend on who came last
                    total += tl.load(part_ptr + (other * tiles + tile).to(tl.int64) * tile_values + local,
                                     mask=row_mask[:, None], other=0.0, cache_modifier=".cg")
                tl.store(out_ptrs, total.to(tl.bfloat16), mask=out_mask)
                tl.atomic_xchg(count_ptr + tile, 0)

    @triton.jit
    def _prefetch_next(entry, program, programs, ROWS: tl.constexpr, BLOCK_N: tl.constexpr):
        """Ask L2 for the first ROWS rows of K of this program's items in the phase at `entry`: one
        `prefetch.global.L2` a 128-byte line (64 bf16 columns of a weight row)."""
        w_addr = tl.load(entry + 1)
        K = tl.load(entry + 3)
        N = tl.load(entry + 4)
        stride_w = tl.load(entry + 6)
        split = tl.load(entry + 8)
        k_piece = tl.load(entry + 9)
        tiles = tl.cdiv(N, BLOCK_N)
        for item in range(program, tiles * split, programs):
            tile = item % tiles
            k_start = (item // tiles) * k_piece
            last = tl.minimum(k_start + k_piece, K) - 1
            ks = tl.minimum(k_start + tl.arange(0, ROWS), last)  # clamped: an asm line takes no mask
            for line in tl.static_range(BLOCK_N // 64):
                col = tl.minimum(tile * BLOCK_N + line * 64, N - 1)
                addresses = (w_addr + (ks.to(tl.int64) * stride_w + col) * 2).to(tl.pointer_type(tl.int8))
                tl.inline_asm_elementwise("prefetch.global.L2 [$1];", "=r,l", [addresses], dtype=tl.int32,
                                          is_pure=False, pack=1)

    @triton.jit
    def _grid_barrier(barrier_ptr, fault_ptr, target, max_spins):
        """Count this program in and wait until `target` arrivals in all (release, then acquire; the
        thread barriers extend both to the whole program as in kernels.arrivals_before)."""
        tl.debug_barrier()
        seen = tl.atomic_add(barrier_ptr, 1, sem="acq_rel") + 1
        spins = 0
        if tl.atomic_add(fault_ptr, 0, sem="relaxed") != 0:
            spins = max_spins  # an earlier barrier gave up: the launch ends at once, flagged
        while (seen < target) & (spins < max_spins):
            seen = tl.atomic_add(barrier_ptr, 0, sem="acquire")
            spins += 1
        if seen < target:
            tl.atomic_xchg(fault_ptr, 1)
        tl.debug_barrier()

    @triton.jit
    def _chain_kernel(table_ptr, counters_ptr, barrier_ptr, part_ptr, fault_ptr, M, first_phase, end_phase,
                      max_spins, BARRIER: tl.constexpr, PREFETCH_ROWS: tl.constexpr, FIELDS: tl.constexpr,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                      DOT_FP32: tl.constexpr):
        program = tl.program_id(0)
        programs = tl.num_programs(0)
        for phase in range(first_phase, end_phase):
            (x_ptr, w_ptr, out_ptr, K, N, stride_x, stride_w, stride_o, split, k_piece,
             first_counter) = _phase_fields(table_ptr + phase * FIELDS)
            tiles = tl.cdiv(N, BLOCK_N)
            for item in range(program, tiles * split, programs):
                _item(x_ptr, w_ptr, out_ptr, part_ptr, counters_ptr + first_counter, K, N, stride_x, stride_w,
                      stride_o, split, k_piece, item % tiles, item // tiles, tiles, M, BLOCK_M, BLOCK_N, BLOCK_K,
                      DOT_FP32)
            if BARRIER:
                if phase + 1 < end_phase:
                    if PREFETCH_ROWS > 0:
                        _prefetch_next(table_ptr + (phase + 1) * FIELDS, program, programs, PREFETCH_ROWS, BLOCK_N)
                    _grid_barrier(barrier_ptr, fault_ptr, (phase - first_phase + 1) * programs, max_spins)
        if BARRIER:
            # the last program out sets both counters back for the next launch: every program has
            # left every spin by the time all have counted in here
            left = tl.atomic_add(barrier_ptr + 1, 1, sem="acq_rel")
            if left == programs - 1:
                tl.atomic_xchg(barrier_ptr, 0)
                tl.atomic_xchg(barrier_ptr + 1, 0)


class PersistentChain:
    """The products of `phases`, run in order by one persistent launch (module docstring)."""

    def __init__(self, phases: Sequence[ChainPhase], programs: Optional[int] = None, block_n: int = 64,
                 block_k: int = 128, prefetch_rows: int = 0, num_warps: int = 4, num_stages: int = 4):
        if not phases:
            raise ValueError("a chain needs at least one product")
        device = phases[0].x.device
        self.rows = phases[0].x.shape[0]
        _check_phases(phases, self.rows)
        if prefetch_rows and (INTERPRETED or prefetch_rows & (prefetch_rows - 1) or block_n % 64):
            raise ValueError("prefetch_rows needs a GPU, a power of two and block_n a multiple of 64")
        self.programs = programs or _sm_count(device)
        self.block_n, self.block_k = block_n, block_k
        self.prefetch_rows, self.num_warps, self.num_stages = prefetch_rows, num_warps, num_stages
        self.phases = list(phases)
        # each phase's items as the skinny kernel would launch them (`skinny` in bench_chain runs these)
        self.configs = [SkinnyConfig(block_n, block_k, split_for(p.weight.shape[0], p.weight.shape[1], self.programs,
                                                                 block_n, block_k)) for p in phases]
        table, counters, partials = [], 0, 0
        for phase, config in zip(phases, self.configs):
            k, n = phase.weight.shape
            tiles = -(-n // block_n)
            table.append([phase.x.data_ptr(), phase.weight.data_ptr(), phase.out.data_ptr(), k, n,
                          phase.x.stride(0), phase.weight.stride(0), phase.out.stride(0), config.split,
                          config.k_piece(k), counters, 0])
            counters += tiles
            if config.split > 1:
                partials = max(partials, config.split * tiles * block_m(self.rows) * block_n)
        self.table = torch.tensor(table, dtype=torch.int64, device=device)
        self.counters = torch.zeros(counters, dtype=torch.int32, device=device)
        self.barrier = torch.zeros(2, dtype=torch.int32, device=device)
        self.fault = torch.zeros(1, dtype=torch.int32, device=device)
        self.partials = torch.empty(max(partials, 1), dtype=torch.float32, device=device)

    def __call__(self) -> None:
        if INTERPRETED:  # one launch a phase: the interpreter cannot pass a barrier (module docstring)
            for index in range(len(self.phases)):
                self._launch(index, index + 1, barrier=False)
        else:
            self._launch(0, len(self.phases), barrier=True)

    def _launch(self, first: int, end: int, barrier: bool) -> None:
        _chain_kernel[(self.programs,)](
            self.table, self.counters, self.barrier, self.partials, self.fault, self.rows, first, end, MAX_SPINS,
            BARRIER=barrier, PREFETCH_ROWS=self.prefetch_rows, FIELDS=FIELDS, BLOCK_M=block_m(self.rows),
            BLOCK_N=self.block_n, BLOCK_K=self.block_k, DOT_FP32=DOT_FP32, num_warps=self.num_warps,
            num_stages=self.num_stages)

    @property
    def faulted(self) -> bool:
        """Whether a barrier's wait gave up (a program never arrived): the outputs are then wrong."""
        return bool(self.fault.item())


def _check_phases(phases: Sequence[ChainPhase], rows: int) -> None:
    if not 1 <= rows <= MAX_ROWS:
        raise ValueError(f"a chain takes 1 to {MAX_ROWS} rows, got {rows}")
    for index, phase in enumerate(phases):
        k, n = phase.weight.shape
        tensors = (phase.x, phase.weight, phase.out)
        if any(t.dtype != torch.bfloat16 or t.stride(-1) != 1 for t in tensors):
            raise ValueError(f"phase {index}: x, weight and out must be bf16 with contiguous columns")
        if phase.x.shape != (rows, k) or phase.out.shape != (rows, n):
            raise ValueError(f"phase {index}: x {tuple(phase.x.shape)} and out {tuple(phase.out.shape)} "
                             f"do not fit weight {tuple(phase.weight.shape)} at {rows} rows")
        # the kernel's divisibility hints (`_phase_fields`): sizes and row strides in multiples of 16
        # elements, tensors starting on 16 bytes
        if any(v % 16 for v in (k, n, *(t.stride(0) for t in tensors), *(t.data_ptr() for t in tensors))):
            raise ValueError(f"phase {index}: K, N and every row stride must be multiples of 16 and every "
                             "tensor 16-byte aligned")


def _sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return 4  # the interpreter: a few programs, so items take turns as they do on a GPU
    return torch.cuda.get_device_properties(device).multi_processor_count
