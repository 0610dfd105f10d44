"""Qwen3-ASR's audio front end and audio encoder, as transformers' `qwen3_asr` computes them.

Front end (`features(samples, num_mel_bins)`, Qwen3ASRFeatureExtractor as its processor calls it:
no 30 s padding): 16 kHz samples zero-padded to at least MIN_SAMPLES, Whisper's log-mel over the
whole clip (models/log_mel.py: centred STFT n_fft 400 hop 160, power without the last frame, Slaney
filters, log10 clamped at 1e-10, floored at the clip's maximum - 8, (x + 4) / 4), then the frame
axis zero-padded (in log-mel units) to a multiple of CHUNK_FRAMES. Out: `[num_mel_bins, padded]`
features and the number of valid frames (`num_samples // 160`).

Encoder (`Qwen3AsrEncoder`, parameter names of transformers' `Qwen3ASREncoder` below
`model.audio_tower.` and of its projector below `model.multi_modal_projector.`): the features cut
into chunks of CHUNK_FRAMES frames; each chunk through three 3x3 stride-2 Conv2d + GELU over
(mel, time), flattened per time step and projected (`conv_out`, no bias) to `hidden`, plus a
sinusoid position table restarting in every chunk (13 steps per full chunk); only the time steps
that valid frames reach are kept; pre-norm layers (self-attention with biases, GELU MLP) attend
within windows of `window_states` states (n_window_infer / CHUNK_FRAMES chunks); `ln_post`; then
the projector (Linear, GELU, Linear) to the text model's width. Out: `[num_states, output_dim]`,
`num_states(num_samples)` of them: the states that replace the prompt's audio placeholders.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from mstar.runtime.engine.models.log_mel import HOP_LENGTH, N_FFT, mel_filters
from mstar.runtime.engine.models.whisper import sinusoids

MIN_SAMPLES = 8000  # shorter clips are zero-padded first (the original library's 0.5 s)
N_WINDOW = 50  # the front end's and the encoder's `n_window`: half a chunk
CHUNK_FRAMES = 2 * N_WINDOW  # 1 s of frames per conv chunk
STATES_PER_CHUNK = 13  # time steps a full chunk leaves after three stride-2 convs


def _after_convs(num_frames: int) -> int:
    """Time steps that `num_frames` frames of one chunk reach through three (k 3, s 2, p 1) convs."""
    for _ in range(3):
        num_frames = (num_frames - 1) // 2 + 1 if num_frames > 0 else 0
    return num_frames


def num_frames(num_samples: int) -> int:
    """Valid feature frames of a clip of `num_samples` samples (after the MIN_SAMPLES padding)."""
    return max(num_samples, MIN_SAMPLES) // HOP_LENGTH


def num_states(num_samples: int) -> int:
    """Encoder states (= audio placeholders in the prompt) of a clip of `num_samples` samples."""
    frames = num_frames(num_samples)
    return (frames // CHUNK_FRAMES) * STATES_PER_CHUNK + _after_convs(frames % CHUNK_FRAMES)


def features(samples: torch.Tensor, num_mel_bins: int) -> tuple[torch.Tensor, int]:
    """16 kHz samples -> (`[num_mel_bins, padded frames]` features, valid frames) (module docstring)."""
    audio = samples.reshape(-1).to(torch.float32)
    if audio.shape[0] < MIN_SAMPLES:
        audio = F.pad(audio, (0, MIN_SAMPLES - audio.shape[0]))
    stft = torch.stft(audio, N_FFT, HOP_LENGTH, window=torch.hann_window(N_FFT), return_complex=True)
    power = stft[..., :-1].abs() ** 2
    energies = mel_filters(num_mel_bins).to(torch.float32).T @ power
    logs = torch.clamp(energies, min=1e-10).log10()
    logs = (torch.maximum(logs, logs.max() - 8.0) + 4.0) / 4.0
    valid = logs.shape[1]
    return F.pad(logs, (0, -valid % CHUNK_FRAMES)), valid


@dataclass(frozen=True)
class Qwen3AsrEncoderDims:
    num_mel_bins: int
    hidden: int  # d_model
    num_layers: int
    num_heads: int
    ffn: int
    conv_channels: int  # downsample_hidden_size
    output_dim: int  # the projector's output: the text model's hidden size
    window_chunks: int = 8  # n_window_infer / CHUNK_FRAMES: attention windows span this many chunks
    num_positions: int = STATES_PER_CHUNK  # the per-chunk sinusoid table


class _Attention(nn.Module):
    def __init__(self, hidden: int, num_heads: int):
        super().__init__()
        self.num_heads = num_heads
        self.q_proj = nn.Linear(hidden, hidden)
        self.k_proj = nn.Linear(hidden, hidden)
        self.v_proj = nn.Linear(hidden, hidden)
        self.out_proj = nn.Linear(hidden, hidden)

    def forward(self, x: torch.Tensor, window: int) -> torch.Tensor:
        """`[n, hidden]` -> `[n, hidden]`: full attention inside consecutive windows of `window` states."""
        n = x.shape[0]
        q, k, v = (proj(x).view(n, self.num_heads, -1).transpose(0, 1) for proj in (self.q_proj, self.k_proj,
                                                                                    self.v_proj))
        outs = [F.scaled_dot_product_attention(q[:, s:s + window], k[:, s:s + window], v[:, s:s + window])
                for s in range(0, n, window)]
        return self.out_proj(torch.cat(outs, dim=1).transpose(0, 1).reshape(n, -1))


class _Layer(nn.Module):
    def __init__(self, hidden: int, num_heads: int, ffn: int):
        super().__init__()
        self.self_attn = _Attention(hidden, num_heads)
        self.self_attn_layer_norm = nn.LayerNorm(hidden)
        self.fc1 = nn.Linear(hidden, ffn)
        self.fc2 = nn.Linear(ffn, hidden)
        self.final_layer_norm = nn.LayerNorm(hidden)

    def forward(self, x: torch.Tensor, window: int) -> torch.Tensor:
        x = x + self.self_attn(self.self_attn_layer_norm(x), window)
        return x + self.fc2(F.gelu(self.fc1(self.final_layer_norm(x))))


class AudioTower(nn.Module):
    """transformers' `Qwen3ASREncoder` (the parameters below `model.audio_tower.`)."""

    def __init__(self, dims: Qwen3AsrEncoderDims):
        super().__init__()
        self.dims = dims
        channels = dims.conv_channels
        self.conv2d1 = nn.Conv2d(1, channels, 3, 2, padding=1)
        self.conv2d2 = nn.Conv2d(channels, channels, 3, 2, padding=1)
        self.conv2d3 = nn.Conv2d(channels, channels, 3, 2, padding=1)
        freq_bins = (((dims.num_mel_bins + 1) // 2 + 1) // 2 + 1) // 2
        self.conv_out = nn.Linear(channels * freq_bins, dims.hidden, bias=False)
        self.layers = nn.ModuleList(_Layer(dims.hidden, dims.num_heads, dims.ffn) for _ in range(dims.num_layers))
        self.ln_post = nn.LayerNorm(dims.hidden)
        # not a parameter: transformers computes it (a non-persistent buffer), no checkpoint holds it
        self.register_buffer("positions", sinusoids(dims.num_positions, dims.hidden), persistent=False)

    def forward(self, feats: torch.Tensor, num_valid: int) -> torch.Tensor:
        """features `[num_mel_bins, k * CHUNK_FRAMES]` of which `num_valid` frames are valid -> states."""
        num_chunks = feats.shape[1] // CHUNK_FRAMES
        chunks = feats.view(feats.shape[0], num_chunks, CHUNK_FRAMES).permute(1, 0, 2).unsqueeze(1)
        x = F.gelu(self.conv2d3(F.gelu(self.conv2d2(F.gelu(self.conv2d1(chunks))))))
        x = self.conv_out(x.permute(0, 3, 1, 2).flatten(2))  # [chunks, steps, hidden]
        positions = self.positions
        assert isinstance(positions, torch.Tensor)  # a buffer (mypy sees Module attributes as Tensor | Module)
        x = x + positions[:x.shape[1]]
        kept = [x[c, :_after_convs(min(CHUNK_FRAMES, max(num_valid - c * CHUNK_FRAMES, 0)))]
                for c in range(num_chunks)]
        states = torch.cat(kept)
        # windows span `window_chunks` chunks of the longest chunk's steps (transformers' cu_seqlens)
        longest = max(k.shape[0] for k in kept)
        window = max(longest * self.dims.window_chunks, 1)
        for layer in self.layers:
            states = layer(states, window)
        return self.ln_post(states)


class Projector(nn.Module):
    """transformers' `Qwen3ASRMultiModalProjector` (below `model.multi_modal_projector.`)."""

    def __init__(self, hidden: int, output_dim: int):
        super().__init__()
        self.linear_1 = nn.Linear(hidden, hidden)
        self.linear_2 = nn.Linear(hidden, output_dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_2(F.gelu(self.linear_1(x)))


class Qwen3AsrEncoder(nn.Module):
    """Audio tower + projector: 16 kHz samples -> `[num_states(len), output_dim]` prompt embeddings."""

    def __init__(self, dims: Qwen3AsrEncoderDims):
        super().__init__()
        self.dims = dims
        self.audio_tower = AudioTower(dims)
        self.multi_modal_projector = Projector(dims.hidden, dims.output_dim)

    def forward(self, samples: torch.Tensor) -> torch.Tensor:
        feats, num_valid = features(samples, self.dims.num_mel_bins)
        return self.multi_modal_projector(self.audio_tower(feats, num_valid))
