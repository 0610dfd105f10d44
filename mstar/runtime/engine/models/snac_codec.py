"""SNAC as the engine's audio codec: a stream of audio tokens in, int16 samples out (Orpheus).

In: token ids, the stream from the window's first token on (windows start at a multiple of a frame).
Out: int16 samples, `samples_per_frame` per frame.

An LLM that speaks through SNAC (Orpheus) writes each frame as `tokens_per_frame` tokens (24 kHz:
7 = 1 + 2 + 4 codes of the three codebooks) in SNAC's depth-first order: the coarse code, then for
each of its halves the middle code followed by the fine codes under it (c0, c1, c2, c2, c1, c2, c2).
Token j of a frame is `token_offset + j * codebook_size + code`, as Orpheus's decoder reads them;
a token outside its slot's range (which a trained model does not emit inside audio) wraps modulo the
codebook, so any token sequence decodes.

Decoding is `SnacDecoder` with its noise blocks drawing from a generator seeded per call from the
node's seed, so a run is reproducible; samples in [-1, 1] become int16 by x 32767 and rounding.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from mstar.plan.dims import SnacDims
from mstar.runtime.engine.models.snac import SnacDecoder


def frame_order(strides: tuple[int, ...]) -> list[int]:
    """The codebook of each token of a frame, in SNAC's depth-first order ((4, 2, 1) -> 0,1,2,2,1,2,2)."""
    order: list[int] = []

    def visit(level: int) -> None:
        order.append(level)
        if level + 1 < len(strides):
            for _ in range(strides[level] // strides[level + 1]):
                visit(level + 1)

    visit(0)
    return order


@dataclass(frozen=True)
class SnacCodecDims:
    snac: SnacDims
    token_offset: int  # the id of code 0 of a frame's first token
    keep_frame: int  # which frame of a sliding window the runner keeps (Orpheus: the 2nd of 4)

    @property
    def tokens_per_frame(self) -> int:
        return len(frame_order(self.snac.vq_strides))

    @property
    def samples_per_frame(self) -> int:
        return self.snac.samples_per_frame


class SnacCodec(nn.Module):
    def __init__(self, dims: SnacCodecDims, seed: int = 0):
        super().__init__()
        self.dims = dims
        self.snac = SnacDecoder(dims.snac)
        self.seed = seed
        self._order = frame_order(dims.snac.vq_strides)

    def codes(self, tokens: torch.Tensor) -> torch.Tensor:
        """Token ids `[n]` (n a multiple of tokens_per_frame) -> codes `[F, tokens_per_frame]`."""
        per_frame = self.dims.tokens_per_frame
        slots = torch.arange(tokens.shape[0]) % per_frame
        codes = (tokens.long() - self.dims.token_offset - slots * self.dims.snac.codebook_size)
        return (codes % self.dims.snac.codebook_size).reshape(-1, per_frame)

    def split(self, frames: torch.Tensor) -> list[torch.Tensor]:
        """Codes `[F, tokens_per_frame]` -> one `[1, F * codes per frame]` tensor per codebook."""
        return [frames[:, [j for j, level in enumerate(self._order) if level == i]].reshape(1, -1)
                for i in range(len(self.dims.snac.vq_strides))]

    def forward(self, frames: torch.Tensor) -> torch.Tensor:
        """Codes `[F, tokens_per_frame]` -> int16 samples `[F * samples_per_frame]`."""
        generator = torch.Generator(device=frames.device).manual_seed(self.seed)
        audio = self.snac(self.split(frames), generator)[0, 0]
        return (audio * 32767.0).round().to(torch.int16)
