"""A VAE-like image decoder: a square grid of latents in, an RGB image in [0, 1] out.

latents `[s*s, C]` -> `[C, s, s]` -> conv 3x3 -> SiLU -> nearest upsample by `upscale` -> conv 3x3
-> SiLU -> conv 3x3 to RGB -> sigmoid -> `[3, s*upscale, s*upscale]`.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from mstar.plan.dims import ImageDecoderDims


class ImageDecoder(nn.Module):
    def __init__(self, dims: ImageDecoderDims):
        super().__init__()
        self.dims = dims
        self.conv_in = nn.Conv2d(dims.latent_channels, dims.hidden, 3, padding=1)
        self.conv_mid = nn.Conv2d(dims.hidden, dims.hidden, 3, padding=1)
        self.conv_out = nn.Conv2d(dims.hidden, 3, 3, padding=1)

    def forward(self, latents: torch.Tensor) -> torch.Tensor:
        """latents `[latent_tokens, latent_channels]` -> image `[3, H, W]` in [0, 1]."""
        side = round(self.dims.latent_tokens ** 0.5)
        grid = latents.T.reshape(1, self.dims.latent_channels, side, side)
        x = F.silu(self.conv_in(grid))
        x = F.interpolate(x, scale_factor=self.dims.upscale, mode="nearest")
        x = F.silu(self.conv_mid(x))
        return torch.sigmoid(self.conv_out(x))[0]
