"""The device sampler's random draws as Triton kernels (`sampler.sample` calls them on a GPU).

- `draw_rows(logits, temperature, seeds, counters)`: `[R, V]` -> `[R]` int64, each row's
  Gumbel-max draw over its whole vocabulary, argmax(logits / temperature + g) with g the row's
  Gumbel noise of `gumbel_noise`, or argmax(logits) where the row's temperature is below
  `sampling.MIN_TEMPERATURE` (greedy). The sampler's `is_whole` case (no row limits its tokens).
- `gumbel_noise(seeds, counters, vocab)`: `[R, V]` float32, -log(-log(u)) of the row's hashed
  uniforms u (`sampler.hashed_uniform`: the same integers, so the same noise), for the sorted case.

Why: the torch sampler wrote its noise through about twenty elementwise kernels over `[R, V]`
int64 and float64 tensors (splitmix64's mixes, the shifts, the logs): at 64 rows of a 128k
vocabulary each pass moves 64 MB. Here the hash is computed where it is used, in registers: the
whole case reads the logits once and writes two small tensors; the sorted case writes the noise
once, in fp32. (A nucleus found without the sort, by a search over the weights' bits in one
program a row, was measured slower on an H100 at every row count: docs/engine.md.)

Both keep torch's tie rule (the first index of a row's maximum): `draw_rows` is
`kernels.chunked_argmax` around its own first pass. Tests run them under the Triton interpreter on
the CPU against the torch sampler (tests/engine/test_sampling_kernels_interpreted.py).
"""
from __future__ import annotations

import torch

from mstar.runtime.engine.gpu.kernels import ARGMAX_CHUNK, chunked_argmax, pdl_launch, triton
from mstar.runtime.engine.sampling import MIN_TEMPERATURE

if triton is not None:
    import triton.language as tl

    from mstar.runtime.engine.gpu.kernels import load_chunk, store_chunk_max

    # splitmix64's constants (sampler.py's, as unsigned 64-bit integers)
    _GOLDEN: tl.constexpr = tl.constexpr(0x9E3779B97F4A7C15)
    _MIX_1: tl.constexpr = tl.constexpr(0xBF58476D1CE4E5B9)
    _MIX_2: tl.constexpr = tl.constexpr(0x94D049BB133111EB)

    @triton.jit
    def _mix(z):
        """splitmix64's finaliser on uint64 (wrapping products, logical shifts: sampler._mix)."""
        z = (z ^ (z >> 30)) * _MIX_1
        z = (z ^ (z >> 27)) * _MIX_2
        return z ^ (z >> 31)

    @triton.jit
    def _noise(seeds_ptr, counters_ptr, row, cols):
        """The row's Gumbel noise at `cols`, fp32: -log(-log(u)) in fp64, u in (0, 1) from the
        hash of (seed, counter, token id) as `sampler.hashed_uniform`."""
        seed = tl.load(seeds_ptr + row).to(tl.uint64, bitcast=True)
        counter = tl.load(counters_ptr + row).to(tl.uint64, bitcast=True)
        row_hash = _mix(seed * _GOLDEN + counter)
        bits = _mix(row_hash + cols.to(tl.uint64) * _GOLDEN) >> 11
        uniform = (bits.to(tl.float64) + 0.5) * 1.1102230246251565e-16  # 2**-53
        return (-tl.log(-tl.log(uniform))).to(tl.float32)

    @triton.jit
    def _chunk_draw_kernel(logits_ptr, stride_row, temperature_ptr, seeds_ptr, counters_ptr, vocab, best_ptr,
                           index_ptr, num_chunks, min_temperature, BLOCK: tl.constexpr, PDL: tl.constexpr):
        row, cols, x = load_chunk(logits_ptr, stride_row, vocab, BLOCK, PDL)
        temperature = tl.load(temperature_ptr + row)
        if temperature >= min_temperature:  # a sampled row; greedy rows take the raw logits' argmax
            # (div_rn: IEEE division, as torch's; the plain one may round otherwise)
            x = tl.math.div_rn(x, temperature) + _noise(seeds_ptr, counters_ptr, row, cols)
        store_chunk_max(best_ptr, index_ptr, num_chunks, row, cols, x, vocab)

    @triton.jit
    def _noise_kernel(seeds_ptr, counters_ptr, out_ptr, vocab, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        tl.store(out_ptr + row * vocab + cols, _noise(seeds_ptr, counters_ptr, row, cols), mask=cols < vocab)


def draw_rows(logits: torch.Tensor, temperature: torch.Tensor, seeds: torch.Tensor,
              counters: torch.Tensor) -> torch.Tensor:
    """`[R, V]` (columns contiguous) -> `[R]` int64 (module docstring); temperature `[R]` fp32,
    seeds and counters `[R]` int64."""
    temperature = temperature.float().contiguous()
    seeds, counters = seeds.long().contiguous(), counters.long().contiguous()

    def first_pass(grid: tuple[int, int], best: torch.Tensor, index: torch.Tensor) -> None:
        _chunk_draw_kernel[grid](logits, logits.stride(0), temperature, seeds, counters, logits.shape[1], best, index,
                                 grid[1], MIN_TEMPERATURE, BLOCK=ARGMAX_CHUNK, num_warps=8, **pdl_launch(logits))

    return chunked_argmax(logits, first_pass)


NOISE_BLOCK = 2048


def gumbel_noise(seeds: torch.Tensor, counters: torch.Tensor, vocab: int) -> torch.Tensor:
    """`[R, vocab]` fp32 Gumbel noise of each row (module docstring)."""
    n = seeds.shape[0]
    out = torch.empty((n, vocab), dtype=torch.float32, device=seeds.device)
    if n == 0:
        return out
    _noise_kernel[(n, triton.cdiv(vocab, NOISE_BLOCK))](seeds.long().contiguous(), counters.long().contiguous(), out,
                                                        vocab, BLOCK=NOISE_BLOCK, num_warps=8)
    return out
