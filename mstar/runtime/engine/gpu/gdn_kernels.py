"""Triton kernels of the gated delta-net layers: the causal conv over an eager step's rows, an
eager step's decode rows' gated delta rule, and a decode-only step's whole layer between its
projections, each updating the rows' recurrent slots in place or, given `write_slots`, into other rows
of the state tensors (a slot's second copy: `LinearStates.step_slots`, whose flip of the slots'
current copies `step_slots` here does in one launch).

`causal_conv` and `conv_store` (eager steps):

In: `conv_state` `[S, C, K-1]` fp32 (the slots' stored columns) and `read` `[R]` (each row's slot),
so the rows' stored columns are R*(K-1) columns, row r's K-1 first; `mixed` `[T, C]` (the step's
[q|k|v] projections, any row stride); `index` `[T, K]` int64 (tap i of token t reads column
`index[t, i]` of [stored | mixed]: `gdn_forward.linear_layout`), the conv weight `[C, K]`.
`causal_conv` out: silu(sum_i weight[:, i] * column(index[t, i])) `[T, C]` in `mixed`'s dtype,
summed in fp32. `conv_store` (after it, in stream order) writes each row's new stored columns,
columns `state_index[r]` `[R, K-1]` of the same [stored | mixed], into its `write` slot (its own slot
with one copy a slot: every column read before any is written).

Why: in torch ops the same conv gathers a `[T, K, C]` fp32 window tensor (1.6 GB for a 16 x 1024
prefill at Qwen3.5's 6144 channels) and reads it twice more per layer; here each token reads its K
columns once (neighbouring tokens share them in cache) and writes its output once. Reading the
stored columns through the slots, and storing them with one kernel, spares the gathered copy of the
rows' windows and the eleven torch launches of the store (an eager step waits on its launches).

`decode_step` (a decode-only step, what the decode graphs capture): everything of a gated delta-net
layer between its two matrix products in one launch. A program takes one row, one q/k head (and the
value heads it serves) and one part of their value columns (32 of d_v): it reads the row's [q|k|v],
z, b and a where the in-projection wrote them, runs the causal conv of q, k and its value columns
over the slot's K-1 stored columns and the token, the gates (g = -exp(A_log) softplus(a + dt_bias)
in fp32, beta = sigmoid(b)), the gated delta rule from and back into its columns of the slot's
state, and writes the un-normed output and its sum of squares. The last part of a (row, q/k head)
to finish (an arrival counter per row and head, atomically counted, reset by that part) moves the
q/k stored columns one on and applies the gated RMSNorm (norm(o) w silu(z)) over each value head's
whole d_v; it writes the `[R, HV*d_v]` input of out_proj. Why one kernel: as separate kernels and
torch ops the same layer launched about 25 kernels in a decode step; in a CUDA graph each costs a
few microseconds however small, which was most of a decode step (1 row: 2.2 ms against a 0.38 ms
floor on the H200). Why parts: a program per (row, head) leaves a 1-row step 16 programs at Qwen3.5's
heads; parts of 32 columns give 64, and the layer took 4.6 against 7.1 us (docs/engine.md). Why the
last part moves the q/k columns: every part reads them, so none may move them until all have; a
value column's conv and its stored columns belong to exactly one part. The rounding is the torch
arithmetic's (`gdn_forward.py`): the conv output, beta and the rule's output in the activations'
dtype, the norm's steps as torch rounds them.

`recurrent_step` (an eager step's decode rows): the rule alone, reading and writing each row's slot
in place. Why: gathering the rows' states into a batch, running the rule on the copy and scattering
it back moves each 1 MiB state (Qwen3.5: 16 heads x 128 x 128 fp32 a layer) four times instead of
twice; at 64 rows the gather and scatter took 1.8 ms of a 5.8 ms step on the H200.

Rows sharing a slot (padding rows on slot 0, the sink) race only on the sink, whose content nobody
reads. The rule is fla's fused recurrent one (q and k L2-normalised in the kernel, q scaled by
d_k^-1/2): state *= exp(g); v' = beta (v - k.state); state += k v'^T; out = q.state.

`eager_gates` and `eager_gated_norm` (an eager step's rows): the decode kernel's gates and gated
norm, one launch each, where they were nine and twelve torch launches a layer (an eager hybrid step
waits on its host's launches: docs/engine.md).

`available(device)` as `kernels.py`: a CUDA device with Triton; tests run the kernel under the
Triton interpreter on the CPU (`tests/engine/test_gpu_kernels_interpreted.py`).
"""
from __future__ import annotations

from typing import Optional

import torch

from mstar.runtime.engine.gpu.kernels import RowNorm, pdl_launch, row_norm_args

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU installs without Triton keep the torch ops
    triton = None


def available(device: torch.device) -> bool:
    return triton is not None and device.type == "cuda"


