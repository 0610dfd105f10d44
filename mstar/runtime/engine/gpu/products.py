"""The decoder's matrix products, with each weight stored the way the device multiplies it fastest.

A product `x @ W^T` (an `nn.Linear`, or several fused by output) holds its weight once: on a CUDA
device as `[in, out]` rows (the transpose, made once at construction), elsewhere as the module's
`[out, in]`. The modules' parameters become views of the stored weight either way (transposed views
on a GPU), so no weight is held twice and the modules still compute the same products.

Why transposed on a GPU: cuBLAS picks its kernel by the operands' layout, and with `[out, in]`
weights its choice at 1-4 rows for Qwen3.5's out projections (2048 -> 1024) ran 12.8 us against
5.9 us for the same product from `[in, out]`, which was never slower for any decoder shape measured
(Llama-3.2-1B's down projection 13.97 -> 12.80 us at one row, 14.32 -> 13.82 at 64; docs/engine.md,
"Weights stored for the product"). The CPU keeps the modules' layout: its products, and so the
CPU tests' batch invariance, stay as they were.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Protocol

import torch
import torch.nn as nn
import torch.nn.functional as F


_transposed_allowed = True


def set_transposed(enabled: bool) -> None:
    """Hold the weights of products built afterwards `[in, out]` on a GPU (the default), or never
    (the modules' layout everywhere: `mstar bench engine --module-layout`, the what-if beside it)."""
    global _transposed_allowed
    _transposed_allowed = enabled


def stores_transposed(device: torch.device) -> bool:
    """Whether products on `device` hold their weights as `[in, out]` (module docstring)."""
    return _transposed_allowed and device.type == "cuda"


class FewRows(Protocol):
    """A product's own kernel for steps of at most `max_rows` rows (`skinny_products.FewRowsProduct`);
    `gated`: x is `[N, 2 * in]`, the product's input being silu(gate) * up; `into`: the product is
    added into it in place (and it is returned)."""

    max_rows: int

    def __call__(self, x: torch.Tensor, gated: bool = False, into: Optional[torch.Tensor] = None
                 ) -> torch.Tensor: ...


@dataclass
class Product:
    """One product's operands: `weight` `[in, out]` when `is_transposed`, else `[out, in]`; `bias`
    `[out]` or None; `few_rows`, when set, runs the steps of at most its `max_rows` rows."""

    weight: torch.Tensor
    bias: Optional[torch.Tensor]
    is_transposed: bool
    few_rows: Optional[FewRows] = None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x `[N, in]` -> `[N, out]`."""
        few_rows = self.few_rows_for(x.shape[0])
        if few_rows is not None:
            return few_rows(x)
        if not self.is_transposed:
            return F.linear(x, self.weight, self.bias)
        if self.bias is None:
            return torch.mm(x, self.weight)
        return torch.addmm(self.bias, x, self.weight)

    def accumulate(self, into: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """`into += x @ W^T` in place and returns `into` `[N, out]`: the residual add in cuBLAS's
        epilogue (beta = 1) rather than a kernel of its own (`norm_folding.py`)."""
        few_rows = self.few_rows_for(x.shape[0])
        if few_rows is not None:  # its kernel adds the bias and the sum into `into`, one rounding
            return few_rows(x, into=into)
        into.addmm_(x, self.weight if self.is_transposed else self.weight.t())
        if self.bias is not None:
            into.add_(self.bias)
        return into

    def few_rows_for(self, rows: int) -> Optional[FewRows]:
        """`few_rows` when it runs a step of `rows` rows (its kernel also takes `gated` input), else None."""
        few_rows = self.few_rows
        return few_rows if few_rows is not None and rows <= few_rows.max_rows else None

    @property
    def in_features(self) -> int:
        return self.weight.shape[0] if self.is_transposed else self.weight.shape[1]

    @property
    def out_features(self) -> int:
        return self.weight.shape[1] if self.is_transposed else self.weight.shape[0]


def fuse(linears: list[nn.Linear], transposed: bool) -> Product:
    """The linears stacked by output as one product; their parameters become views of its weight
    (and bias: zeros for a linear without one, when any has one)."""
    with torch.no_grad():
        weight = _stacked([linear.weight.data for linear in linears])
        if transposed:
            stored = weight.t().contiguous()
            weight = stored.t()  # [out, in] again, a view of the stored rows
        else:
            stored = weight
        has_bias = any(linear.bias is not None for linear in linears)
        bias = _stacked([linear.bias.data if linear.bias is not None else weight.new_zeros(linear.out_features)
                         for linear in linears]) if has_bias else None
        start = 0
        for linear in linears:
            end = start + linear.out_features
            linear.weight = nn.Parameter(weight[start:end], requires_grad=False)
            if linear.bias is not None and bias is not None:  # bias is set whenever any linear has one
                linear.bias = nn.Parameter(bias[start:end], requires_grad=False)
            start = end
    return Product(stored, bias, transposed)


def _stacked(tensors: list[torch.Tensor]) -> torch.Tensor:
    """The tensors concatenated; a lone one as it is (a single linear's weight is not copied)."""
    return torch.cat(tensors) if len(tensors) > 1 else tensors[0]
