"""A SNAC checkpoint directory (as `snac.SNAC.from_pretrained` reads it) -> `SnacDims` and weights.

In: a directory with `config.json` (SNAC's constructor arguments: `sampling_rate`, `encoder_dim`,
`encoder_rates`, `latent_dim`, `decoder_dim`, `decoder_rates`, `attn_window_size`, `codebook_size`,
`codebook_dim`, `vq_strides`, `noise`, `depthwise`) and `pytorch_model.bin` (the published file) or
`model.safetensors`. Out: `read_snac_config(dir)` -> `SnacDims`; `load_snac_weights(model, dir)`
fills a `SnacDecoder`. Refused with a `WeightsError`: a missing or malformed file, a decoder with
local attention (`attn_window_size` set: the 32 and 44 kHz models; the 24 kHz one has none).

`model.safetensors` is taken when both are there: plain data, nothing in it is run.
`pytorch_model.bin` is a pickle, read with `torch.load(weights_only=True)`: tensors only, no code
runs, from torch 2.6 on. Before 2.6 that restricted unpickler could be made to run code from the
file (CVE-2025-32434), and pyproject allows torch 2.4, so there a .bin is refused, with the fix
(upgrade torch, or convert the file to model.safetensors), rather than loaded.
"""
from __future__ import annotations

import re
from pathlib import Path

import torch

from mstar.runtime.engine.checkpoint_config import WeightsError, read_json_object
from mstar.plan.dims import SnacDims
from mstar.runtime.engine.models.snac import SnacDecoder, load_snac_state

# SNAC's constructor defaults (snac 1.2.1), for keys a config.json leaves out
SNAC_DEFAULTS = {"sampling_rate": 44100, "encoder_dim": 64, "encoder_rates": [3, 3, 7, 7], "latent_dim": None,
                 "decoder_dim": 1536, "decoder_rates": [7, 7, 3, 3], "attn_window_size": 32, "codebook_size": 4096,
                 "codebook_dim": 8, "vq_strides": [8, 4, 2, 1], "noise": True, "depthwise": True}
MAX_SNAC_SIZE = 1 << 20  # any size, rate or stride a SNAC config may give (a rate of 1e308 overflowed a tensor size)
MAX_SNAC_STAGES = 16  # decoder rates or vq strides (the published models have 4)
WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin")  # safetensors first (module docstring)
SAFE_TORCH_LOAD = (2, 6)  # the first torch whose torch.load(weights_only=True) runs no code from the file


def torch_release() -> tuple[int, int]:
    """(major, minor) of the torch in use; (0, 0) when its version string does not say."""
    found = re.match(r"(\d+)\.(\d+)", str(torch.__version__))
    return (int(found.group(1)), int(found.group(2))) if found else (0, 0)


def read_snac_config(directory: str) -> SnacDims:
    path = Path(directory) / "config.json"
    if not path.is_file():
        raise WeightsError(f"SNAC checkpoint {directory}: no config.json there")
    raw = read_json_object(path, "SNAC config")  # (bounded; a number too long or nesting too deep refused)
    config = {**SNAC_DEFAULTS, **raw}
    if config["attn_window_size"] is not None:
        raise WeightsError(f"{path}: attn_window_size={config['attn_window_size']}: SNAC decoders with local "
                           "attention (the 32 and 44 kHz models) are not supported; the 24 kHz model has none")
    try:
        rates = tuple(int(r) for r in config["decoder_rates"])
        strides = tuple(int(s) for s in config["vq_strides"])
        latent = config["latent_dim"]
        latent = int(latent) if latent is not None else int(config["encoder_dim"]) * 2 ** len(config["encoder_rates"])
        dims = SnacDims(sampling_rate=int(config["sampling_rate"]), latent_dim=latent,
                        decoder_dim=int(config["decoder_dim"]), decoder_rates=rates,
                        codebook_size=int(config["codebook_size"]), codebook_dim=int(config["codebook_dim"]),
                        vq_strides=strides, has_noise=bool(config["noise"]), is_depthwise=bool(config["depthwise"]))
    except (TypeError, ValueError, OverflowError) as error:  # (OverflowError: a rate of 1e308 or Infinity)
        raise WeightsError(f"{path}: missing or bad field ({error})") from None
    numbers = (dims.sampling_rate, dims.latent_dim, dims.decoder_dim, dims.codebook_size, dims.codebook_dim,
               *rates, *strides)
    if not rates or not strides or min(numbers) <= 0:
        raise WeightsError(f"{path}: sizes, rates and strides must be positive, with at least one of each")
    if max(numbers) > MAX_SNAC_SIZE or len(rates) > MAX_SNAC_STAGES or len(strides) > MAX_SNAC_STAGES:
        raise WeightsError(f"{path}: sizes, rates and strides of at most {MAX_SNAC_SIZE} and at most "
                           f"{MAX_SNAC_STAGES} rates and strides are read (the 24 kHz model's largest is 24000)")
    if dims.decoder_dim % 2 ** len(rates) or any(strides[0] % s for s in strides):
        raise WeightsError(f"{path}: decoder_dim must halve {len(rates)} times and every vq stride divide the "
                           f"first ({strides[0]})")
    return dims


def read_snac_state(directory: str) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors, from the first of WEIGHT_FILES present."""
    for name in WEIGHT_FILES:
        path = Path(directory) / name
        if path.is_file():
            break
    else:
        raise WeightsError(f"SNAC checkpoint {directory}: none of {', '.join(WEIGHT_FILES)} there")
    if path.suffix != ".safetensors" and torch_release() < SAFE_TORCH_LOAD:
        raise WeightsError(f"{path}: torch {torch.__version__} cannot read a pickled checkpoint safely (its "
                           f"torch.load can run code from the file before torch 2.6); upgrade torch to 2.6 or later, "
                           f"or convert the file to model.safetensors")
    try:
        if path.suffix == ".safetensors":
            from safetensors.torch import load_file

            return load_file(str(path))
        state = torch.load(str(path), map_location="cpu", weights_only=True)
    except Exception as error:  # torch.load and safetensors raise many kinds on a corrupt file
        raise WeightsError(f"{path}: cannot read it ({type(error).__name__}: {error})") from None
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise WeightsError(f"{path}: not a state dict of tensors")
    return state


def load_snac_weights(model: SnacDecoder, directory: str) -> None:
    try:
        load_snac_state(model, read_snac_state(directory), f"SNAC checkpoint {directory}")
    except ValueError as error:
        if isinstance(error, WeightsError):
            raise
        raise WeightsError(str(error)) from None

