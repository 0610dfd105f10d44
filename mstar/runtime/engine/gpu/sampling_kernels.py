"""The device sampler's random draws as Triton kernels (`sampler.sample` calls them on a GPU).

- `draw_rows(logits, temperature, seeds, counters)`: `[R, V]` -> `[R]` int64, each row's
  Gumbel-max draw over its whole vocabulary, argmax(logits / temperature + g) with g the row's
  Gumbel noise, -log(-log(u)) of its hashed uniforms u (`sampler.hashed_uniform`: the same
  integers, so the same noise), or argmax(logits) where the row's temperature is below
  `sampling.MIN_TEMPERATURE` (greedy). The sampler's `is_whole` case (no row limits its tokens).
- `nucleus_draw(logits, temperature, top_p, top_k, seeds, counters)`: the same draw over each
  row's nucleus: the tokens whose strictly more probable tokens weigh less than top_p and number
  fewer than top_k (0: no limit), of the whole distribution, as the CPU sampler keeps them; tokens
  tied with the nucleus' least probable are all kept (the torch sampler's sort keeps a prefix of
  them, in its own order). No sort: one program a row finds the least weight inside by a search
  over the weights' fp32 bits, NUCLEUS_WAYS thresholds weighed a pass over the row (about ten
  passes), then draws.

Why: the torch sampler wrote its noise through about twenty elementwise kernels over `[R, V]`
int64 and float64 tensors (splitmix64's mixes, the shifts, the logs): at 64 rows of a 128k
vocabulary each pass moves 64 MB; and a nucleus sorted every row's vocabulary (1.35 ms of the 1.48
ms a step's sampler took at 64 rows on an H100, `mstar bench sampler`). Here the hash is computed
where it is used, in registers.

Both keep torch's tie rule for the draw (the first index of a row's maximum): `draw_rows` is
`kernels.chunked_argmax` around its own first pass. Tests run them under the Triton interpreter on
the CPU against the torch sampler (tests/engine/test_sampling_kernels_interpreted.py).
"""
from __future__ import annotations

