"""The SNAC audio decoder (hubertsiuzdak/snac, the 24 kHz model Orpheus speaks through): codes of
its codebooks in, audio out.

In: `codes`, one `[B, n_i]` int tensor per codebook, codebook i at time stride `vq_strides[i]`
(24 kHz: strides 4, 2, 1, so 1, 2 and 4 codes per coarse frame), every codebook covering the same
number of latent steps T = n_i * stride_i. Out: audio `[B, 1, T * prod(decoder_rates)]` in [-1, 1].

The computation is SNAC's `decode`: per codebook, the code's embedding (`codebook_dim` wide)
through a 1x1 conv up to `latent_dim`, repeated `stride` times along time; the sum goes through the
decoder: a (depthwise 7-tap + 1x1, or plain 7-tap) conv to `decoder_dim`, then per rate a decoder
block (Snake, transposed conv upsampling by the rate and halving the channels, a noise block,
three residual units of Snake + dilated conv + Snake + 1x1 conv at dilations 1, 3, 9), then Snake,
a 7-tap conv to one channel and tanh. Snake(x) = x + sin(alpha x)^2 / (alpha + 1e-9).

The noise block adds `randn([B, 1, T]) * conv1x1(x)`, drawn from `generator` in block order; with a
generator seeded as torch's global one, the result equals SNAC's `decode` after `torch.manual_seed`.

Parameter names follow SNAC's state dict (`quantizer.quantizers.{i}.codebook.weight`,
`decoder.model.{j}.block.{k}...`), so its checkpoint loads by name; SNAC's convolutions are
weight-normalised, and `load_snac_state` folds each (g, v) pair into one plain weight. The encoder
and the quantizers' input projections are not needed to decode and are skipped.
"""
from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from mstar.plan.dims import SnacDims
from mstar.runtime.engine.models.layers import ModuleSeq


