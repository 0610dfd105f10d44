"""Whisper's log-mel front end, as transformers' WhisperFeatureExtractor computes it.

In: 16 kHz mono samples (a 1-D float tensor). Out: `[num_mel_bins, 3000]` features for one 30 s
window (`log_mel`), or `[num_mel_bins, len // 160]` for a whole long clip (`log_mel_frames`, the
extractor with truncation off): the samples cut or zero-padded to 480000 (not for a whole clip), a
centred STFT (n_fft 400, hop 160, periodic Hann window, reflect padding), power spectrum without
the last frame, a Slaney-normalised mel filter bank on the Slaney mel scale (0 to 8 kHz, built in
float64 then used in float32), log10 of the energies clamped at 1e-10, floored at the maximum
minus 8, then (x + 4) / 4.
"""
from __future__ import annotations

import math

import torch

SAMPLE_RATE = 16_000
N_FFT = 400
HOP_LENGTH = 160
CHUNK_SECONDS = 30
NUM_SAMPLES = SAMPLE_RATE * CHUNK_SECONDS  # 480000: one window
NUM_FRAMES = NUM_SAMPLES // HOP_LENGTH  # 3000

_MIN_LOG_HERTZ = 1000.0
_MIN_LOG_MEL = 15.0
_LOG_STEP = math.log(6.4) / 27.0


def _hertz_to_mel(hertz: torch.Tensor) -> torch.Tensor:
    mels = 3.0 * hertz / 200.0
    log_region = hertz >= _MIN_LOG_HERTZ
    return torch.where(log_region, _MIN_LOG_MEL + torch.log(hertz / _MIN_LOG_HERTZ) / _LOG_STEP, mels)


def _mel_to_hertz(mels: torch.Tensor) -> torch.Tensor:
    hertz = 200.0 * mels / 3.0
    log_region = mels >= _MIN_LOG_MEL
    return torch.where(log_region, _MIN_LOG_HERTZ * torch.exp(_LOG_STEP * (mels - _MIN_LOG_MEL)), hertz)


def mel_filters(num_mel_bins: int) -> torch.Tensor:
    """`[num_frequency_bins, num_mel_bins]` Slaney filters (librosa's `filters.mel(norm="slaney")`)."""
    num_bins = 1 + N_FFT // 2
    bounds = _hertz_to_mel(torch.tensor([0.0, 8000.0], dtype=torch.float64))
    filter_freqs = _mel_to_hertz(torch.linspace(float(bounds[0]), float(bounds[1]), num_mel_bins + 2,
                                                dtype=torch.float64))
    fft_freqs = torch.linspace(0, SAMPLE_RATE // 2, num_bins, dtype=torch.float64)
    diff = filter_freqs[1:] - filter_freqs[:-1]
    slopes = filter_freqs.unsqueeze(0) - fft_freqs.unsqueeze(1)
    down = -slopes[:, :-2] / diff[:-1]
    up = slopes[:, 2:] / diff[1:]
    filters = torch.clamp(torch.minimum(down, up), min=0.0)
    return filters * (2.0 / (filter_freqs[2:] - filter_freqs[:-2])).unsqueeze(0)


def log_mel(samples: torch.Tensor, num_mel_bins: int) -> torch.Tensor:
    """16 kHz samples -> `[num_mel_bins, 3000]` features of their first 30 s (module docstring)."""
    audio = torch.zeros(NUM_SAMPLES, dtype=torch.float32)
    clip = samples.reshape(-1)[:NUM_SAMPLES].to(torch.float32)
    audio[:clip.shape[0]] = clip
    return log_mel_frames(audio, num_mel_bins)


def log_mel_frames(samples: torch.Tensor, num_mel_bins: int) -> torch.Tensor:
    """16 kHz samples as they are, neither cut nor padded -> `[num_mel_bins, len // 160]` features,
    floored at the whole clip's maximum minus 8 (the feature extractor with truncation off, as
    long-form transcription takes them; runners/whisper_windows.py cuts the windows)."""
    audio = samples.reshape(-1).to(torch.float32)
    stft = torch.stft(audio, N_FFT, HOP_LENGTH, window=torch.hann_window(N_FFT), return_complex=True)
    power = (stft[..., :-1].abs() ** 2).contiguous()
    energies = mel_filters(num_mel_bins).to(torch.float32).T @ power
    logs = torch.clamp(energies, min=1e-10).log10()
    logs = torch.maximum(logs, logs.max() - 8.0)
    return (logs + 4.0) / 4.0
