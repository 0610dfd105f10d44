"""Building blocks shared by the torch models: RMSNorm, SwiGLU, segment-wise linear (RoPE is in rope.py).

`seg_linear` multiplies each row's token span on its own. CPU matrix kernels pick different
blockings for different row counts, so one big matmul over a packed step gives a row slightly
different numbers depending on its neighbours; per-span matmuls make a request's output the same
whether it runs alone or beside others (batch invariance), at a small cost on the CPU. On a GPU
one launch per span would dominate the step, so there it is one matmul: the GPU path does not
promise batch invariance (FlashInfer's split-KV attention does not either).
"""
from __future__ import annotations

from typing import Generic, Iterable, Iterator, Optional, TypeVar, cast

import torch
import torch.nn.functional as F
from torch import nn

Bounds = list[tuple[int, int]]  # [start, end) token spans of a packed step, in order, covering it
ModuleT = TypeVar("ModuleT", bound=nn.Module)


class ModuleSeq(nn.ModuleList, Generic[ModuleT]):
    """An `nn.ModuleList` (same state-dict names, `N.*`) of one module type, which iterates as
    that type for the type checker."""

    def __init__(self, modules: Iterable[ModuleT]):
        super().__init__(modules)

    def __iter__(self) -> Iterator[ModuleT]:
        # nn.ModuleList is not generic; __init__ only ever receives ModuleT instances.
        return cast("Iterator[ModuleT]", super().__iter__())


def seg_linear(x: torch.Tensor, weight: torch.Tensor, bounds: Bounds,
               bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """`x @ weight.T (+ bias)`, computed span by span on the CPU (see the module docstring)."""
    if len(bounds) == 1 or x.device.type != "cpu":
        return F.linear(x, weight, bias)
    return torch.cat([F.linear(x[start:end], weight, bias) for start, end in bounds])


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


class SwiGLU(nn.Module):
    """down(silu(gate(x)) * up(x)), with biases when `has_bias` (Llama's mlp_bias)."""

    def __init__(self, hidden: int, intermediate: int, has_bias: bool = False):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=has_bias)
        self.up_proj = nn.Linear(hidden, intermediate, bias=has_bias)
        self.down_proj = nn.Linear(intermediate, hidden, bias=has_bias)

    def forward(self, x: torch.Tensor, bounds: Bounds) -> torch.Tensor:
        gate = seg_linear(x, self.gate_proj.weight, bounds, self.gate_proj.bias)
        up = seg_linear(x, self.up_proj.weight, bounds, self.up_proj.bias)
        return seg_linear(F.silu(gate) * up, self.down_proj.weight, bounds, self.down_proj.bias)