if triton is not None:
    from mstar.runtime.engine.gpu.kernels import arrivals_before, rms_row_scale

    @triton.jit
    def _column(conv_ptr, read_ptr, mixed_ptr, column, cols, mask, stride_mixed, num_stored, channels,
                K1: tl.constexpr):
        """Column `column` of [the rows' stored columns | the step's tokens] at channels `cols`, fp32:
        stored column j is tap j % K1 of row j // K1's slot (`read_ptr`) in the conv windows
        `[S, C, K1]`; token t is row t of `mixed`. `column` broadcasts against `cols`; masked lanes
        and the part not taken load nothing."""
        is_stored = column < num_stored
        from_mixed = tl.load(mixed_ptr + (column - num_stored) * stride_mixed + cols,
                             mask=mask & (column >= num_stored), other=0.0).to(tl.float32)
        if K1 == 0:  # a conv of width 1 stores nothing
            return from_mixed
        row = tl.where(is_stored, column // K1, 0)
        slot = tl.load(read_ptr + row, mask=mask & is_stored, other=0).to(tl.int64)
        from_stored = tl.load(conv_ptr + (slot * channels + cols) * K1 + column % K1, mask=mask & is_stored,
                              other=0.0)
        return tl.where(is_stored, from_stored, from_mixed)

    @triton.jit
    def _causal_conv_kernel(conv_ptr, read_ptr, mixed_ptr, index_ptr, weight_ptr, out_ptr, stride_mixed,
                            num_stored, channels, K: tl.constexpr, BLOCK: tl.constexpr):
        token = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < channels
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        for tap in tl.static_range(K):
            # The tap's column as a vector (masks are vectors): a stored column or a token of the step.
            column = tl.zeros([BLOCK], dtype=tl.int64) + tl.load(index_ptr + token * K + tap).to(tl.int64)
            x = _column(conv_ptr, read_ptr, mixed_ptr, column, cols, mask, stride_mixed, num_stored, channels, K - 1)
            weight = tl.load(weight_ptr + cols * K + tap, mask=mask, other=0.0).to(tl.float32)
            acc += x * weight
        out = acc * tl.sigmoid(acc)
        tl.store(out_ptr + token * channels + cols, out.to(out_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _conv_store_kernel(conv_ptr, read_ptr, write_ptr, mixed_ptr, state_index_ptr, stride_mixed, num_stored,
                           channels, K1: tl.constexpr, KP: tl.constexpr, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        taps = tl.arange(0, KP)
        is_tap = taps < K1
        column = tl.load(state_index_ptr + row * K1 + taps, mask=is_tap, other=0).to(tl.int64)
        mask = (cols < channels)[:, None] & is_tap[None, :]
        values = _column(conv_ptr, read_ptr, mixed_ptr, column[None, :], cols[:, None], mask, stride_mixed,
                         num_stored, channels, K1)
        # Written in place when the row has one copy of its slot: every column read (above) before any
        # is written, across the program's threads (one channel may sit in several: `_conv_shift`).
        tl.debug_barrier()
        write_slot = tl.load(write_ptr + row).to(tl.int64)
        tl.store(conv_ptr + (write_slot * channels + cols[:, None]) * K1 + taps[None, :], values, mask=mask)


if triton is not None:
    @triton.jit
    def _recurrent_step_kernel(q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, state_ptr, slots_ptr, write_slots_ptr, out_ptr,
                               tokens_ptr, stride_q, stride_k, stride_v, scale, H: tl.constexpr, HV: tl.constexpr,
                               K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                               GATHER: tl.constexpr):
        block_v = tl.program_id(0)
        row_head = tl.program_id(1).to(tl.int64)
        row, head_v = row_head // HV, row_head % HV
        # the row's token among the step's (GATHER) or the row itself: its q, k, v, gates and output
        if GATHER:
            token = tl.load(tokens_ptr + row).to(tl.int64)
        else:
            token = row
        head = head_v // (HV // H)  # q/k head of this value head (fla's grouping)
        o_k = tl.arange(0, BK)
        o_v = block_v * BV + tl.arange(0, BV)
        mask_k, mask_v = o_k < K, o_v < V
        q = tl.load(q_ptr + token * stride_q + head * K + o_k, mask=mask_k, other=0.0).to(tl.float32)
        k = tl.load(k_ptr + token * stride_k + head * K + o_k, mask=mask_k, other=0.0).to(tl.float32)
        v = tl.load(v_ptr + token * stride_v + head_v * V + o_v, mask=mask_v, other=0.0).to(tl.float32)
        q = q / tl.sqrt(tl.sum(q * q) + 1e-6) * scale
        k = k / tl.sqrt(tl.sum(k * k) + 1e-6)
        slot = tl.load(slots_ptr + row).to(tl.int64)
        write_slot = tl.load(write_slots_ptr + row).to(tl.int64)
        p_state = state_ptr + ((slot * HV + head_v) * K + o_k[:, None]) * V + o_v[None, :]
        mask_state = mask_k[:, None] & mask_v[None, :]
        state = tl.load(p_state, mask=mask_state, other=0.0)
        state *= tl.exp(tl.load(g_ptr + token * HV + head_v).to(tl.float32))
        v = (v - tl.sum(state * k[:, None], 0)) * tl.load(beta_ptr + token * HV + head_v).to(tl.float32)
        state += k[:, None] * v[None, :]
        out = tl.sum(state * q[:, None], 0)
        tl.store(out_ptr + (token * HV + head_v) * V + o_v, out.to(out_ptr.dtype.element_ty), mask=mask_v)
        p_written = state_ptr + ((write_slot * HV + head_v) * K + o_k[:, None]) * V + o_v[None, :]
        tl.store(p_written, state, mask=mask_state)


if triton is not None:
    @triton.jit
    def _scaled(value, row_scale):
        """A value of the in-projection's output times its row's folded norm scale (1.0 with the
        norm unfolded: exact), rounded to the activations' dtype as the unfolded product rounds it."""
        return (value.to(tl.float32) * row_scale).to(value.dtype).to(tl.float32)

    @triton.jit
    def _conv_read(row_ptr, window_ptr, weight_ptr, channels, mask, row_scale, KW: tl.constexpr, KP: tl.constexpr):
        """silu(conv) of one token over `channels` (fp32), from the slot's K-1 stored columns
        (`window_ptr`: the slot's [C, K-1]) and the token (scaled by `row_scale`: `_scaled`); moves
        nothing. KP: K-1 rounded up to a power of two."""
        token = _scaled(tl.load(row_ptr + channels, mask=mask, other=0.0), row_scale)
        taps = tl.arange(0, KP)
        is_stored = mask[:, None] & (taps[None, :] < KW - 1)
        columns = tl.load(window_ptr + channels[:, None] * (KW - 1) + taps[None, :], mask=is_stored, other=0.0)
        weights = tl.load(weight_ptr + channels[:, None] * KW + taps[None, :], mask=is_stored, other=0.0)
        acc = token * tl.load(weight_ptr + channels * KW + (KW - 1), mask=mask, other=0.0).to(tl.float32)
        acc += tl.sum(columns * weights.to(tl.float32), 1)
        return acc * tl.sigmoid(acc)

    @triton.jit
    def _conv_shift(row_ptr, window_ptr, written_ptr, channels, mask, row_scale, KW: tl.constexpr,
                    KP: tl.constexpr):
        """The slot's stored columns of `channels` one on, from `window_ptr` into `written_ptr` (the
        same window: in place): column i takes column i + 1, the last takes the token. Every column
        is read before any is written, with a barrier between: Triton may hold one channel in several
        threads (a 32-channel block on 4 warps), and a thread that shifted a column in place before
        another read it handed that one the new value (on the GPU only: the interpreter runs a
        program's threads as one). The token is stored scaled (`_conv_read`)."""
        token = _scaled(tl.load(row_ptr + channels, mask=mask, other=0.0), row_scale)
        taps = tl.arange(0, KP)
        columns = channels[:, None] * (KW - 1) + taps[None, :]
        following = tl.load(window_ptr + columns + 1, mask=mask[:, None] & (taps[None, :] < KW - 2), other=0.0)
        shifted = tl.where(taps[None, :] == KW - 2, token[:, None], following)
        tl.debug_barrier()
        tl.store(written_ptr + columns, shifted, mask=mask[:, None] & (taps[None, :] < KW - 1))

    @triton.jit
    def _decode_step_kernel(mixed_ptr, z_ptr, b_ptr, a_ptr, stride_mixed, stride_z, stride_b, stride_a,
                            conv_ptr, conv_weight_ptr, a_log_ptr, dt_bias_ptr, state_ptr, slots_ptr, write_slots_ptr,
                            norm_ptr, out_ptr, squares_ptr, counts_ptr, scale, eps, x_ptr, stride_x, num_x_cols,
                            row_eps, H: tl.constexpr, HV: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
                            KW: tl.constexpr, KP: tl.constexpr, BK: tl.constexpr, BD: tl.constexpr, BV: tl.constexpr,
                            NS: tl.constexpr, NSP: tl.constexpr, GROUP: tl.constexpr, HAS_ROW_NORM: tl.constexpr,
                            BLOCK_X: tl.constexpr, PDL: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        head = tl.program_id(1)
        # Parts numbered down: Triton's interpreter runs a head's parts in grid order, so there the last
        # to arrive is part 0, and a test would see a kernel that took part NS-1 for the last.
        part = NS - 1 - tl.program_id(2)
        C = 2 * H * DK + HV * DV
        if PDL:  # programmatic dependent launch (kernels.py): the step's data only after the wait
            tl.extra.cuda.gdc_wait()
        row_scale = 1.0
        if HAS_ROW_NORM:  # the norm before in_proj, folded into its product: its scale on everything it gave
            row_scale = rms_row_scale(x_ptr, row, stride_x, num_x_cols, row_eps, BLOCK_X)
        slot = tl.load(slots_ptr + row).to(tl.int64)
        write_slot = tl.load(write_slots_ptr + row).to(tl.int64)
        row_mixed = mixed_ptr + row * stride_mixed
        window = conv_ptr + slot * C * (KW - 1)
        written = conv_ptr + write_slot * C * (KW - 1)
        o_k = tl.arange(0, BK)
        mask_k = o_k < DK
        # q and k of this head, read by every part (the last part to finish moves their columns on)
        q, k = _head_qk(row_mixed, window, conv_weight_ptr, head, row_scale, scale, out_ptr.dtype.element_ty, H, DK,
                        BK, KW, KP)
        o_v = part * BV + tl.arange(0, BV)
        mask_v = o_v < DV
        mask_state = mask_k[:, None] & mask_v[None, :]
        for j in tl.static_range(GROUP):
            head_v = head * GROUP + j
            p_state = state_ptr + ((slot * HV + head_v) * DK + o_k[:, None]) * DV + o_v[None, :]
            p_written = state_ptr + ((write_slot * HV + head_v) * DK + o_k[:, None]) * DV + o_v[None, :]
            state = tl.load(p_state, mask=mask_state, other=0.0)
            decay, beta = _gates(a_ptr + row * stride_a + head_v, b_ptr + row * stride_b + head_v, a_log_ptr + head_v,
                                 dt_bias_ptr + head_v, row_scale)
            value_channels = 2 * H * DK + head_v * DV + o_v  # this part's alone: read and moved here
            v = _conv_read(row_mixed, window, conv_weight_ptr, value_channels, mask_v, row_scale, KW, KP)
            _conv_shift(row_mixed, window, written, value_channels, mask_v, row_scale, KW, KP)
            v = v.to(out_ptr.dtype.element_ty).to(tl.float32)
            state = state * decay
            v = (v - tl.sum(state * k[:, None], 0)) * beta
            state += k[:, None] * v[None, :]
            tl.store(p_written, state, mask=mask_state)
            # the rule's output, rounded as the torch path's, un-normed until every part has written
            o = tl.sum(state * q[:, None], 0).to(out_ptr.dtype.element_ty)
            o32 = o.to(tl.float32)
            tl.store(out_ptr + (row * HV + head_v) * DV + o_v, o, mask=mask_v)
            tl.store(squares_ptr + (row * HV + head_v) * NSP + part, tl.sum(tl.where(mask_v, o32 * o32, 0.0)))
        # The last part of (row, head) to arrive moves the q/k columns on (every part has read them)
        # and norms the whole head.
        if arrivals_before(counts_ptr + row * H + head, NS) == NS - 1:
            _finish_head(row_mixed, window, written, squares_ptr + row * HV * NSP, out_ptr + row * HV * DV, norm_ptr,
                         z_ptr + row * stride_z, head, eps, row_scale, H, HV, DK, DV, KW, KP, BK, BD, NS, NSP, GROUP)
            if NS > 1:
                tl.store(counts_ptr + row * H + head, 0)  # ready for the next layer or step

    @triton.jit
    def _head_qk(row_mixed, window, conv_weight_ptr, head, row_scale, scale, act: tl.constexpr, H: tl.constexpr,
                 DK: tl.constexpr, BK: tl.constexpr, KW: tl.constexpr, KP: tl.constexpr):
        """q and k of one head (fp32): the conv over the window and the token (`_conv_read`),
        rounded to the activations' dtype `act` as the torch path rounds it, L2-normed, q times `scale`."""
        o_k = tl.arange(0, BK)
        mask_k = o_k < DK
        q = _conv_read(row_mixed, window, conv_weight_ptr, head * DK + o_k, mask_k, row_scale, KW, KP)
        k = _conv_read(row_mixed, window, conv_weight_ptr, H * DK + head * DK + o_k, mask_k, row_scale, KW, KP)
        q = q.to(act).to(tl.float32)
        k = k.to(act).to(tl.float32)
        return q / tl.sqrt(tl.sum(q * q) + 1e-6) * scale, k / tl.sqrt(tl.sum(k * k) + 1e-6)

    @triton.jit
    def _finish_head(row_mixed, window, written, squares_ptr, out_ptr, norm_ptr, z_ptr, head, eps, row_scale,
                     H: tl.constexpr, HV: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, KW: tl.constexpr,
                     KP: tl.constexpr, BK: tl.constexpr, BD: tl.constexpr, NS: tl.constexpr, NSP: tl.constexpr,
                     GROUP: tl.constexpr):
        """The last part of a (row, q/k head): the q/k conv columns one on, and the gated norm over each
        of its value heads' whole d_v from the parts' sums of squares (pointers at the row)."""
        o_k = tl.arange(0, BK)
        _conv_shift(row_mixed, window, written, head * DK + o_k, o_k < DK, row_scale, KW, KP)
        _conv_shift(row_mixed, window, written, H * DK + head * DK + o_k, o_k < DK, row_scale, KW, KP)
        o_v = tl.arange(0, BD)
        parts = tl.arange(0, NSP)
        for j in tl.static_range(GROUP):
            head_v = head * GROUP + j
            sum_squares = tl.sum(tl.load(squares_ptr + head_v * NSP + parts, mask=parts < NS, other=0.0,
                                         volatile=True))
            rstd = 1.0 / tl.sqrt(sum_squares / DV + eps)
            _gated_norm(out_ptr + head_v * DV + o_v, norm_ptr + o_v, z_ptr + head_v * DV + o_v, o_v < DV, rstd,
                        row_scale)

    @triton.jit
    def _gates(a_ptr, b_ptr, a_log_ptr, dt_bias_ptr, row_scale):
        """(exp(g), beta) of one row and value head (`_log_decay`, `_beta`; a and b scaled by `row_scale`)."""
        return tl.exp(_log_decay(a_ptr, a_log_ptr, dt_bias_ptr, row_scale)), _beta(b_ptr, row_scale)

    @triton.jit
    def _log_decay(a_ptr, a_log_ptr, dt_bias_ptr, row_scale):
        """g = -exp(A_log) softplus(a + dt_bias) in fp32 (softplus as torch's: x past 20 stays x; a
        scaled by `row_scale`: `_scaled`)."""
        x = _scaled(tl.load(a_ptr), row_scale) + tl.load(dt_bias_ptr).to(tl.float32)
        # log(1 + e^x) = max(x, 0) + log(1 + e^-|x|), the last term's series where it is small
        small = tl.exp(-tl.abs(x))
        tail = tl.where(small < 1e-4, small - 0.5 * small * small, tl.log(1.0 + small))
        softplus = tl.where(x > 20.0, x, tl.maximum(x, 0.0) + tail)
        return -tl.exp(tl.load(a_log_ptr).to(tl.float32)) * softplus

    @triton.jit
    def _beta(b_ptr, row_scale):
        """beta = sigmoid(b), b scaled by `row_scale` (`_scaled`), rounded to b's dtype (the
        activations'), as fp32."""
        return tl.sigmoid(_scaled(tl.load(b_ptr), row_scale)).to(b_ptr.dtype.element_ty).to(tl.float32)

    @triton.jit
    def _gated_norm(p_out, p_weight, p_z, mask, rstd, row_scale):
        """out = w norm(o) silu(z) over one block of a head's outputs, in place (`_gated_norm_of`; z
        scaled by `row_scale`: `_scaled`)."""
        o = tl.load(p_out, mask=mask, other=0.0).to(tl.float32)
        weight = tl.load(p_weight, mask=mask, other=0.0).to(tl.float32)
        z = _scaled(tl.load(p_z, mask=mask, other=0.0), row_scale)
        tl.store(p_out, _gated_norm_of(o, weight, z, rstd, p_out.dtype.element_ty), mask=mask)

    @triton.jit
    def _gated_norm_of(o, weight, z, rstd, act: tl.constexpr):
        """w norm(o) silu(z) from fp32 values, rounded as torch rounds `w * normed.to(act) *
        silu(z.float()).to(act)` (act: the activations' dtype)."""
        normed = (o * rstd).to(act).to(tl.float32)
        weighted = (weight * normed).to(act).to(tl.float32)
        gate = (z * tl.sigmoid(z)).to(act).to(tl.float32)
        return (weighted * gate).to(act)

    @triton.jit
    def _eager_gates_kernel(a_ptr, b_ptr, a_log_ptr, dt_bias_ptr, g_ptr, beta_ptr, stride_a, stride_b,
                            HV: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        head = tl.program_id(1)
        tl.store(g_ptr + row * HV + head, _log_decay(a_ptr + row * stride_a + head, a_log_ptr + head,
                                                     dt_bias_ptr + head, 1.0))
        tl.store(beta_ptr + row * HV + head, _beta(b_ptr + row * stride_b + head, 1.0).to(beta_ptr.dtype.element_ty))

    @triton.jit
    def _eager_gated_norm_kernel(out_ptr, z_ptr, weight_ptr, gated_ptr, stride_z, eps, HV: tl.constexpr,
                                 DV: tl.constexpr, BD: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        head = tl.program_id(1)
        d = tl.arange(0, BD)
        mask = d < DV
        o = tl.load(out_ptr + (row * HV + head) * DV + d, mask=mask, other=0.0).to(tl.float32)
        rstd = 1.0 / tl.sqrt(tl.sum(o * o) / DV + eps)
        weight = tl.load(weight_ptr + d, mask=mask, other=0.0).to(tl.float32)
        z = tl.load(z_ptr + row * stride_z + head * DV + d, mask=mask, other=0.0).to(tl.float32)
        tl.store(gated_ptr + (row * HV + head) * DV + d, _gated_norm_of(o, weight, z, rstd, gated_ptr.dtype.element_ty),
                 mask=mask)


if triton is not None:
    @triton.jit
    def _step_slots_kernel(slots_ptr, version_ptr, read_ptr, write_ptr, num_rows, num_slots, BLOCK: tl.constexpr):
        rows = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        mask = rows < num_rows
        slots = tl.load(slots_ptr + rows, mask=mask, other=0)
        current = tl.load(version_ptr + slots, mask=mask, other=0).to(tl.int64)
        tl.store(read_ptr + rows, slots + current * num_slots, mask=mask)
        tl.store(write_ptr + rows, slots + (1 - current) * num_slots, mask=mask)
        tl.debug_barrier()  # every row's copy read before any slot's bit flips (padding rows share the sink)
        tl.store(version_ptr + slots, (1 - current).to(version_ptr.dtype.element_ty), mask=mask)


def step_slots(slots: torch.Tensor, version: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`LinearStates.step_slots` in one launch: slots int64 `[R]`, version int32 `[num_slots]` ->
    (read, write) int64 `[R]`, each slot's bit flipped. Rows sharing a slot (only the sink) race on
    its bit, whose value nobody relies on."""
    rows = slots.shape[0]
    read = torch.empty_like(slots)
    write = torch.empty_like(slots)
    if rows:
        block = min(1024, triton.next_power_of_2(rows))
        _step_slots_kernel[(triton.cdiv(rows, block),)](slots.contiguous(), version, read, write, rows,
                                                        version.shape[0], BLOCK=block, num_warps=1)
    return read, write


def recurrent_step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                   state: torch.Tensor, slots: torch.Tensor, write_slots: Optional[torch.Tensor] = None,
                   tokens: Optional[torch.Tensor] = None, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """One token a row of the gated delta rule, from each row's slot of `state` into its
    `write_slots` entry (None: back into the slot): q, k `[T, H, d_k]`, v `[T, HV, d_v]` (each with
    any row stride, heads contiguous), g, beta `[T, HV]`, state `[S, HV, d_k, d_v]` fp32 -> out
    `[T, HV, d_v]` in v's dtype. Row r takes token `tokens[r]` of the step's T and writes that row of
    `out` (an eager step's decode rows among its tokens: no gather of their inputs, no scatter of the
    outputs; the other rows of `out` are left as they are); without `tokens`, row r is token r and
    out is new."""
    heads, key_dim = q.shape[1], q.shape[2]
    value_heads, value_dim = v.shape[1], v.shape[2]
    rows = q.shape[0] if tokens is None else tokens.shape[0]
    if out is None:
        out = torch.empty((v.shape[0], value_heads, value_dim), dtype=v.dtype, device=v.device)
    if rows == 0:
        return out
    for name, x in (("q", q), ("k", k), ("v", v)):
        if x.stride(2) != 1 or x.stride(1) != x.shape[2]:
            raise ValueError(f"recurrent_step: {name} must have contiguous heads")
    if not state.is_contiguous() or state.dtype != torch.float32:
        raise ValueError("recurrent_step updates a contiguous fp32 state in place")
    if not out.is_contiguous() or out.shape != v.shape:
        raise ValueError("recurrent_step writes a contiguous out shaped as v")
    block_k = triton.next_power_of_2(key_dim)
    block_v = min(32, triton.next_power_of_2(value_dim))
    _recurrent_step_kernel[(triton.cdiv(value_dim, block_v), rows * value_heads)](
        q, k, v, g.contiguous(), beta.contiguous(), state, slots.contiguous(),
        slots.contiguous() if write_slots is None else write_slots.contiguous(), out,
        slots if tokens is None else tokens.contiguous(), q.stride(0), k.stride(0), v.stride(0), key_dim ** -0.5,
        H=heads, HV=value_heads, K=key_dim, V=value_dim, BK=block_k, BV=block_v, GATHER=tokens is not None,
        num_warps=4)
    return out


def decode_step(mixed: torch.Tensor, z: torch.Tensor, b: torch.Tensor, a: torch.Tensor, conv_state: torch.Tensor,
                conv_weight: torch.Tensor, a_log: torch.Tensor, dt_bias: torch.Tensor, state: torch.Tensor,
                slots: torch.Tensor, norm_weight: torch.Tensor, eps: float, num_heads: int,
                block_v: int = 0, counts: Optional[torch.Tensor] = None,
                write_slots: Optional[torch.Tensor] = None, row_norm: Optional[RowNorm] = None) -> torch.Tensor:
    """A decode-only step's gated delta-net layer between its projections (module docstring).
    mixed `[R, C]` ([q|k|v]), z `[R, HV*d_v]`, b and a `[R, HV]` (each any row stride: views of the
    in-projection's output), conv_state `[S, C, K-1]` and state `[S, HV, d_k, d_v]` fp32 (updated in
    the rows' slots), conv_weight `[C, K]`, a_log, dt_bias `[HV]`, slots `[R]`, norm_weight `[d_v]`
    -> `[R, HV*d_v]` in mixed's dtype. block_v: value columns a program takes (0: `value_block`);
    counts: int32 zeros of at least R x H entries, left zero (the parts' arrival counters; one a step
    serves all its layers: `LinearStep.counts`), None: new zeros. write_slots `[R]`: where each row's
    new conv columns and state go (None: back into its slot; else another row of conv_state and
    state, which the step does not read: `LinearStates.step_slots`). row_norm: the layer's input norm
    folded into the in-projection (`norm_folding.py`): every value it gave ([q|k|v], z, b, a) is
    first scaled by its row's norm scale of the residual stream."""
    rows, channels = mixed.shape
    value_heads = b.shape[1]
    value_dim = z.shape[1] // value_heads
    key_dim = (channels - value_heads * value_dim) // (2 * num_heads)
    taps = conv_weight.shape[1]
    out = torch.empty((rows, value_heads * value_dim), dtype=mixed.dtype, device=mixed.device)
    if rows == 0:
        return out
    _check_decode_step(mixed, z, b, a, conv_state, state, num_heads, key_dim, value_dim)
    if counts is None:
        counts = torch.zeros(rows * num_heads, dtype=torch.int32, device=mixed.device)
    if counts.dtype != torch.int32 or counts.numel() < rows * num_heads:
        raise ValueError(f"decode_step: counts must be int32 zeros of at least {rows * num_heads} entries")
    block_v = block_v or value_block(value_dim)
    parts = triton.cdiv(value_dim, block_v)
    squares = torch.empty((rows, value_heads, triton.next_power_of_2(parts)), dtype=torch.float32, device=mixed.device)
    _decode_step_kernel[(rows, num_heads, parts)](
        mixed, z, b, a, mixed.stride(0), z.stride(0), b.stride(0), a.stride(0), conv_state, conv_weight.contiguous(),
        a_log, dt_bias, state, slots, slots if write_slots is None else write_slots, norm_weight, out, squares,
        counts, key_dim ** -0.5, eps, H=num_heads,
        HV=value_heads, DK=key_dim, DV=value_dim, KW=taps, KP=triton.next_power_of_2(max(taps - 1, 1)),
        BK=triton.next_power_of_2(key_dim), BD=triton.next_power_of_2(value_dim), BV=block_v, NS=parts,
        NSP=triton.next_power_of_2(parts), GROUP=value_heads // num_heads, num_warps=4,
        **row_norm_args(row_norm, mixed), **pdl_launch(mixed))
    return out


def _check_decode_step(mixed: torch.Tensor, z: torch.Tensor, b: torch.Tensor, a: torch.Tensor,
                       conv_state: torch.Tensor, state: torch.Tensor, num_heads: int, key_dim: int,
                       value_dim: int) -> None:
    channels, value_heads = mixed.shape[1], b.shape[1]
    if value_heads % num_heads or 2 * num_heads * key_dim + value_heads * value_dim != channels:
        raise ValueError(f"decode_step: {channels} channels do not split into {num_heads} q/k heads and "
                         f"{value_heads} value heads of {value_dim}")
    for name, x in (("mixed", mixed), ("z", z), ("b", b), ("a", a)):
        if x.stride(1) != 1:
            raise ValueError(f"decode_step: {name} must have contiguous columns")
    for name, x in (("conv_state", conv_state), ("state", state)):
        if not x.is_contiguous() or x.dtype != torch.float32:
            raise ValueError(f"decode_step updates a contiguous fp32 {name} in place")


def eager_gates(a: torch.Tensor, b: torch.Tensor, a_log: torch.Tensor, dt_bias: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """An eager step's gates in one launch: a, b `[N, HV]` (any row stride: views of the
    in-projection's output), a_log, dt_bias `[HV]` -> (g fp32 `[N, HV]`, beta `[N, HV]` in b's dtype),
    the decode kernel's arithmetic (`_log_decay`, `_beta`). Why: as torch ops they were nine launches a
    gated delta-net layer of every eager step, whose host time is what such a step waits on."""
    rows, value_heads = b.shape
    g = torch.empty((rows, value_heads), dtype=torch.float32, device=b.device)
    beta = torch.empty((rows, value_heads), dtype=b.dtype, device=b.device)
    if rows:
        if a.stride(1) != 1 or b.stride(1) != 1:
            raise ValueError("eager_gates: a and b must have contiguous heads")
        _eager_gates_kernel[(rows, value_heads)](a, b, a_log, dt_bias, g, beta, a.stride(0), b.stride(0),
                                                 HV=value_heads, num_warps=1)
    return g, beta


def eager_gated_norm(out: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """An eager step's gated RMSNorm in one launch: out `[N, HV, d_v]` (the rule's outputs, contiguous),
    z `[N, HV*d_v]` (any row stride), weight `[d_v]` -> `[N, HV*d_v]` in out's dtype, w norm(o) silu(z)
    rounded as the decode kernel's norm (`_gated_norm_of`). Why: twelve torch launches a layer before."""
    rows, value_heads, value_dim = out.shape
    gated = torch.empty((rows, value_heads * value_dim), dtype=out.dtype, device=out.device)
    if rows:
        if not out.is_contiguous() or z.stride(1) != 1:
            raise ValueError("eager_gated_norm: out must be contiguous, z's columns contiguous")
        block = triton.next_power_of_2(value_dim)
        _eager_gated_norm_kernel[(rows, value_heads)](out, z, weight, gated, z.stride(0), eps, HV=value_heads,
                                                      DV=value_dim, BD=block, num_warps=max(1, min(4, block // 128)))
    return gated


def value_block(value_dim: int) -> int:
    """Value columns a `decode_step` program takes: 32 (4 warps). Measured on the H200 at Qwen3.5's
    heads (one-off sweep, docs/engine.md): parts of 32 beat the head's 128 in one program at 1 and 8
    rows (4.6 against 7.1 us a layer, 9.6 against 11.5) and tie with a loop over blocks of 32 at 64
    rows (52.5 against 52.4). Parts of 64 tied at 8 rows and were 3% quicker at 64 (50.9) but slower
    at 1 row (5.1); parts of 16 (2 warps) and of 64 on 8 warps were slower."""
    return min(32, triton.next_power_of_2(value_dim))


def causal_conv(conv_state: torch.Tensor, read: torch.Tensor, mixed: torch.Tensor, index: torch.Tensor,
                weight: torch.Tensor, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The step's conv outputs `[T, C]` (module docstring); `index` has T rows (tokens of a row).
    out: a contiguous `[T, C]` tensor of mixed's dtype to write them into (None: a new one)."""
    num_tokens, taps = index.shape
    channels = mixed.shape[1]
    if out is None:
        out = torch.empty((num_tokens, channels), dtype=mixed.dtype, device=mixed.device)
    elif out.shape != (num_tokens, channels) or out.dtype != mixed.dtype or not out.is_contiguous():
        raise ValueError(f"causal_conv: out must be a contiguous {mixed.dtype} tensor of shape "
                         f"{(num_tokens, channels)}, got {out.dtype} {tuple(out.shape)}")
    if num_tokens == 0:
        return out
    index, weight = index.contiguous(), weight.contiguous()
    if mixed.stride(1) != 1:
        mixed = mixed.contiguous()
    block = min(1024, triton.next_power_of_2(channels))
    _causal_conv_kernel[(num_tokens, triton.cdiv(channels, block))](
        _windows(conv_state), read, mixed, index, weight, out, mixed.stride(0), read.shape[0] * (taps - 1),
        channels, K=taps, BLOCK=block, num_warps=4)
    return out


def conv_store(conv_state: torch.Tensor, read: torch.Tensor, write: torch.Tensor, mixed: torch.Tensor,
               state_index: torch.Tensor) -> None:
    """Each row's new stored columns (module docstring, `conv_store`): row r's K-1 columns
    `state_index[r]` of [its stored columns | the step's tokens] into its `write` slot of conv_state."""
    rows, k1 = state_index.shape
    channels = mixed.shape[1]
    if rows == 0 or k1 == 0:
        return
    if mixed.stride(1) != 1:
        mixed = mixed.contiguous()
    block = min(256, triton.next_power_of_2(channels))
    _conv_store_kernel[(rows, triton.cdiv(channels, block))](
        _windows(conv_state), read, write, mixed, state_index.contiguous(), mixed.stride(0), rows * k1, channels,
        K1=k1, KP=triton.next_power_of_2(k1), BLOCK=block, num_warps=4)


def _windows(conv_state: torch.Tensor) -> torch.Tensor:
    if not conv_state.is_contiguous() or conv_state.dtype != torch.float32:
        raise ValueError("the conv kernels read and write a contiguous fp32 conv_state")
    return conv_state
