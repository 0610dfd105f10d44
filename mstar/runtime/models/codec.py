"""A SNAC-like codec decoder: a window of audio codes in, int16 audio samples out.

codes `[T]` -> embedding -> a width-3 conv -> a transposed conv that upsamples every code to
`samples_per_token` samples -> tanh -> int16. The caller picks which part of the decoded window to
keep (Orpheus keeps one frame of each sliding window; see `mstar.runtime.engines.stateless`).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from mstar.runtime.dims import CodecDims


class CodecDecoder(nn.Module):
    def __init__(self, dims: CodecDims):
        super().__init__()
        self.dims = dims
        self.embed = nn.Embedding(dims.codebook, dims.hidden)
        self.conv = nn.Conv1d(dims.hidden, dims.hidden, kernel_size=3, padding=1)
        self.upsample = nn.ConvTranspose1d(dims.hidden, 1, kernel_size=dims.samples_per_token,
                                           stride=dims.samples_per_token)

    def forward(self, codes: torch.Tensor) -> torch.Tensor:
        """codes `[T]` (any integers, taken modulo the codebook) -> int16 samples `[T * samples_per_token]`."""
        x = self.embed(codes.long() % self.dims.codebook).T.unsqueeze(0)  # [1, hidden, T]
        x = F.silu(self.conv(x))
        wave = torch.tanh(self.upsample(x))[0, 0]
        return (wave * 32767.0).round().to(torch.int16)
