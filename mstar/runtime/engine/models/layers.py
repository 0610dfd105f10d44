"""Building blocks shared by the torch models: RMSNorm, rotary embedding, SwiGLU, segment-wise linear.

`seg_linear` multiplies each row's token span on its own. CPU matrix kernels pick different
blockings for different row counts, so one big matmul over a packed step gives a row slightly
different numbers depending on its neighbours; per-span matmuls make a request's output the same
whether it runs alone or beside others (batch invariance), at a small cost on the CPU. On a GPU
one launch per span would dominate the step, so there it is one matmul: the GPU path does not
promise batch invariance (FlashInfer's split-KV attention does not either).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

Bounds = list[tuple[int, int]]  # [start, end) token spans of a packed step, in order, covering it


def seg_linear(x: torch.Tensor, weight: torch.Tensor, bounds: Bounds) -> torch.Tensor:
    """`x @ weight.T`, computed span by span on the CPU (see the module docstring)."""
    if len(bounds) == 1 or x.device.type != "cpu":
        return F.linear(x, weight)
    return torch.cat([F.linear(x[start:end], weight) for start, end in bounds])


class RMSNorm(nn.Module):
    """x / rms(x) * w, normalised in fp32.

    Llama multiplies by a plain w (initialised to 1); Qwen3.5 stores w centred on zero and
    multiplies by 1 + w in fp32 (`is_zero_centred`, initialised to 0).
    """

    def __init__(self, dim: int, eps: float, is_zero_centred: bool = False):
        super().__init__()
        self.is_zero_centred = is_zero_centred
        self.weight = nn.Parameter(torch.zeros(dim) if is_zero_centred else torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.is_zero_centred:
            return (x32 * (1.0 + self.weight.float())).to(x.dtype)
        return self.weight * x32.to(x.dtype)


def rotary(x: torch.Tensor, positions: torch.Tensor, theta: float, rotary_dim: int = 0) -> torch.Tensor:
    """Rotary embedding on `x` `[N, heads, head_dim]` at integer `positions` `[N]`.

    Half rotation: dim i pairs with dim i + rotary_dim/2 (HF's rotate_half). Only the first
    `rotary_dim` dims rotate (Qwen3.5's partial rotary); 0 means all of them.
    """
    if rotary_dim and rotary_dim < x.shape[-1]:
        return torch.cat([rotary(x[..., :rotary_dim], positions, theta), x[..., rotary_dim:]], dim=-1)
    head_dim = x.shape[-1]
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    freqs = positions.float().unsqueeze(1) * inv_freq.unsqueeze(0)
    emb = torch.cat([freqs, freqs], dim=-1)
    cos, sin = emb.cos().unsqueeze(1).to(x.dtype), emb.sin().unsqueeze(1).to(x.dtype)
    half = head_dim // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


class SwiGLU(nn.Module):
    """down(silu(gate(x)) * up(x))."""

    def __init__(self, hidden: int, intermediate: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x: torch.Tensor, bounds: Bounds) -> torch.Tensor:
        gate = seg_linear(x, self.gate_proj.weight, bounds)
        up = seg_linear(x, self.up_proj.weight, bounds)
        return seg_linear(F.silu(gate) * up, self.down_proj.weight, bounds)
