"""Whisper's audio encoder and its cross-attending text decoder, as transformers computes them.

Encoder: log-mel features `[num_mel_bins, 2 * num_positions]` -> conv1 (kernel 3) -> GELU -> conv2
(kernel 3, stride 2) -> GELU -> + position table -> pre-norm layers (self-attention, GELU MLP) ->
LayerNorm -> states `[num_positions, hidden]`.
Decoder, one request at a time: token ids -> embedding + learned position -> pre-norm layers
(causal self-attention over the request's cached keys and values, cross-attention over its
cross-attention pool, GELU MLP) -> LayerNorm -> logits by the tied embedding. `cross_pool(states)`
projects the encoder's states into each layer's keys and values once (the plan's `cross_kv` pool).

Parameter names follow transformers' `WhisperForConditionalGeneration` below `model.encoder.` and
`model.decoder.` (mstar/runtime/engine/whisper_checkpoint.py loads them by name). q, v and out
projections have biases, k projections none; LayerNorm eps 1e-5; exact (erf) GELU.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class WhisperEncoderDims:
    num_mel_bins: int
    hidden: int
    num_layers: int
    num_heads: int
    ffn: int
    num_positions: int  # states per 30 s window (1500); the features have twice as many frames


@dataclass(frozen=True)
class WhisperDecoderDims:
    hidden: int
    num_layers: int
    num_heads: int
    ffn: int
    vocab: int
    num_positions: int  # the learned position table: the longest decoder sequence (448)


class _Attention(nn.Module):
    def __init__(self, hidden: int, num_heads: int):
        super().__init__()
        self.num_heads = num_heads
        self.q_proj = nn.Linear(hidden, hidden)
        self.k_proj = nn.Linear(hidden, hidden, bias=False)
        self.v_proj = nn.Linear(hidden, hidden)
        self.out_proj = nn.Linear(hidden, hidden)

    def heads(self, x: torch.Tensor) -> torch.Tensor:
        """`[n, hidden]` -> `[heads, n, head_dim]`."""
        return x.view(x.shape[0], self.num_heads, -1).transpose(0, 1)

    def keys_values(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.heads(self.k_proj(x)), self.heads(self.v_proj(x))

    def attend(self, x: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, is_causal: bool) -> torch.Tensor:
        """Queries from `x` `[n, hidden]` over `keys`/`values` `[heads, s, head_dim]`; causal: query i
        sits at position s - n + i."""
        q = self.heads(self.q_proj(x))
        mask = None
        if is_causal and x.shape[0] > 1:
            offset = keys.shape[1] - x.shape[0]
            mask = torch.ones(x.shape[0], keys.shape[1], dtype=torch.bool).tril(offset)
        out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask)
        return self.out_proj(out.transpose(0, 1).reshape(x.shape[0], -1))


class _EncoderLayer(nn.Module):
    def __init__(self, hidden: int, num_heads: int, ffn: int):
        super().__init__()
        self.self_attn = _Attention(hidden, num_heads)
        self.self_attn_layer_norm = nn.LayerNorm(hidden)
        self.fc1 = nn.Linear(hidden, ffn)
        self.fc2 = nn.Linear(ffn, hidden)
        self.final_layer_norm = nn.LayerNorm(hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.self_attn_layer_norm(x)
        x = x + self.self_attn.attend(h, *self.self_attn.keys_values(h), is_causal=False)
        return x + self.fc2(F.gelu(self.fc1(self.final_layer_norm(x))))


class WhisperEncoder(nn.Module):
    def __init__(self, dims: WhisperEncoderDims):
        super().__init__()
        self.dims = dims
        self.conv1 = nn.Conv1d(dims.num_mel_bins, dims.hidden, kernel_size=3, padding=1)
        self.conv2 = nn.Conv1d(dims.hidden, dims.hidden, kernel_size=3, stride=2, padding=1)
        self.embed_positions = nn.Embedding(dims.num_positions, dims.hidden)
        self.layers = nn.ModuleList(_EncoderLayer(dims.hidden, dims.num_heads, dims.ffn)
                                    for _ in range(dims.num_layers))
        self.layer_norm = nn.LayerNorm(dims.hidden)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        """features `[num_mel_bins, 2 * num_positions]` -> states `[num_positions, hidden]`."""
        x = F.gelu(self.conv2(F.gelu(self.conv1(features.unsqueeze(0))))).squeeze(0).T
        x = x + self.embed_positions.weight[:x.shape[0]]
        for layer in self.layers:
            x = layer(x)
        return self.layer_norm(x)


def sinusoids(num_positions: int, hidden: int) -> torch.Tensor:
    """The encoder's fixed position table (what a checkpoint stores as `embed_positions.weight`)."""
    increment = torch.log(torch.tensor(10000.0)) / (hidden // 2 - 1)
    inverse = torch.exp(-increment * torch.arange(hidden // 2))
    scaled = torch.arange(num_positions).view(-1, 1) * inverse.view(1, -1)
    return torch.cat([scaled.sin(), scaled.cos()], dim=1)


class _DecoderLayer(nn.Module):
    def __init__(self, hidden: int, num_heads: int, ffn: int):
        super().__init__()
        self.self_attn = _Attention(hidden, num_heads)
        self.self_attn_layer_norm = nn.LayerNorm(hidden)
        self.encoder_attn = _Attention(hidden, num_heads)
        self.encoder_attn_layer_norm = nn.LayerNorm(hidden)
        self.fc1 = nn.Linear(hidden, ffn)
        self.fc2 = nn.Linear(ffn, hidden)
        self.final_layer_norm = nn.LayerNorm(hidden)


@dataclass
class WhisperKv:
    """One request's keys and values on the decoder: the self-attention cache per layer (grown by
    every call) and the cross-attention pool per layer (filled once from the encoder's states)."""

    self_keys: list[torch.Tensor]
    self_values: list[torch.Tensor]
    cross: Optional[list[tuple[torch.Tensor, torch.Tensor]]] = None

    @property
    def num_tokens(self) -> int:
        return self.self_keys[0].shape[1] if self.self_keys else 0


class WhisperDecoder(nn.Module):
    def __init__(self, dims: WhisperDecoderDims):
        super().__init__()
        self.dims = dims
        self.embed_tokens = nn.Embedding(dims.vocab, dims.hidden)
        self.embed_positions = nn.Embedding(dims.num_positions, dims.hidden)
        self.layers = nn.ModuleList(_DecoderLayer(dims.hidden, dims.num_heads, dims.ffn)
                                    for _ in range(dims.num_layers))
        self.layer_norm = nn.LayerNorm(dims.hidden)

    def empty_kv(self) -> WhisperKv:
        empty = torch.zeros(self.dims.num_heads, 0, self.dims.hidden // self.dims.num_heads)
        return WhisperKv([empty] * self.dims.num_layers, [empty] * self.dims.num_layers)

    def cross_pool(self, states: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Each layer's cross-attention keys and values from encoder states `[s, hidden]`."""
        return [layer.encoder_attn.keys_values(states) for layer in self._layers()]

    def forward(self, tokens: torch.Tensor, kv: WhisperKv) -> torch.Tensor:
        """New token ids `[n]` of one request -> their last hidden states `[n, hidden]`; extends `kv`."""
        if kv.cross is None:
            raise ValueError("the request's cross-attention pool is not filled")
        start = kv.num_tokens
        x = self.embed_tokens(tokens) + self.embed_positions.weight[start:start + tokens.shape[0]]
        for index, layer in enumerate(self._layers()):
            h = layer.self_attn_layer_norm(x)
            keys, values = layer.self_attn.keys_values(h)
            kv.self_keys[index] = torch.cat([kv.self_keys[index], keys], dim=1)
            kv.self_values[index] = torch.cat([kv.self_values[index], values], dim=1)
            x = x + layer.self_attn.attend(h, kv.self_keys[index], kv.self_values[index], is_causal=True)
            cross_keys, cross_values = kv.cross[index]
            x = x + layer.encoder_attn.attend(layer.encoder_attn_layer_norm(x), cross_keys, cross_values,
                                              is_causal=False)
            x = x + layer.fc2(F.gelu(layer.fc1(layer.final_layer_norm(x))))
        return self.layer_norm(x)

    def _layers(self) -> list[_DecoderLayer]:
        return [layer for layer in self.layers if isinstance(layer, _DecoderLayer)]

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The LM head is the token embedding (Whisper ties them)."""
        return hidden @ self.embed_tokens.weight.T
