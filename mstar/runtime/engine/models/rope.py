"""Rotary position embedding with the scaled kinds that checkpoints declare in config.json.

In: `x` `[N, heads, head_dim]`, integer `positions` `[N]`, the decoder's `theta`, rotary width and
`RopeScaling` (`mstar.plan.dims`), and for the `dynamic` kind each token's sequence length.
Out: `x` rotated (the first `rotary_dim` dims; the rest pass through, as in Qwen3.5's partial
rotary). Half rotation: dim i pairs with dim i + rotary_dim/2 (Hugging Face's rotate_half).

The inverse frequencies follow transformers' `modeling_rope_utils` (the parity oracle) kind by kind:
- `default`: theta^(-2i/d);
- `linear`: default / factor;
- `llama3`: Llama 3.1's band rule: low frequencies (wavelength past original/low_freq_factor) are
  divided by `factor`, high ones kept, the band between interpolated smoothly;
- `yarn`: a ramp between interpolated (/factor) and extrapolated frequencies over the dims between
  the beta_fast and beta_slow correction points, and cos/sin scaled by the attention factor;
- `dynamic` (NTK): theta grows with the sequence length L past `max_position`:
  theta * (factor * L / max_position - (factor - 1))^(d / (d - 2)). transformers recomputes it
  from the largest position of each forward; here L is per request (its largest position in the
  step + 1), which is the same thing for one sequence and keeps a row independent of its neighbours.
"""
from __future__ import annotations

import math
from typing import Optional

import torch

from mstar.plan.dims import RopeScaling


def inverse_frequencies(rope: RopeScaling, theta: float, dim: int) -> torch.Tensor:
    """`[dim / 2]` fp32 inverse frequencies of a static kind (every kind but `dynamic`)."""
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
    inv_freq = 1.0 / (theta ** exponents)
    if rope.kind == "linear":
        return inv_freq / rope.factor
    if rope.kind == "llama3":
        return _llama3(inv_freq, rope)
    if rope.kind == "yarn":
        return _yarn(theta, dim, rope)
    return inv_freq


def _llama3(inv_freq: torch.Tensor, rope: RopeScaling) -> torch.Tensor:
    old_context = rope.original_max_position
    low_freq_wavelen = old_context / rope.low_freq_factor
    high_freq_wavelen = old_context / rope.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / rope.factor, inv_freq)
    smooth = (old_context / wavelen - rope.low_freq_factor) / (rope.high_freq_factor - rope.low_freq_factor)
    smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def _yarn(theta: float, dim: int, rope: RopeScaling) -> torch.Tensor:
    def correction_dim(num_rotations: float) -> float:
        return (dim * math.log(rope.original_max_position / (num_rotations * 2 * math.pi))) / (2 * math.log(theta))

    low, high = correction_dim(rope.beta_fast), correction_dim(rope.beta_slow)
    if rope.is_truncated:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # a zero-width ramp would divide by zero
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos_freqs = theta ** (torch.arange(0, dim, 2).float() / dim)
    extrapolation = 1.0 / pos_freqs
    interpolation = 1.0 / (rope.factor * pos_freqs)
    extrapolation_weight = 1 - ramp
    return interpolation * (1 - extrapolation_weight) + extrapolation * extrapolation_weight


def _dynamic(rope: RopeScaling, theta: float, dim: int, seq_lens: torch.Tensor) -> torch.Tensor:
    """`[N, dim / 2]`: NTK inverse frequencies for each token's sequence length (fp32 tensor
    arithmetic, as transformers does it from a tensor of positions)."""
    lengths = torch.maximum(seq_lens.long(), torch.tensor(rope.max_position, device=seq_lens.device))
    base = theta * ((rope.factor * lengths / rope.max_position) - (rope.factor - 1)) ** (dim / (dim - 2))
    exponents = torch.arange(0, dim, 2, dtype=torch.int64, device=seq_lens.device).float() / dim
    return 1.0 / (base.unsqueeze(1) ** exponents.unsqueeze(0))


def apply_rotary(x: torch.Tensor, positions: torch.Tensor, theta: float, rotary_dim: int, rope: RopeScaling,
                 seq_lens: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Rotate `x` `[N, heads, head_dim]` at `positions` `[N]` (see the module docstring).

    `rotary_dim` 0 rotates every dim; `seq_lens` `[N]` is needed by the `dynamic` kind only."""
    head_dim = x.shape[-1]
    if rotary_dim and rotary_dim < head_dim:
        rotated = apply_rotary(x[..., :rotary_dim], positions, theta, rotary_dim, rope, seq_lens)
        return torch.cat([rotated, x[..., rotary_dim:]], dim=-1)
    if rope.kind == "dynamic":
        if seq_lens is None:
            raise ValueError("dynamic RoPE needs each token's sequence length")
        freqs = positions.float().unsqueeze(1) * _dynamic(rope, theta, head_dim, seq_lens)
    else:
        inv_freq = inverse_frequencies(rope, theta, head_dim).to(positions.device)
        freqs = positions.float().unsqueeze(1) * inv_freq.unsqueeze(0)
    emb = torch.cat([freqs, freqs], dim=-1)
    scale = rope.attention_factor
    cos, sin = (emb.cos() * scale).unsqueeze(1).to(x.dtype), (emb.sin() * scale).unsqueeze(1).to(x.dtype)
    half = head_dim // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


def span_lengths(positions: torch.Tensor, bounds: list[tuple[int, int]]) -> torch.Tensor:
    """`[N]`: for every token, its row's largest position in the step + 1 (dynamic RoPE's length)."""
    lengths = torch.empty_like(positions)
    for start, end in bounds:
        if end > start:
            lengths[start:end] = positions[start:end].max() + 1
    return lengths
