"""A request's prompt media from Python (`LLM.request(prompt, sampling, media={"audio": samples})`),
checked and made tensors before the request is made, so a bad value is the caller's error and never
a step's: a string path or None once reached the engine, which failed the whole step with a
TypeError (every request beside it too) or, for None, transcribed seeded noise.

In: the media dict, the plan's prompt modalities (text aside) and whether its audio input takes a
waveform. Out: {modality: float32 tensor}, or `MediaError` naming the modality and the problem.
Accepted: a torch tensor, a numpy array or a (nested) list of numbers, non-empty and finite; a
waveform (Whisper, Qwen3-ASR) is one channel of 16 kHz samples, a 1-D array or a [1, n] one (read
a WAV file with `mstar.runtime.serve.wav.read_wav`).
"""
from __future__ import annotations

from typing import Any


MAX_SAMPLE = 2.0  # a waveform's largest magnitude taken, here and from a float WAV (serve/wav.py)


class MediaError(ValueError):
    """A media value the request cannot carry (the message names its modality)."""


def media_tensors(media: dict[str, Any], modalities: frozenset[str], takes_waveform: bool) -> dict[str, Any]:
    import torch  # only once a request brings media (a simulated server never imports it otherwise)

    values = {}
    for modality, value in media.items():
        if modality not in modalities:
            taken = ", ".join(sorted(modalities)) or "none"
            raise MediaError(f"media {modality!r}: this plan takes no such prompt media (it takes: {taken})")
        tensor = _as_tensor(modality, value, torch)
        if modality == "audio" and takes_waveform:
            if tensor.dim() == 2 and tensor.shape[0] == 1:  # one channel first, as torchaudio.load gives mono
                tensor = tensor[0]
            if tensor.dim() != 1:
                raise MediaError(f"media 'audio': one channel of 16 kHz samples, a 1-D array; got shape "
                                 f"{list(tensor.shape)} (read a WAV file with mstar.runtime.serve.wav.read_wav)")
            if not tensor.is_floating_point():  # int16 PCM read as numbers would be 32,768 times too loud
                raise MediaError(f"media 'audio': samples as floats in [-1, 1], got {_dtype(tensor)} (PCM "
                                 "integers: divide by their full scale, 32768 for int16)")
            peak = float(tensor.abs().max())
            if peak > MAX_SAMPLE:  # far past full scale: not samples (1e20 overflowed the log-mel energies to NaN)
                raise MediaError(f"media 'audio': samples as floats in [-1, 1], and one is {peak:.3g} (at most "
                                 f"{MAX_SAMPLE:g} is taken: a float WAV may peak a little past full scale)")
        values[modality] = tensor.to(torch.float32)
    return values


def _as_tensor(modality: str, value: Any, torch: Any) -> Any:
    if isinstance(value, (str, bytes, bytearray)) or value is None or isinstance(value, bool):
        raise MediaError(f"media {modality!r}: an array of numbers (a torch tensor, a numpy array or a list), "
                         f"got {type(value).__name__}" + (" (read a WAV file with mstar.runtime.serve.wav.read_wav)"
                                                           if isinstance(value, str) else ""))
    try:
        tensor = (value if isinstance(value, torch.Tensor) else torch.as_tensor(value)).detach().cpu()
    except (TypeError, ValueError, RuntimeError, OverflowError) as error:
        detail = " ".join(str(error).split())[:200]
        raise MediaError(f"media {modality!r}: not an array of numbers ({detail})") from None
    if tensor.is_nested or tensor.layout != torch.strided:  # sparse or nested: no element-wise check runs on them
        raise MediaError(f"media {modality!r}: a dense array (got a {'nested' if tensor.is_nested else 'sparse'} "
                         "tensor: .to_dense() it)")
    if tensor.dtype == torch.bool or tensor.is_complex():
        raise MediaError(f"media {modality!r}: an array of real numbers, got {_dtype(tensor)}")
    if tensor.dim() == 0 or tensor.numel() == 0:
        raise MediaError(f"media {modality!r}: an array of numbers with at least one, got shape {list(tensor.shape)}")
    if tensor.is_floating_point():  # checked as the engines read it: 1e300 in float64 is inf in float32
        tensor = tensor.to(torch.float32)
    if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
        raise MediaError(f"media {modality!r}: holds a value that is not a finite number")
    return tensor


def _dtype(tensor: Any) -> str:
    return str(tensor.dtype).removeprefix("torch.")
