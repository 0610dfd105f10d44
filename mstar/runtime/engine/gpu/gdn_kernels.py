"""Triton kernels of the gated delta-net layers: the causal conv over an eager step's rows, and
a decode step's conv and gated delta rule updating the rows' recurrent slots in place.

`causal_conv` (eager steps):

In: `stored` `[S, C]` (every row's stored K-1 conv columns, fp32), `mixed` `[T, C]` (the step's
[q|k|v] projections, any row stride), `index` `[T, K]` int64 (tap i of token t reads column
`index[t, i]` of [stored | mixed]: `gdn_forward.linear_layout`), the conv weight `[C, K]`.
Out: silu(sum_i weight[:, i] * column(index[t, i])) `[T, C]` in `mixed`'s dtype, summed in fp32.

Why: in torch ops the same conv gathers a `[T, K, C]` fp32 window tensor (1.6 GB for a 16 x 1024
prefill at Qwen3.5's 6144 channels) and reads it twice more per layer; here each token reads its K
columns once (neighbouring tokens share them in cache) and writes its output once.

`conv_step` and `recurrent_step` (rows of one token, what the decode graphs capture): each row
reads its slot's stored conv columns and recurrent state where they live (`LinearStates`, indexed by
the row's slot), runs one token, and writes them back in place. Why: gathering the rows' states into
a batch, running the rule on the copy and scattering it back moves each 1 MiB state (Qwen3.5:
16 heads x 128 x 128 fp32 a layer) four times instead of twice; at 64 rows the gather and scatter
took 1.8 ms of a 5.8 ms step on the H200. Rows sharing a slot (padding rows on slot 0, the sink)
race only on the sink, whose content nobody reads. The rule is fla's fused recurrent one (q and k
L2-normalised in the kernel, q scaled by d_k^-1/2): state *= exp(g); v' = beta (v - k.state);
state += k v'^T; out = q.state.

`available(device)` as `kernels.py`: a CUDA device with Triton; tests run the kernel under the
Triton interpreter on the CPU (`tests/engine/test_gpu_kernels_interpreted.py`).
"""
from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU installs without Triton keep the torch ops
    triton = None


def available(device: torch.device) -> bool:
    return triton is not None and device.type == "cuda"