from typing import Optional

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
    def _nucleus_draw_kernel(logits_ptr, stride_row, temperature_ptr, top_p_ptr, top_k_ptr, seeds_ptr, counters_ptr,
                             weights_ptr, vocab, out_ptr, min_temperature, ONE_KEY: tl.constexpr,
                             BLOCK: tl.constexpr, WAYS: tl.constexpr):
        """One program a row (`nucleus_draw`): the row's largest scaled logit m, its weights
        e = exp(x - m) into `weights` with their sum, the search for the nucleus' threshold, and the
        Gumbel-max draw over the tokens at or above it."""
        row = tl.program_id(0).to(tl.int64)
        logits_row = logits_ptr + row * stride_row
        weights_row = weights_ptr + row * vocab
        temperature = tl.load(temperature_ptr + row)
        is_sampled = temperature >= min_temperature
        temperature = tl.where(is_sampled, temperature, 1.0)
        top = float("-inf")
        for start in range(0, vocab, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            top = tl.maximum(top, tl.max(tl.load(logits_row + cols, mask=cols < vocab, other=float("-inf")
                                                 ).to(tl.float32), 0))
        top = tl.math.div_rn(top, temperature)  # (rounding is monotone: the largest x)
        total = 0.0
        for start in range(0, vocab, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            x = tl.load(logits_row + cols, mask=cols < vocab, other=float("-inf")).to(tl.float32)
            weight = tl.exp(tl.math.div_rn(x, temperature) - top)
            tl.store(weights_row + cols, weight, mask=cols < vocab)
            total += tl.sum(weight, 0)
        threshold = _nucleus_key(weights_row, vocab, total * tl.load(top_p_ptr + row), tl.load(top_p_ptr + row) < 1.0,
                                 tl.load(top_k_ptr + row), ONE_KEY, BLOCK, WAYS)
        best = float("-inf")
        best_col = row * 0  # (an int64 scalar)
        for start in range(0, vocab, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            x = tl.load(logits_row + cols, mask=cols < vocab, other=float("-inf")).to(tl.float32)
            if is_sampled:
                key = tl.load(weights_row + cols, mask=cols < vocab, other=0.0).to(tl.int32, bitcast=True)
                drawn = tl.math.div_rn(x, temperature) + _noise(seeds_ptr, counters_ptr, row, cols)
                x = tl.where((key >= threshold) & (cols < vocab), drawn, float("-inf"))
            block_best = tl.max(x, 0)
            first = tl.min(tl.where(x == block_best, cols, vocab), 0)  # torch.argmax's tie rule
            best_col = tl.where(block_best > best, first, best_col)
            best = tl.maximum(best, block_best)
        tl.store(out_ptr + row, best_col)

    @triton.jit
    def _nucleus_key(weights_row, vocab, mass_limit, has_p, top_k, ONE_KEY: tl.constexpr, BLOCK: tl.constexpr,
                     WAYS: tl.constexpr):
        """The smallest weight key (its fp32 bits: weights are >= 0, so the bits order as the
        values) whose strictly heavier tokens weigh less than `mass_limit` (where `has_p`) and
        number fewer than top_k (where it is > 0): the tokens at or above it are the row's nucleus.
        A search over the keys from 0 to 1.0's, WAYS + 1 parts a pass over the weights; -1 (every
        token) where the row limits nothing."""
        has_k = top_k > 0
        mass_limit = tl.where(has_p, mass_limit, float("inf"))
        count_limit = tl.where(has_k, top_k, vocab + 1)
        lo = top_k * 0  # (an int64 scalar)
        hi = lo + ONE_KEY  # the top token weighs 1.0: no token is heavier
        if (has_p | has_k) == 0:
            lo -= 2
            hi = lo + 1
        parts = tl.arange(0, WAYS).to(tl.int64) + 1
        while hi - lo > 1:
            candidates = lo + parts * (hi - lo) // (WAYS + 1)
            mass = tl.zeros((WAYS,), dtype=tl.float32)
            count = tl.zeros((WAYS,), dtype=tl.int64)
            for start in range(0, vocab, BLOCK):
                cols = start + tl.arange(0, BLOCK)
                weight = tl.load(weights_row + cols, mask=cols < vocab, other=0.0)
                heavier = weight.to(tl.int32, bitcast=True).to(tl.int64)[:, None] > candidates[None, :]
                mass += tl.sum(tl.where(heavier, weight[:, None], 0.0), 0)
                count += tl.sum(heavier.to(tl.int64), 0)
            is_inside = (mass < mass_limit) & (count < count_limit)
            hi = tl.min(tl.where(is_inside, candidates, hi), 0)
            lo = tl.max(tl.where(is_inside, lo, candidates), 0)
        return hi.to(tl.int32)


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


NUCLEUS_BLOCK = 1024  # columns a pass of `nucleus_draw` reads at a time
NUCLEUS_WAYS = 8  # thresholds a pass of the search weighs: about three bits of the key a pass
ONE_KEY = 0x3F800000  # the fp32 bits of 1.0


def nucleus_draw(logits: torch.Tensor, temperature: torch.Tensor, top_p: torch.Tensor, top_k: Optional[torch.Tensor],
                 seeds: torch.Tensor, counters: torch.Tensor) -> torch.Tensor:
    """`[R, V]` (columns contiguous) -> `[R]` int64: each sampled row's Gumbel-max draw over its
    nucleus (module docstring), greedy rows' argmax; top_k None: no row has one."""
    n, vocab = logits.shape
    out = torch.empty(n, dtype=torch.long, device=logits.device)
    if n == 0:
        return out
    if logits.stride(1) != 1:
        raise ValueError("nucleus_draw: logits must have contiguous columns")
    top_k = torch.zeros(n, dtype=torch.long, device=logits.device) if top_k is None else top_k.long().contiguous()
    weights = torch.empty((n, vocab), dtype=torch.float32, device=logits.device)
    _nucleus_draw_kernel[(n,)](logits, logits.stride(0), temperature.float().contiguous(), top_p.float().contiguous(),
                               top_k, seeds.long().contiguous(), counters.long().contiguous(), weights, vocab, out,
                               MIN_TEMPERATURE, ONE_KEY=ONE_KEY, BLOCK=NUCLEUS_BLOCK, WAYS=NUCLEUS_WAYS, num_warps=8)
    return out
