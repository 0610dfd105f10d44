"""Reading WAV audio -> 16 kHz mono float samples: a prompts line's `audio` file, or the bytes of
an upload (`mstar serve`'s /v1/audio/transcriptions).

In: a path (`read_wav`, read through mstar.files.read_bytes_bounded: a regular file of at most
MAX_AUDIO_BYTES), or bytes and what to call them in messages (`decode_wav`). Out: a 1-D float32
tensor in [-1, 1], channels averaged, or a `WavError` naming the file and the problem. Accepted:
RIFF/WAVE with PCM integer samples of 8 (unsigned), 16, 24 or 32 bits, or IEEE float of 32 or 64
bits (also inside WAVE_FORMAT_EXTENSIBLE), at 16000 Hz (what Whisper's front end takes; another
rate is refused rather than resampled silently). Chunks other than `fmt ` and `data` are skipped;
a chunk running past the end of the file is refused, and so is a file of no samples (`read_wav`;
an upload's caller says so in its own words).
"""
from __future__ import annotations

import struct
from typing import Optional

import numpy as np
import torch

from mstar.files import MAX_AUDIO_BYTES, InputFileError, read_bytes_bounded
from mstar.runtime.serve.media_values import MAX_SAMPLE

SAMPLE_RATE = 16_000
PCM, FLOAT, EXTENSIBLE = 1, 3, 0xFFFE


class WavError(ValueError):
    """A WAV file that cannot be read as 16 kHz audio (the message names the file)."""


class WavTooLong(WavError):
    """A WAV file whose header holds more samples than the caller takes, refused before decoding."""

    def __init__(self, where: str, num_samples: int):
        super().__init__(f"{where}: {num_samples} samples, more than taken")
        self.num_samples = num_samples


def read_wav(path: str) -> torch.Tensor:
    try:
        data = read_bytes_bounded(path, max_bytes=MAX_AUDIO_BYTES, what="audio file")
    except InputFileError as error:
        raise WavError(str(error)) from None
    samples = decode_wav(data, f"audio file {path}")
    if not samples.numel():  # (a prompts line's empty clip ran and failed in the audio encoder, its line unnamed)
        raise WavError(f"audio file {path}: the WAV file holds no samples")
    return samples


def decode_wav(data: bytes, where: str, sample_rate: int = SAMPLE_RATE,
               max_samples: Optional[int] = None) -> torch.Tensor:
    """The samples of a WAV file's bytes; `where` starts every message ("audio file x.wav");
    `sample_rate`: the rate the audio input takes (another is refused, never resampled);
    `max_samples`: past it, `WavTooLong` from the header's count, before any decoding (a 64 MiB
    8-bit upload refused as too long took 0.9 GB to decode first)."""
    if len(data) < 12 or data[:4] != b"RIFF" or data[8:12] != b"WAVE":
        raise WavError(f"{where}: not a WAV file (no RIFF/WAVE header)")
    chunks = _chunks(data, where)
    if "fmt " not in chunks or "data" not in chunks:
        raise WavError(f"{where}: a WAV file needs a `fmt ` and a `data` chunk")
    fmt = chunks["fmt "]
    if len(fmt) < 16:
        raise WavError(f"{where}: its fmt chunk is {len(fmt)} bytes, too short")
    kind, channels, rate, _, block, bits = struct.unpack("<HHIIHH", fmt[:16])
    if kind == EXTENSIBLE and len(fmt) >= 26:
        kind = struct.unpack("<H", fmt[24:26])[0]  # the sub-format GUID starts with the format code
    if rate != sample_rate:
        raise WavError(f"{where}: {rate} Hz; the audio input takes {sample_rate} Hz (resample it first)")
    # (0 bits and block 0 passed the rest: a ZeroDivisionError below)
    if channels < 1 or bits < 8 or block != channels * (bits // 8) or bits % 8:
        raise WavError(f"{where}: inconsistent fmt chunk ({channels} channels, {bits} bits, block {block})")
    num_samples = len(chunks["data"]) // block
    if max_samples is not None and num_samples > max_samples:
        raise WavTooLong(where, num_samples)
    samples = _decode(chunks["data"], kind, bits, where)
    usable = samples.shape[0] - samples.shape[0] % channels
    frames = samples[:usable].reshape(-1, channels)
    # one channel is taken as it is: its mean made another float64 copy (with _scaled's in-place
    # division, decoding a 60 MB file peaks 0.46 GB above the interpreter's memory, not 0.69)
    mono = frames[:, 0] if channels == 1 else frames.mean(axis=1)
    return torch.from_numpy(mono.astype(np.float32))


def _chunks(data: bytes, where: str) -> dict[str, bytes]:
    chunks: dict[str, bytes] = {}
    offset = 12
    while offset + 8 <= len(data):
        name = data[offset:offset + 4].decode("latin-1")
        size = struct.unpack("<I", data[offset + 4:offset + 8])[0]
        if offset + 8 + size > len(data):
            raise WavError(f"{where}: chunk {name!r} runs past the end of the file (truncated?)")
        chunks.setdefault(name, data[offset + 8:offset + 8 + size])
        offset += 8 + size + (size % 2)  # chunks are padded to an even size
    return chunks


def _decode(raw: bytes, kind: int, bits: int, where: str) -> np.ndarray:
    if kind == FLOAT and bits in (32, 64):
        floats = np.frombuffer(raw[:len(raw) - len(raw) % (bits // 8)], dtype=np.float32 if bits == 32 else np.float64)
        if not np.isfinite(floats).all():
            raise WavError(f"{where}: float samples that are NaN or infinite")
        peak = float(np.abs(floats).max()) if floats.size else 0.0
        if peak > MAX_SAMPLE:  # 1e30 passed, and its log-mel energies overflowed to NaN: a transcript of nothing
            raise WavError(f"{where}: float samples reach {peak:.3g}; a float WAV holds samples in [-1, 1] (at most "
                           f"{MAX_SAMPLE:g} is taken)")
        return floats.astype(np.float64)
    if kind != PCM or bits not in (8, 16, 24, 32):
        raise WavError(f"{where}: format {kind} with {bits} bits; read are PCM 8/16/24/32 and float 32/64")
    width = bits // 8
    raw = raw[:len(raw) - len(raw) % width]
    if bits == 8:
        centred = np.frombuffer(raw, dtype=np.uint8).astype(np.float64)
        centred -= 128.0  # (in place: `- 128.0` made a second float64 copy of the clip)
        return _scaled(centred, 128.0)
    if bits == 24:
        triples = np.frombuffer(raw, dtype=np.uint8).reshape(-1, 3).astype(np.int32)
        packed = triples[:, 0] | (triples[:, 1] << 8) | (triples[:, 2] << 16)
        signed = np.where(packed >= 1 << 23, packed - (1 << 24), packed)
        return _scaled(signed.astype(np.float64), float(1 << 23))
    dtype = np.int16 if bits == 16 else np.int32
    return _scaled(np.frombuffer(raw, dtype=dtype).astype(np.float64), float(1 << (bits - 1)))


def _scaled(samples: np.ndarray, full_scale: float) -> np.ndarray:
    """`samples / full_scale` in place (a second float64 copy of a long clip is what ran out of memory)."""
    samples /= full_scale
    return samples
