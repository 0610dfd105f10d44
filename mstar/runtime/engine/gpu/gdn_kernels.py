"""A Triton kernel for the gated delta-net layers' causal conv over an eager step's rows.

In: `stored` `[S, C]` (every row's stored K-1 conv columns, fp32), `mixed` `[T, C]` (the step's
[q|k|v] projections, any row stride), `index` `[T, K]` int64 (tap i of token t reads column
`index[t, i]` of [stored | mixed]: `gdn_forward.linear_layout`), the conv weight `[C, K]`.
Out: silu(sum_i weight[:, i] * column(index[t, i])) `[T, C]` in `mixed`'s dtype, summed in fp32.

Why: in torch ops the same conv gathers a `[T, K, C]` fp32 window tensor (1.6 GB for a 16 x 1024
prefill at Qwen3.5's 6144 channels) and reads it twice more per layer; here each token reads its K
columns once (neighbouring tokens share them in cache) and writes its output once.

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
