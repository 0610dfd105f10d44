"""A SNAC-like codec decoder: frames of audio codes in, int16 audio samples out.

codes `[F, Q]` (F frames of Q quantizer codes) -> the sum of Q codebook embeddings per frame -> a
width-3 conv -> a transposed conv that upsamples every frame to `samples_per_token` samples -> tanh
-> int16. The caller picks which part of the decoded window to keep (Orpheus keeps one frame of
each sliding window; see `mstar.runtime.engine.runners.stateless`).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from mstar.plan.dims import CodecDims


class CodecDecoder(nn.Module):
    def __init__(self, dims: CodecDims):
        super().__init__()
        self.dims = dims
        self.embed = nn.Embedding(dims.num_quantizers * dims.codebook, dims.hidden)
        self.conv = nn.Conv1d(dims.hidden, dims.hidden, kernel_size=3, padding=1)
        self.upsample = nn.ConvTranspose1d(dims.hidden, 1, kernel_size=dims.samples_per_token,
                                           stride=dims.samples_per_token)

    def frames(self, codes: torch.Tensor) -> torch.Tensor:
        """Flat codes `[n]` -> `[F, Q]`, repeating the last code to fill a partial frame."""
        q = self.dims.num_quantizers
        if codes.shape[0] % q:
            codes = torch.cat([codes, codes[-1:].expand(q - codes.shape[0] % q)])
        return codes.reshape(-1, q)

    def forward(self, frames: torch.Tensor) -> torch.Tensor:
        """frames `[F, Q]` (any integers, taken modulo the codebook) -> int16 samples `[F * samples_per_token]`."""
        offsets = torch.arange(self.dims.num_quantizers) * self.dims.codebook
        x = self.embed(frames.long() % self.dims.codebook + offsets).sum(1).T.unsqueeze(0)  # [1, hidden, F]
        x = F.silu(self.conv(x))
        wave = torch.tanh(self.upsample(x))[0, 0]
        return (wave * 32767.0).round().to(torch.int16)
