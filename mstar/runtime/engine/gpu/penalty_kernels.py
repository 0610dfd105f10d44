"""A step's penalties in two Triton launches (`penalties.penalise` calls them on a GPU).

- `update_table(counts, seen, pairs, num_counted, num_seen)`: the host's new (slot, token) pairs
  into a `PenaltyTable`'s rows: each counted pair adds one to its count (atomically: a row may
  count a token twice in one update), each seen pair sets its mask.
- `penalise_rows(logits, out, counts, seen, index, factors, loop_tokens)`: each penalised row's
  logits through HF's repetition rule and OpenAI's presence and frequency rule
  (`sampling.repetition_rule`, `sampling.output_rule`) from its table row, the token a step
  launched ahead has not given the host yet counted from the device token table, written to `out`.

Why: the same rules in torch ops took about 43 launches and 11 copies a step, 1.3-1.4 ms of an
H100 host's time at any row count (the device's share 0.09-0.5 ms; `mstar bench sampler`,
docs/engine.md "Penalties from a device table"), which a step launched ahead could not hide: a
penalised workload's inter-token p50 was 3.6 ms against 1.45 plain. Here the host moves two
arrays and launches two kernels.

The float operations are torch's, one rounding each (the division rounded to nearest, no fused
multiply-add: `enable_fp_fusion=False`), so the rows are torch's bit for bit
(tests/engine/test_penalty_kernels_interpreted.py under the interpreter; tests/gpu on a GPU).
"""
from __future__ import annotations

import torch

from mstar.runtime.engine.gpu.kernels import triton

UPDATE_BLOCK = 1024  # pairs a program of the table's update
PENALISE_BLOCK = 4096  # columns a program of a penalised row
# torch's roundings: no multiply fused into the subtraction after it (the compiler's default fuses)
PENALISE_OPTIONS = {"enable_fp_fusion": False}

if triton is not None:
    import triton.language as tl

    @triton.jit
    def _update_kernel(counts_ptr, seen_ptr, pairs_ptr, num_counted, num_seen, vocab, BLOCK: tl.constexpr):
        """pairs: int64 counted slots, counted tokens, seen slots, seen tokens (tokens in [0, vocab))."""
        i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        is_counted = i < num_counted
        slot = tl.load(pairs_ptr + i, mask=is_counted, other=0)
        token = tl.load(pairs_ptr + num_counted + i, mask=is_counted, other=0)
        tl.atomic_add(counts_ptr + slot * vocab + token, tl.full((BLOCK,), 1, tl.int32), mask=is_counted)
        is_seen = i < num_seen
        base = 2 * num_counted
        slot = tl.load(pairs_ptr + base + i, mask=is_seen, other=0)
        token = tl.load(pairs_ptr + base + num_seen + i, mask=is_seen, other=0)
        tl.store(seen_ptr + slot * vocab + token, tl.full((BLOCK,), 1, tl.uint8), mask=is_seen)

    @triton.jit
    def _penalise_kernel(logits_ptr, stride_row, out_ptr, stride_out, counts_ptr, seen_ptr, index_ptr, factors_ptr,
                         loop_ptr, num_rows, vocab, BLOCK: tl.constexpr):
        """index: int64 the rows' places, table slots and token table slots (-1: none pending);
        factors: float32 their repetition, presence and frequency penalties."""
        row = tl.program_id(0)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        is_col = cols < vocab
        place = tl.load(index_ptr + row)
        slot = tl.load(index_ptr + num_rows + row)
        late_slot = tl.load(index_ptr + 2 * num_rows + row)
        x = tl.load(logits_ptr + place * stride_row + cols, mask=is_col, other=0.0).to(tl.float32)
        count = tl.load(counts_ptr + slot * vocab + cols, mask=is_col, other=0)
        late = tl.load(loop_ptr + tl.maximum(late_slot, 0)).to(tl.int64) % vocab
        count += ((cols == late) & (late_slot >= 0)).to(tl.int32)
        is_seen = (tl.load(seen_ptr + slot * vocab + cols, mask=is_col, other=0) != 0) | (count > 0)
        repetition = tl.load(factors_ptr + row)
        presence = tl.load(factors_ptr + num_rows + row)
        frequency = tl.load(factors_ptr + 2 * num_rows + row)
        x = tl.where(is_seen, tl.where(x > 0, tl.math.div_rn(x, repetition), x * repetition), x)
        counted = count.to(tl.float32)
        x = (x - frequency * counted) - presence * (count > 0).to(tl.float32)
        tl.store(out_ptr + place * stride_out + cols, x, mask=is_col)


def update_table(counts: torch.Tensor, seen: torch.Tensor, pairs: torch.Tensor, num_counted: int,
                 num_seen: int) -> None:
    """Module docstring; counts int32 and seen uint8 `[capacity, V]`, pairs int64 on their device."""
    largest = max(num_counted, num_seen)
    if largest:
        grid = (triton.cdiv(largest, UPDATE_BLOCK),)
        _update_kernel[grid](counts, seen, pairs, num_counted, num_seen, counts.shape[1], BLOCK=UPDATE_BLOCK)


def penalise_rows(logits: torch.Tensor, out: torch.Tensor, counts: torch.Tensor, seen: torch.Tensor,
                  index: torch.Tensor, factors: torch.Tensor, loop_tokens: torch.Tensor) -> None:
    """Module docstring; logits `[R, V]` (any float dtype, rows strided), out `[R, V]` float32;
    index int64 `[3P]`, factors float32 `[3P]`; loop_tokens the device token table (int32)."""
    num_rows, vocab = index.shape[0] // 3, logits.shape[1]
    if num_rows:
        grid = (num_rows, triton.cdiv(vocab, PENALISE_BLOCK))
        _penalise_kernel[grid](logits, logits.stride(0), out, out.stride(0), counts, seen, index, factors,
                               loop_tokens, num_rows, vocab, BLOCK=PENALISE_BLOCK, **PENALISE_OPTIONS)
