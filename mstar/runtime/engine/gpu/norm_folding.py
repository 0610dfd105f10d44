"""A layer's RMSNorms folded into the products after them, their scales into the kernels after those.

A norm before a product is `h = s * x * w` (s = rsqrt(mean(x^2) + eps), one scalar a row), so
`h @ W = s * (x @ (w W))`: the norm's weight w (1 + w for a zero-centred norm) scales the input
rows of the product's weight once at start-up (`fold`), the product reads the residual stream x
itself, and the fused kernel that reads the product's output anyway multiplies each row by s, which
it computes from x (`kernels.RowNorm`): RoPE with the K/V write after q/k/v (and the gated
attention's sigmoid gate), silu * up after gate/up, a gated delta-net layer's decode kernel after
its in_proj (`gdn_kernels.decode_step`: [q|k|v] before the conv, so its window stores the scaled
projections, z, b and a). The residual adds move into the products that write the residual stream
(o and down, a gated delta-net layer's out_proj): `x += a @ W` in cuBLAS's epilogue, beta = 1
(`Product.accumulate`). A decode step's layer so launches two kernels fewer (its two add + norm
kernels). In other steps a gated delta-net layer's in_proj reads the norm of x, one kernel as
before: its eager and piecewise kernels take no row scale, and the norm's weight, now the
identity, leaves the fold exact.

Why: in a CUDA graph every kernel costs a few microseconds beyond its bytes, and a 64-row decode
step of Llama-3.2-1B runs its norms as 32 of about 165 kernels (docs/engine.md, "Norms folded into
the products").

Where (`applies`): the fused kernels' forward of a decoder on one rank (a tensor-parallel rank's
o and down outputs are partial sums, reduced across the group before the residual add), whose
folded products have no bias (a bias would be scaled with them). Each folded norm's weight becomes
the identity (1, or 0 zero-centred), so the model's modules still compute the same function (up to
rounding) and folding twice changes nothing.

Rounding differs from torch's: the normed rows are not rounded to bf16 before the product, and
w W is rounded to bf16 once, so a greedy token may differ from the unfolded forward's where two
logits lie within bf16's resolution. Off by default: `set_enabled(True)` (`mstar bench engine
--fold-norms`) is the what-if. On the H200 it took 2.0-2.2% off a 64-row decode step (Llama-3.2-1B,
Qwen3.5), but its graphs allocate a fifth less than the capture estimate models (docs/engine.md,
"Norms folded into the products"), so it waits for the estimate to model them.
"""
from __future__ import annotations

from typing import Iterable

import torch

from mstar.runtime.engine.gpu.products import Product
from mstar.runtime.engine.models.decoder import Decoder
from mstar.runtime.engine.models.layers import RMSNorm

_enabled = False


def set_enabled(enabled: bool) -> None:
    """Fold the norms of decoders whose forward is built afterwards (module docstring), or not (the default)."""
    global _enabled
    _enabled = enabled


def is_enabled() -> bool:
    return _enabled


def applies(model: Decoder, folded: Iterable[Product]) -> bool:
    """Whether a forward of `model` may fold its norms into the products `folded` (module docstring)."""
    return not model.is_sharded and all(product.bias is None for product in folded)


def fold(norm: RMSNorm, product: Product) -> None:
    """Scales the product's weight by the norm's weight along its input, in fp32, rounded once, and
    makes the norm's weight the identity."""
    with torch.no_grad():
        scale = norm.weight.float() + 1.0 if norm.is_zero_centred else norm.weight.float()
        by_input = scale[:, None] if product.is_transposed else scale[None, :]
        product.weight.copy_((product.weight.float() * by_input).to(product.weight.dtype))
        norm.weight.fill_(0.0 if norm.is_zero_centred else 1.0)