class Snake(nn.Module):
    def __init__(self, channels: int):
        super().__init__()
        self.alpha = nn.Parameter(torch.ones(1, channels, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + (self.alpha + 1e-9).reciprocal() * torch.sin(self.alpha * x).pow(2)


class NoiseBlock(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.linear = nn.Conv1d(dim, dim, kernel_size=1, bias=False)

    def forward(self, x: torch.Tensor, generator: Optional[torch.Generator]) -> torch.Tensor:
        batch, _, length = x.shape
        noise = torch.randn((batch, 1, length), generator=generator, dtype=x.dtype, device=x.device)
        return x + noise * self.linear(x)


class ResidualUnit(nn.Module):
    def __init__(self, dim: int, dilation: int, groups: int, kernel: int = 7):
        super().__init__()
        pad = ((kernel - 1) * dilation) // 2
        self.block = nn.Sequential(
            Snake(dim),
            nn.Conv1d(dim, dim, kernel_size=kernel, dilation=dilation, padding=pad, groups=groups),
            Snake(dim),
            nn.Conv1d(dim, dim, kernel_size=1),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.block(x)
        trim = (x.shape[-1] - y.shape[-1]) // 2
        if trim > 0:
            x = x[..., trim:-trim]
        return x + y


class DecoderBlock(nn.Module):
    def __init__(self, input_dim: int, output_dim: int, stride: int, has_noise: bool, groups: int):
        super().__init__()
        layers: list[nn.Module] = [
            Snake(input_dim),
            nn.ConvTranspose1d(input_dim, output_dim, kernel_size=2 * stride, stride=stride,
                               padding=math.ceil(stride / 2), output_padding=stride % 2),
        ]
        if has_noise:
            layers.append(NoiseBlock(output_dim))
        layers += [ResidualUnit(output_dim, dilation, groups) for dilation in (1, 3, 9)]
        self.block = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor, generator: Optional[torch.Generator]) -> torch.Tensor:
        for layer in self.block:
            x = layer(x, generator) if isinstance(layer, NoiseBlock) else layer(x)
        return x


class _Decoder(nn.Module):
    def __init__(self, dims: SnacDims):
        super().__init__()
        latent, channels = dims.latent_dim, dims.decoder_dim
        if dims.is_depthwise:
            layers: list[nn.Module] = [nn.Conv1d(latent, latent, kernel_size=7, padding=3, groups=latent),
                                       nn.Conv1d(latent, channels, kernel_size=1)]
        else:
            layers = [nn.Conv1d(latent, channels, kernel_size=7, padding=3)]
        output_dim = channels
        for i, rate in enumerate(dims.decoder_rates):
            input_dim, output_dim = channels // 2 ** i, channels // 2 ** (i + 1)
            layers.append(DecoderBlock(input_dim, output_dim, rate, dims.has_noise,
                                       groups=output_dim if dims.is_depthwise else 1))
        layers += [Snake(output_dim), nn.Conv1d(output_dim, 1, kernel_size=7, padding=3), nn.Tanh()]
        self.model = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor, generator: Optional[torch.Generator]) -> torch.Tensor:
        for layer in self.model:
            x = layer(x, generator) if isinstance(layer, DecoderBlock) else layer(x)
        return x


class _Quantizer(nn.Module):
    """One codebook: its embeddings and the 1x1 conv from `codebook_dim` to `latent_dim`."""

    def __init__(self, dims: SnacDims):
        super().__init__()
        self.codebook = nn.Embedding(dims.codebook_size, dims.codebook_dim)
        self.out_proj = nn.Conv1d(dims.codebook_dim, dims.latent_dim, kernel_size=1)


class _Quantizers(nn.Module):
    """The codebooks, in order (checkpoint names `quantizer.quantizers.N.*`)."""

    def __init__(self, dims: SnacDims):
        super().__init__()
        self.quantizers = ModuleSeq(_Quantizer(dims) for _ in dims.vq_strides)


class SnacDecoder(nn.Module):
    def __init__(self, dims: SnacDims):
        super().__init__()
        self.dims = dims
        self.quantizer = _Quantizers(dims)
        self.decoder = _Decoder(dims)

    def latents(self, codes: list[torch.Tensor]) -> torch.Tensor:
        """Codes (one `[B, n_i]` tensor per codebook) -> latents `[B, latent_dim, T]`."""
        if len(codes) != len(self.dims.vq_strides):
            raise ValueError(f"SNAC takes {len(self.dims.vq_strides)} codebooks, got {len(codes)}")
        z = None
        for quantizer, stride, ids in zip(self.quantizer.quantizers, self.dims.vq_strides, codes):
            embedded = F.embedding(ids.long(), quantizer.codebook.weight).transpose(1, 2)
            part = quantizer.out_proj(embedded).repeat_interleave(stride, dim=-1)
            z = part if z is None else z + part
        if z is None:
            raise ValueError("SNAC has no codebooks (vq_strides is empty)")
        return z

    def forward(self, codes: list[torch.Tensor], generator: Optional[torch.Generator] = None) -> torch.Tensor:
        """Codes -> audio `[B, 1, samples]` (see the module docstring)."""
        return self.decoder(self.latents(codes), generator)


def _weight_norm_pairs(state: dict[str, torch.Tensor]) -> dict[str, tuple[str, str]]:
    """`X.weight` -> the names of its (g, v) pair, in either of torch's weight-norm layouts."""
    pairs = {}
    for name in state:
        if name.endswith(".parametrizations.weight.original0"):
            base = name[: -len(".parametrizations.weight.original0")]
            pairs[base + ".weight"] = (name, base + ".parametrizations.weight.original1")
        elif name.endswith(".weight_g"):
            base = name[: -len(".weight_g")]
            pairs[base + ".weight"] = (name, base + ".weight_v")
    return pairs


def load_snac_state(model: SnacDecoder, state: dict[str, torch.Tensor], source: str) -> None:
    """Copy SNAC's state dict into `model`, folding weight norm (w = g v / |v| over all dims but 0).

    Raises ValueError naming `source` for a missing tensor or a shape that does not fit."""
    pairs = _weight_norm_pairs(state)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name in state:
                tensor = state[name]
            elif name in pairs and all(key in state for key in pairs[name]):
                g, v = (state[key].float() for key in pairs[name])
                tensor = torch._weight_norm(v, g, 0)
            else:
                raise ValueError(f"{source}: no tensor {name} (nor its weight-norm pair)")
            if tuple(tensor.shape) != tuple(param.shape):
                raise ValueError(f"{source}: {name} has shape {tuple(tensor.shape)}, config.json implies "
                                 f"{tuple(param.shape)}")
            param.copy_(tensor.to(param.dtype))
