"""Media writers for `mstar run --out DIR`: audio chunks to WAV, image tensors to PNG.

`wav_bytes(chunks, sample_rate)`: int16 (or float in [-1, 1]) sample tensors/lists, in order,
concatenated into one mono 16-bit WAV (stdlib `wave`). `png_bytes(image)`: a `[3, H, W]` (or
`[H, W, 3]`) tensor in [0, 1] as an 8-bit RGB PNG (matplotlib's writer, which brings PIL).
Both encode in memory; `write_wav` / `write_png` then replace the file atomically
(mstar.files.atomic_write_bytes: a temporary name beside it, then a rename), so a file under its
final name is always whole, and a failed write (a full disk) raises an OSError naming the file.
`is_audio` / `is_image` tell a client emission's kind from its value when its modality is absent.
"""
from __future__ import annotations

import io
import wave
from pathlib import Path
from typing import Any, Iterable

import numpy as np
import torch

from mstar.files import atomic_write_bytes

DEFAULT_SAMPLE_RATE = 24000


def _as_int16(chunk: Any) -> np.ndarray:
    array = chunk.detach().cpu().numpy() if isinstance(chunk, torch.Tensor) else np.asarray(chunk)
    array = array.reshape(-1)
    if array.dtype.kind == "f":
        array = np.clip(array, -1.0, 1.0) * 32767.0
    return array.astype(np.int16)


def pcm_bytes(chunk: Any) -> bytes:
    """One audio chunk as little-endian 16-bit PCM bytes (a streamed window of audio)."""
    return _as_int16(chunk).astype("<i2").tobytes()


def wav_bytes(chunks: Iterable[Any], sample_rate: int = DEFAULT_SAMPLE_RATE) -> tuple[bytes, int]:
    """The concatenated chunks as a mono 16-bit PCM WAV file's bytes, and the number of samples."""
    samples = [_as_int16(c) for c in chunks]
    data = np.concatenate(samples) if samples else np.zeros(0, dtype=np.int16)
    buffer = io.BytesIO()
    with wave.open(buffer, "wb") as out:
        out.setnchannels(1)
        out.setsampwidth(2)
        out.setframerate(sample_rate)
        out.writeframes(data.astype("<i2").tobytes())
    return buffer.getvalue(), int(data.shape[0])


def write_wav(path: str | Path, chunks: Iterable[Any], sample_rate: int = DEFAULT_SAMPLE_RATE) -> int:
    """Write the concatenated chunks as mono 16-bit PCM; returns the number of samples written."""
    data, num_samples = wav_bytes(chunks, sample_rate)
    atomic_write_bytes(path, data)
    return num_samples


def png_bytes(image: Any) -> tuple[bytes, tuple[int, int]]:
    """An RGB image in [0, 1] (`[3, H, W]` or `[H, W, 3]`) as PNG bytes, and its (height, width)."""
    from PIL import Image  # (matplotlib's imsave wrote RGBA: an alpha channel no image of ours has)

    array = image.detach().cpu().float().numpy() if isinstance(image, torch.Tensor) else np.asarray(image, dtype=float)
    if array.ndim == 3 and array.shape[0] == 3 and array.shape[-1] != 3:
        array = array.transpose(1, 2, 0)
    if array.ndim != 3 or array.shape[-1] != 3:
        raise ValueError(f"an image must be [3, H, W] or [H, W, 3], got shape {array.shape}")
    buffer = io.BytesIO()
    Image.fromarray((np.clip(array, 0.0, 1.0) * 255).round().astype(np.uint8)).save(buffer, format="png")
    return buffer.getvalue(), (int(array.shape[0]), int(array.shape[1]))


def write_png(path: str | Path, image: Any) -> tuple[int, int]:
    """Write an RGB image in [0, 1] (`[3, H, W]` or `[H, W, 3]`); returns (height, width)."""
    data, shape = png_bytes(image)
    atomic_write_bytes(path, data)
    return shape


def is_image(value: Any) -> bool:
    """A float tensor shaped like an RGB image."""
    return (isinstance(value, torch.Tensor) and value.is_floating_point() and value.dim() == 3
            and 3 in (value.shape[0], value.shape[-1]))


def is_audio(value: Any) -> bool:
    """A 1-D int16 sample tensor (what the codecs emit)."""
    return isinstance(value, torch.Tensor) and value.dtype == torch.int16 and value.dim() == 1