if triton is not None:
    @triton.jit
    def _causal_conv_kernel(stored_ptr, mixed_ptr, index_ptr, weight_ptr, out_ptr, stride_mixed, num_stored,
                            channels, K: tl.constexpr, BLOCK: tl.constexpr):
        token = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < channels
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        for tap in tl.static_range(K):
            # The tap's column as a vector (masks are vectors): a stored column or a token of the step;
            # one of the two loads is masked off whole.
            column = tl.zeros([BLOCK], dtype=tl.int64) + tl.load(index_ptr + token * K + tap).to(tl.int64)
            is_stored = column < num_stored
            from_stored = tl.load(stored_ptr + column * channels + cols, mask=mask & is_stored, other=0.0)
            from_mixed = tl.load(mixed_ptr + (column - num_stored) * stride_mixed + cols,
                                 mask=mask & (column >= num_stored), other=0.0)
            x = tl.where(is_stored, from_stored.to(tl.float32), from_mixed.to(tl.float32))
            weight = tl.load(weight_ptr + cols * K + tap, mask=mask, other=0.0).to(tl.float32)
            acc += x * weight
        out = acc * tl.sigmoid(acc)
        tl.store(out_ptr + token * channels + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


if triton is not None:
    @triton.jit
    def _conv_step_kernel(mixed_ptr, state_ptr, slots_ptr, weight_ptr, out_ptr, stride_mixed, channels,
                          K: tl.constexpr, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < channels
        slot = tl.load(slots_ptr + row).to(tl.int64)
        stored = state_ptr + slot * channels * (K - 1) + cols * (K - 1)  # the slot's [C, K-1] columns
        token = tl.load(mixed_ptr + row * stride_mixed + cols, mask=mask, other=0.0).to(tl.float32)
        acc = token * tl.load(weight_ptr + cols * K + (K - 1), mask=mask, other=0.0).to(tl.float32)
        previous = token  # written into the last stored column once the loop has read it
        for back in tl.static_range(K - 1):
            tap = K - 2 - back  # stored columns from the newest: each is read, then overwritten by the next
            column = tl.load(stored + tap, mask=mask, other=0.0)
            acc += column * tl.load(weight_ptr + cols * K + tap, mask=mask, other=0.0).to(tl.float32)
            tl.store(stored + tap, previous, mask=mask)
            previous = column
        out = acc * tl.sigmoid(acc)
        tl.store(out_ptr + row * channels + cols, out.to(out_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _recurrent_step_kernel(q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, state_ptr, slots_ptr, out_ptr,
                               stride_q, stride_k, stride_v, scale, H: tl.constexpr, HV: tl.constexpr,
                               K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr):
        block_v = tl.program_id(0)
        row_head = tl.program_id(1).to(tl.int64)
        row, head_v = row_head // HV, row_head % HV
        head = head_v // (HV // H)  # q/k head of this value head (fla's grouping)
        o_k = tl.arange(0, BK)
        o_v = block_v * BV + tl.arange(0, BV)
        mask_k, mask_v = o_k < K, o_v < V
        q = tl.load(q_ptr + row * stride_q + head * K + o_k, mask=mask_k, other=0.0).to(tl.float32)
        k = tl.load(k_ptr + row * stride_k + head * K + o_k, mask=mask_k, other=0.0).to(tl.float32)
        v = tl.load(v_ptr + row * stride_v + head_v * V + o_v, mask=mask_v, other=0.0).to(tl.float32)
        q = q / tl.sqrt(tl.sum(q * q) + 1e-6) * scale
        k = k / tl.sqrt(tl.sum(k * k) + 1e-6)
        slot = tl.load(slots_ptr + row).to(tl.int64)
        p_state = state_ptr + ((slot * HV + head_v) * K + o_k[:, None]) * V + o_v[None, :]
        mask_state = mask_k[:, None] & mask_v[None, :]
        state = tl.load(p_state, mask=mask_state, other=0.0)
        state *= tl.exp(tl.load(g_ptr + row * HV + head_v).to(tl.float32))
        v = (v - tl.sum(state * k[:, None], 0)) * tl.load(beta_ptr + row * HV + head_v).to(tl.float32)
        state += k[:, None] * v[None, :]
        out = tl.sum(state * q[:, None], 0)
        tl.store(out_ptr + (row * HV + head_v) * V + o_v, out.to(out_ptr.dtype.element_ty), mask=mask_v)
        tl.store(p_state, state, mask=mask_state)


def conv_step(mixed: torch.Tensor, conv_state: torch.Tensor, slots: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """Rows of one token: silu(conv over [the slot's K-1 stored columns | the token]) `[R, C]` in
    `mixed`'s dtype (summed in fp32); the slot's columns move one on, in place (module docstring).
    mixed `[R, C]` (any row stride), conv_state `[S, C, K-1]` fp32, slots `[R]`, weight `[C, K]`."""
    rows, channels = mixed.shape
    taps = weight.shape[1]
    out = torch.empty((rows, channels), dtype=mixed.dtype, device=mixed.device)
    if rows == 0:
        return out
    if mixed.stride(1) != 1:
        mixed = mixed.contiguous()
    if not conv_state.is_contiguous() or conv_state.dtype != torch.float32:
        raise ValueError("conv_step updates a contiguous fp32 conv state in place")
    block = min(1024, triton.next_power_of_2(channels))
    _conv_step_kernel[(rows, triton.cdiv(channels, block))](
        mixed, conv_state, slots.contiguous(), weight.contiguous(), out, mixed.stride(0), channels, K=taps,
        BLOCK=block, num_warps=4)
    return out


def recurrent_step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                   state: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """One token a row of the gated delta rule, from and back into each row's slot of `state`:
    q, k `[R, H, d_k]`, v `[R, HV, d_v]` (each with any row stride, heads contiguous), g, beta
    `[R, HV]`, state `[S, HV, d_k, d_v]` fp32 -> out `[R, HV, d_v]` in v's dtype."""
    rows, heads, key_dim = q.shape
    value_heads, value_dim = v.shape[1], v.shape[2]
    out = torch.empty((rows, value_heads, value_dim), dtype=v.dtype, device=v.device)
    if rows == 0:
        return out
    for name, x in (("q", q), ("k", k), ("v", v)):
        if x.stride(2) != 1 or x.stride(1) != x.shape[2]:
            raise ValueError(f"recurrent_step: {name} must have contiguous heads")
    if not state.is_contiguous() or state.dtype != torch.float32:
        raise ValueError("recurrent_step updates a contiguous fp32 state in place")
    block_k = triton.next_power_of_2(key_dim)
    block_v = min(32, triton.next_power_of_2(value_dim))
    _recurrent_step_kernel[(triton.cdiv(value_dim, block_v), rows * value_heads)](
        q, k, v, g.contiguous(), beta.contiguous(), state, slots.contiguous(), out, q.stride(0), k.stride(0),
        v.stride(0), key_dim ** -0.5, H=heads, HV=value_heads, K=key_dim, V=value_dim, BK=block_k, BV=block_v,
        num_warps=4)
    return out


def causal_conv(stored: torch.Tensor, mixed: torch.Tensor, index: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """The step's conv outputs `[T, C]` (module docstring); `index` has T rows (tokens of a row)."""
    num_tokens, taps = index.shape
    channels = mixed.shape[1]
    out = torch.empty((num_tokens, channels), dtype=mixed.dtype, device=mixed.device)
    if num_tokens == 0:
        return out
    stored, index, weight = stored.contiguous(), index.contiguous(), weight.contiguous()
    if mixed.stride(1) != 1:
        mixed = mixed.contiguous()
    block = min(1024, triton.next_power_of_2(channels))
    _causal_conv_kernel[(num_tokens, triton.cdiv(channels, block))](
        stored, mixed, index, weight, out, mixed.stride(0), stored.shape[0], channels, K=taps, BLOCK=block,
        num_warps=4)
    return out
