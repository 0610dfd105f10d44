"""The device sampler's random draws as Triton kernels (`sampler.sample` calls them on a GPU).

- `draw_rows(logits, temperature, seeds, counters)`: `[R, V]` -> `[R]` int64, each row's
  Gumbel-max draw over its whole vocabulary, argmax(logits / temperature + g) with g the row's
  Gumbel noise, -log(-log(u)) of its hashed uniforms u (`sampler.hashed_uniform`: the same
  integers, so the same noise), or argmax(logits) where the row's temperature is below
  `sampling.MIN_TEMPERATURE` (greedy). The sampler's `is_whole` case (no row limits its tokens).
- `gumbel_noise(seeds, counters, vocab)`: `[R, V]` fp32, that noise, for a nucleus that torch's
  sort finds (`mstar run --nucleus sort`; the search below is the default, `sampler.NUCLEUS`).
- `nucleus_draw(logits, temperature, top_p, top_k, seeds, counters)`: the same draw over each
  row's nucleus: its top k (the tokens whose strictly more probable tokens number fewer than top_k;
  0: no limit) and, of those, the tokens whose strictly more probable tokens weigh less than top_p
  of the top k's mass (top_k first, then top_p over its renormalised distribution, as the CPU
  sampler keeps them); tokens tied with the nucleus' least probable are all kept (the torch
  sampler's sort keeps a prefix of them, in its own order).

The nucleus without a sort: every row is cut in chunks of ARGMAX_CHUNK columns, a program each.
The chunks' largest logits give each row m, its largest scaled logit; each chunk writes its
weights exp(x - m) (the top token's is 1.0) and their sum. Non-negative floats order as their
bits, so the least weight inside the nucleus is found by a search over the keys from 0 to 1.0's:
each pass weighs NUCLEUS_WAYS candidate keys (every chunk sums the mass and counts the tokens
strictly heavier than each), and the next pass's programs read those partials and narrow the
row's (lo, hi) alike, about four bits a pass, NUCLEUS_PASSES launches in all; the draw then keeps
the tokens at or above hi. Where a row has a top_k, a first search on the count alone finds its top
k, a kernel sums their weights a chunk, and the top_p search runs against that mass instead of the
row's total: twice the passes, in steps where some row has both only. (A first version searched in
one program a row: 1.85-1.95 ms a call on an H100 at any row count, each pass bound by the latency
of its block reads; docs/engine.md.)

Why: the torch sampler wrote its noise through about twenty elementwise kernels over `[R, V]`
int64 and float64 tensors (splitmix64's mixes, the shifts, the logs): at 64 rows of a 128k
vocabulary each pass moves 64 MB; and a nucleus sorted every row's vocabulary (1.35 ms of the 1.48
ms a step's sampler took at 64 rows on an H100, `mstar bench sampler`). Here the hash is computed
where it is used, in registers.

Both draws keep torch's tie rule (the first index of a row's maximum): `kernels.chunked_argmax`
around their own first pass. Tests run them under the Triton interpreter on the CPU against the
torch sampler (tests/engine/test_sampling_kernels_interpreted.py).
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
    def _chunk_top_kernel(logits_ptr, stride_row, vocab, maxima_ptr, num_chunks, BLOCK: tl.constexpr):
        row, cols, x = load_chunk(logits_ptr, stride_row, vocab, BLOCK, False)
        tl.store(maxima_ptr + row * num_chunks + tl.program_id(1), tl.max(x, 0))

    @triton.jit
    def _row_scale(temperature_ptr, maxima_ptr, row, num_chunks, min_temperature, CHUNKS: tl.constexpr):
        """(is_sampled, the divisor, m) of a row: m its largest scaled logit (rounding is monotone:
        the largest logit's quotient)."""
        temperature = tl.load(temperature_ptr + row)
        is_sampled = temperature >= min_temperature
        temperature = tl.where(is_sampled, temperature, 1.0)
        chunks = tl.arange(0, CHUNKS)
        top = tl.max(tl.load(maxima_ptr + row * num_chunks + chunks, mask=chunks < num_chunks,
                             other=float("-inf")), 0)
        return is_sampled, temperature, tl.math.div_rn(top, temperature)

    @triton.jit
    def _candidates(lo, hi, WAYS: tl.constexpr):
        """WAYS keys splitting (lo, hi) into WAYS + 1 parts."""
        return lo + (tl.arange(0, WAYS).to(tl.int64) + 1) * (hi - lo) // (WAYS + 1)

    @triton.jit
    def _weigh(weights_ptr, mass_ptr, count_ptr, row, vocab, num_chunks, candidates, BLOCK: tl.constexpr,
               SUB: tl.constexpr, WAYS: tl.constexpr):
        """The mass and the count of the chunk's weights strictly heavier than each candidate key,
        into the partials at (row, chunk)."""
        chunk = tl.program_id(1)
        mass = tl.zeros((WAYS,), dtype=tl.float32)
        count = tl.zeros((WAYS,), dtype=tl.int32)
        for start in range(0, BLOCK, SUB):
            cols = chunk * BLOCK + start + tl.arange(0, SUB)
            weight = tl.load(weights_ptr + row * vocab + cols, mask=cols < vocab, other=0.0)
            heavier = weight.to(tl.int32, bitcast=True).to(tl.int64)[:, None] > candidates[None, :]
            mass += tl.sum(tl.where(heavier, weight[:, None], 0.0), 0)
            count += tl.sum(heavier.to(tl.int32), 0)
        place = (row * num_chunks + chunk) * WAYS + tl.arange(0, WAYS)
        tl.store(mass_ptr + place, mass)
        tl.store(count_ptr + place, count)

    @triton.jit
    def _narrowed(state_ptr, mass_ptr, count_ptr, totals_ptr, top_p_ptr, top_k_ptr, row, num_chunks,
                  CHUNKS: tl.constexpr, WAYS: tl.constexpr):
        """The row's (lo, hi) after the pass that weighed the candidates of its (lo, hi) in the
        state: the keys inside the nucleus are those whose strictly heavier tokens weigh less than
        top_p of the row's total and number fewer than top_k; lo stays outside, hi inside."""
        lo = tl.load(state_ptr + row * 2)
        hi = tl.load(state_ptr + row * 2 + 1)
        candidates = _candidates(lo, hi, WAYS)
        chunks = tl.arange(0, CHUNKS)
        place = (row * num_chunks + chunks[:, None]) * WAYS + tl.arange(0, WAYS)[None, :]
        is_chunk = chunks[:, None] < num_chunks
        mass = tl.sum(tl.load(mass_ptr + place, mask=is_chunk, other=0.0), 0)
        count = tl.sum(tl.load(count_ptr + place, mask=is_chunk, other=0), 0)
        total = tl.sum(tl.load(totals_ptr + row * num_chunks + chunks, mask=chunks < num_chunks, other=0.0), 0)
        top_p = tl.load(top_p_ptr + row)
        top_k = tl.load(top_k_ptr + row)
        mass_limit = tl.where(top_p < 1.0, top_p * total, float("inf"))  # (a top_p of 1 limits nothing)
        count_limit = tl.where(top_k > 0, top_k, 1 << 40)  # (nor a top_k of 0)
        is_inside = (mass < mass_limit) & (count < count_limit)
        return tl.max(tl.where(is_inside, lo, candidates), 0), tl.min(tl.where(is_inside, candidates, hi), 0)

    @triton.jit
    def _weights_kernel(logits_ptr, stride_row, temperature_ptr, maxima_ptr, weights_ptr, totals_ptr, state_ptr,
                        mass_ptr, count_ptr, vocab, num_chunks, min_temperature, ONE_KEY: tl.constexpr,
                        BLOCK: tl.constexpr, SUB: tl.constexpr, CHUNKS: tl.constexpr, WAYS: tl.constexpr):
        """The chunk's weights exp(x - m) and their sum, then the search's first pass."""
        row = tl.program_id(0).to(tl.int64)
        chunk = tl.program_id(1)
        _, temperature, top = _row_scale(temperature_ptr, maxima_ptr, row, num_chunks, min_temperature, CHUNKS)
        total = 0.0
        for start in range(0, BLOCK, SUB):
            cols = chunk * BLOCK + start + tl.arange(0, SUB)
            x = tl.load(logits_ptr + row * stride_row + cols, mask=cols < vocab, other=float("-inf")).to(tl.float32)
            weight = tl.exp(tl.math.div_rn(x, temperature) - top)
            tl.store(weights_ptr + row * vocab + cols, weight, mask=cols < vocab)
            total += tl.sum(weight, 0)
        tl.store(totals_ptr + row * num_chunks + chunk, total)
        lo = row * 0  # (an int64 scalar) the search starts at (0, the top token's weight 1.0)
        if chunk == 0:
            tl.store(state_ptr + row * 2, lo)
            tl.store(state_ptr + row * 2 + 1, lo + ONE_KEY)
        tl.debug_barrier()  # (this program's own weights, read back below)
        _weigh(weights_ptr, mass_ptr, count_ptr, row, vocab, num_chunks, _candidates(lo, lo + ONE_KEY, WAYS),
               BLOCK, SUB, WAYS)

    @triton.jit
    def _first_weigh_kernel(weights_ptr, state_ptr, mass_ptr, count_ptr, vocab, num_chunks, ONE_KEY: tl.constexpr,
                            BLOCK: tl.constexpr, SUB: tl.constexpr, WAYS: tl.constexpr):
        """A search's first pass over weights written already (`_weights_kernel`'s, without them):
        the second search of a row with a top_k."""
        row = tl.program_id(0).to(tl.int64)
        lo = row * 0
        if tl.program_id(1) == 0:
            tl.store(state_ptr + row * 2, lo)
            tl.store(state_ptr + row * 2 + 1, lo + ONE_KEY)
        _weigh(weights_ptr, mass_ptr, count_ptr, row, vocab, num_chunks, _candidates(lo, lo + ONE_KEY, WAYS),
               BLOCK, SUB, WAYS)

    @triton.jit
    def _top_k_mass_kernel(weights_ptr, totals_ptr, ones_ptr, top_k_ptr, state_ptr, mass_ptr, count_ptr, vocab,
                           num_chunks, top_k_mass_ptr, BLOCK: tl.constexpr, SUB: tl.constexpr,
                           CHUNKS: tl.constexpr, WAYS: tl.constexpr):
        """The chunk's mass of its row's top k (the tokens at or above the count-only search's last
        hi; every token where the row has no top_k), into the partials the second search reads as
        the row's total."""
        row = tl.program_id(0).to(tl.int64)
        chunk = tl.program_id(1)
        unused_lo, threshold = _narrowed(state_ptr, mass_ptr, count_ptr, totals_ptr, ones_ptr, top_k_ptr, row,
                                         num_chunks, CHUNKS, WAYS)
        threshold = tl.where(tl.load(top_k_ptr + row) > 0, threshold, -1)
        total = 0.0
        for start in range(0, BLOCK, SUB):
            cols = chunk * BLOCK + start + tl.arange(0, SUB)
            weight = tl.load(weights_ptr + row * vocab + cols, mask=cols < vocab, other=0.0)
            total += tl.sum(tl.where(weight.to(tl.int32, bitcast=True) >= threshold, weight, 0.0), 0)
        tl.store(top_k_mass_ptr + row * num_chunks + chunk, total)

    @triton.jit
    def _search_kernel(weights_ptr, totals_ptr, top_p_ptr, top_k_ptr, state_ptr, mass_ptr, count_ptr, vocab,
                       num_chunks, num_rows, BLOCK: tl.constexpr, SUB: tl.constexpr, CHUNKS: tl.constexpr,
                       WAYS: tl.constexpr):
        """A pass of the search: narrow (lo, hi) by the last pass's partials (each program of a row
        alike; the first writes the state this pass weighs), then weigh its candidates."""
        row = tl.program_id(0).to(tl.int64)
        lo, hi = _narrowed(state_ptr, mass_ptr, count_ptr, totals_ptr, top_p_ptr, top_k_ptr, row, num_chunks,
                           CHUNKS, WAYS)
        if tl.program_id(1) == 0:
            tl.store(state_ptr + (num_rows + row) * 2, lo)
            tl.store(state_ptr + (num_rows + row) * 2 + 1, hi)
        _weigh(weights_ptr, mass_ptr + num_rows * num_chunks * WAYS, count_ptr + num_rows * num_chunks * WAYS, row,
               vocab, num_chunks, _candidates(lo, hi, WAYS), BLOCK, SUB, WAYS)

    @triton.jit
    def _chunk_nucleus_draw_kernel(logits_ptr, stride_row, temperature_ptr, seeds_ptr, counters_ptr, maxima_ptr,
                                   weights_ptr, totals_ptr, top_p_ptr, top_k_ptr, state_ptr, mass_ptr, count_ptr,
                                   vocab, best_ptr, index_ptr, num_chunks, min_temperature, BLOCK: tl.constexpr,
                                   CHUNKS: tl.constexpr, WAYS: tl.constexpr):
        """The chunk's draw over the tokens at or above the search's last hi (every token where the
        row limits nothing), its maximum for `kernels.chunked_argmax`."""
        row, cols, x = load_chunk(logits_ptr, stride_row, vocab, BLOCK, False)
        # (distinct names for the values left unused: the compiler types a name once per scope)
        is_sampled, temperature, unused_top = _row_scale(temperature_ptr, maxima_ptr, row, num_chunks,
                                                         min_temperature, CHUNKS)
        if is_sampled:
            unused_lo, threshold = _narrowed(state_ptr, mass_ptr, count_ptr, totals_ptr, top_p_ptr, top_k_ptr, row,
                                     num_chunks, CHUNKS, WAYS)
            # every token where the row limits nothing (its search kept the weights above 0 alone)
            is_limited = tl.maximum((tl.load(top_p_ptr + row) < 1.0).to(tl.int32),
                                    (tl.load(top_k_ptr + row) > 0).to(tl.int32))
            threshold = tl.where(is_limited > 0, threshold, -1)
            key = tl.load(weights_ptr + row * vocab + cols, mask=cols < vocab, other=0.0).to(tl.int32, bitcast=True)
            drawn = tl.math.div_rn(x, temperature) + _noise(seeds_ptr, counters_ptr, row, cols)
            x = tl.where((key >= threshold) & (cols < vocab), drawn, float("-inf"))
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


NUCLEUS_WAYS = 16  # candidate keys a pass of the search weighs: about four bits of the key a pass
NUCLEUS_SUB = 512  # columns of a chunk weighed at a time (the [SUB, WAYS] comparison in registers)
ONE_KEY = 0x3F800000  # the fp32 bits of 1.0, the top token's weight


def _search_passes(ways: int) -> int:
    """Passes that take (0, ONE_KEY) to adjacent keys: each leaves at most ceil(width / (ways + 1))."""
    width, passes = ONE_KEY, 0
    while width > 1:
        width, passes = -(-width // (ways + 1)), passes + 1
    return passes


NUCLEUS_PASSES = _search_passes(NUCLEUS_WAYS)


def nucleus_draw(logits: torch.Tensor, temperature: torch.Tensor, top_p: torch.Tensor, top_k: Optional[torch.Tensor],
                 seeds: torch.Tensor, counters: torch.Tensor, has_both: Optional[bool] = None) -> torch.Tensor:
    """`[R, V]` (columns contiguous) -> `[R]` int64: each sampled row's Gumbel-max draw over its
    nucleus (module docstring), greedy rows' argmax; top_k None: no row has one. has_both: whether
    some row has a top_k and a top_p below 1, which the caller knows on the host (False skips the
    count-only search; None: whenever a top_k is given)."""
    n, vocab = logits.shape
    if n == 0 or logits.stride(1) != 1:
        return chunked_argmax(logits, lambda grid, best, index: None)  # (its own answer or refusal)
    device, num_chunks = logits.device, triton.cdiv(vocab, ARGMAX_CHUNK)
    temperature, top_p = temperature.float().contiguous(), top_p.float().contiguous()
    has_top_k = top_k is not None and has_both is not False
    top_k = torch.zeros(n, dtype=torch.long, device=device) if top_k is None else top_k.long().contiguous()
    seeds, counters = seeds.long().contiguous(), counters.long().contiguous()
    maxima, totals = (torch.empty((n, num_chunks), dtype=torch.float32, device=device) for _ in range(2))
    weights = torch.empty((n, vocab), dtype=torch.float32, device=device)
    # per pass: the rows' (lo, hi) it weighed and its partials (mass, count) a (row, chunk, candidate)
    state = torch.empty((NUCLEUS_PASSES, n, 2), dtype=torch.long, device=device)
    mass = torch.empty((NUCLEUS_PASSES, n, num_chunks, NUCLEUS_WAYS), dtype=torch.float32, device=device)
    count = torch.empty((NUCLEUS_PASSES, n, num_chunks, NUCLEUS_WAYS), dtype=torch.int32, device=device)
    grid, chunks = (n, num_chunks), triton.next_power_of_2(num_chunks)
    sizes = dict(CHUNKS=chunks, WAYS=NUCLEUS_WAYS)
    _chunk_top_kernel[grid](logits, logits.stride(0), vocab, maxima, num_chunks, BLOCK=ARGMAX_CHUNK, num_warps=8)
    _weights_kernel[grid](logits, logits.stride(0), temperature, maxima, weights, totals, state, mass, count, vocab,
                          num_chunks, MIN_TEMPERATURE, ONE_KEY=ONE_KEY, BLOCK=ARGMAX_CHUNK, SUB=NUCLEUS_SUB, **sizes,
                          num_warps=8)
    last = NUCLEUS_PASSES - 1
    if has_top_k:
        # top_k first: a search on the count alone finds each row's top k, whose mass then stands
        # for the row's total in the top_p search (top_p over the top k's renormalised distribution)
        ones = torch.ones_like(top_p)
        _search_passes_over(weights, totals, ones, top_k, state, mass, count, vocab, num_chunks, n, grid, sizes)
        top_k_mass = torch.empty_like(totals)
        _top_k_mass_kernel[grid](weights, totals, ones, top_k, state[last], mass[last], count[last], vocab, num_chunks,
                                 top_k_mass, BLOCK=ARGMAX_CHUNK, SUB=NUCLEUS_SUB, **sizes, num_warps=8)
        totals = top_k_mass
        _first_weigh_kernel[grid](weights, state[0], mass[0], count[0], vocab, num_chunks, ONE_KEY=ONE_KEY,
                                  BLOCK=ARGMAX_CHUNK, SUB=NUCLEUS_SUB, WAYS=NUCLEUS_WAYS, num_warps=8)
    _search_passes_over(weights, totals, top_p, top_k, state, mass, count, vocab, num_chunks, n, grid, sizes)

    def first_pass(grid: tuple[int, int], best: torch.Tensor, index: torch.Tensor) -> None:
        _chunk_nucleus_draw_kernel[grid](logits, logits.stride(0), temperature, seeds, counters, maxima, weights,
                                         totals, top_p, top_k, state[last], mass[last], count[last], vocab, best,
                                         index, num_chunks, MIN_TEMPERATURE, BLOCK=ARGMAX_CHUNK, **sizes, num_warps=8)

    return chunked_argmax(logits, first_pass)


def _search_passes_over(weights: torch.Tensor, totals: torch.Tensor, top_p: torch.Tensor, top_k: torch.Tensor,
                        state: torch.Tensor, mass: torch.Tensor, count: torch.Tensor, vocab: int, num_chunks: int,
                        n: int, grid: tuple[int, int], sizes: dict) -> None:
    """The search's passes after its first (whose partials are `state[0]`, `mass[0]`, `count[0]`),
    each narrowing by the last one's partials against top_p of `totals`' sums and top_k."""
    for p in range(1, NUCLEUS_PASSES):
        _search_kernel[grid](weights, totals, top_p, top_k, state[p - 1], mass[p - 1], count[p - 1], vocab, num_chunks,
                             n, BLOCK=ARGMAX_CHUNK, SUB=NUCLEUS_SUB, **sizes, num_warps=8)


NOISE_BLOCK = 2048


def gumbel_noise(seeds: torch.Tensor, counters: torch.Tensor, vocab: int) -> torch.Tensor:
    """`[R, vocab]` fp32 Gumbel noise of each row (`draw_rows`' noise), for a nucleus that torch's
    sort finds (`sampler.NUCLEUS`)."""
    n = seeds.shape[0]
    out = torch.empty((n, vocab), dtype=torch.float32, device=seeds.device)
    if n == 0:
        return out
    _noise_kernel[(n, triton.cdiv(vocab, NOISE_BLOCK))](seeds.long().contiguous(), counters.long().contiguous(), out,
                                                        vocab, BLOCK=NOISE_BLOCK, num_warps=8)
    return out
