"""Small media encoders (vision patches or audio frames in, embeddings out) for BAGEL and Qwen3-Omni.

features `[n, feature_dim]` -> a linear patch/frame embedding plus a learned position table ->
`num_layers` pre-norm transformer blocks with bidirectional attention -> one linear head per output
of the node (BAGEL's `img_emb`; Qwen3-Omni's `vision_embeds`, `deepstack`), in the node's output
order, each sized for the node it feeds.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from mstar.plan.dims import EncoderDims

MAX_POSITIONS = 4096


class _Block(nn.Module):
    def __init__(self, hidden: int, num_heads: int):
        super().__init__()
        self.num_heads = num_heads
        self.norm1 = nn.LayerNorm(hidden)
        self.qkv = nn.Linear(hidden, 3 * hidden)
        self.proj = nn.Linear(hidden, hidden)
        self.norm2 = nn.LayerNorm(hidden)
        self.fc1 = nn.Linear(hidden, 4 * hidden)
        self.fc2 = nn.Linear(4 * hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n, hidden = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(n, 3, self.num_heads, hidden // self.num_heads).unbind(1)
        attn = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1))
        x = x + self.proj(attn.transpose(0, 1).reshape(n, hidden))
        return x + self.fc2(F.gelu(self.fc1(self.norm2(x))))


class MediaEncoder(nn.Module):
    def __init__(self, dims: EncoderDims, output_widths: list[int]):
        """`output_widths`: the embedding width of each output, in the node's output order."""
        super().__init__()
        self.dims = dims
        self.embed = nn.Linear(dims.feature_dim, dims.hidden)
        self.positions = nn.Parameter(torch.zeros(MAX_POSITIONS, dims.hidden))
        self.blocks = nn.ModuleList(_Block(dims.hidden, dims.num_heads) for _ in range(dims.num_layers))
        self.norm = nn.LayerNorm(dims.hidden)
        self.heads = nn.ModuleList(nn.Linear(dims.hidden, width) for width in output_widths)

    def forward(self, features: torch.Tensor) -> list[torch.Tensor]:
        """features `[n, feature_dim]` (n <= 4096) -> one `[n, width]` per output, in order."""
        x = self.embed(features) + self.positions[:features.shape[0]]
        for block in self.blocks:
            x = block(x)
        x = self.norm(x)
        return [head(x) for head in self.heads]
