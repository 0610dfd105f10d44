"""A Llama-style `Decoder` built straight on a device in one dtype (bf16 on a GPU), no fp32 copy there.

In: `DecoderDims`, a device, a dtype, the node's position in the plan (it seeds the random weights),
and where the weights come from: the engine's seeded random
init (`weights.init_random`'s values, drawn on the host one parameter at a time, so a GPU model has
the CPU reference's weights), a fast on-device random init (benchmarks: `is_fast_random`, or
`set_random_on_device(True)` for every decoder built afterwards), or a local checkpoint
(safetensors read straight onto the device). Out: the `Decoder` module whose parameters live on the
device; nothing is autocast.

`unsupported_reason(dims)` says why a decoder cannot take this path (an unknown style, dynamic NTK
RoPE); None when it can. A Qwen3.5 hybrid's gated delta-net decay parameters (A_log, dt_bias) stay
in fp32.
"""
from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from typing import Optional

import torch
from torch import nn

from mstar.arg_types import shown_path
from mstar.plan.dims import DecoderDims
from mstar.runtime.engine.models.decoder import Decoder
from mstar.runtime.engine.models.gdn import GateNormWeight, GatedDeltaNet
from mstar.runtime.engine.models.layers import RMSNorm
from mstar.runtime.engine.checkpoint_files import check_finite, tensor_index, wanted_by_file
from mstar.runtime.engine.weights import WeightsError, param_seed, random_matrix

__all__ = ["build_decoder", "unsupported_reason"]

_HOST_DRAW_THREADS = min(8, os.cpu_count() or 1)
# Random weights drawn by the device's generator rather than the CPU reference's host draws: a
# benchmark's engines time steps, not tokens, and a spec-size model's host draws took seconds of
# every engine's start on the lent GPU's host (`mstar bench kv` builds three engines a run).
_draws_on_device = False


def set_random_on_device(enabled: bool) -> None:
    """Random weights of decoders built afterwards from the device's generator (benchmarks: the
    values differ from the CPU reference's), or the reference's host draws (the default)."""
    global _draws_on_device
    _draws_on_device = enabled


def unsupported_reason(dims: DecoderDims) -> Optional[str]:
    """Why `dims` cannot run on the device fast path, or None."""
    if dims.style not in ("llama", "qwen3_5"):
        return f"style {dims.style} is not on the GPU fast path yet"
    if dims.rope.kind == "dynamic":
        return "dynamic NTK RoPE (per-request frequencies) is not on the GPU fast path"
    return None


def _start_value(module: nn.Module, name: str) -> Optional[float]:
    """The constructor value of a 1-D parameter: norm scales 1 (0 when zero-centred), biases 0,
    a gated delta-net's decay parameters at their starts (`GatedDeltaNet.START_VALUES`) and its
    gated norm's scale 1."""
    if isinstance(module, RMSNorm):
        return 0.0 if module.is_zero_centred else 1.0
    if isinstance(module, GatedDeltaNet):
        return GatedDeltaNet.START_VALUES.get(name)
    if isinstance(module, GateNormWeight):
        return 1.0
    if name == "bias":
        return 0.0
    return None


def _dtype(module: nn.Module, name: str, dtype: torch.dtype) -> torch.dtype:
    """fp32 for a gated delta-net's decay parameters (the decay is computed in fp32: Qwen3.5's
    checkpoints keep A_log in fp32), else the model's dtype."""
    return torch.float32 if isinstance(module, GatedDeltaNet) and name in GatedDeltaNet.START_VALUES else dtype


def build_decoder(dims: DecoderDims, device: torch.device, dtype: torch.dtype, *, position: int, seed: int,
                  weights_dir: Optional[str] = None, is_fast_random: Optional[bool] = None) -> Decoder:
    """The decoder with every parameter allocated on `device` in `dtype` and filled (module docstring);
    `position`: the node's index in the plan (what random weights are seeded by); is_fast_random:
    draw them with the device's generator (None: as `set_random_on_device` says)."""
    if is_fast_random is None:
        is_fast_random = _draws_on_device
    with torch.device("meta"):
        model = Decoder(dims)
    embeddings = {name for name, m in model.named_modules() if isinstance(m, nn.Embedding)}
    generator = torch.Generator(device=device) if is_fast_random else None
    host_draws: list[tuple[torch.Tensor, str, bool]] = []  # (parameter, its name, is an embedding)
    for module_name, module in model.named_modules():
        for name, meta in list(module.named_parameters(recurse=False)):
            full = f"{module_name}.{name}" if module_name else name
            value = torch.empty(meta.shape, dtype=_dtype(module, name, dtype), device=device)
            if meta.dim() < 2:
                start = _start_value(module, name)
                if start is None:
                    raise WeightsError(f"parameter {full}: no start value on the GPU fast path")
                value.fill_(start)
            elif generator is not None:
                generator.manual_seed(param_seed(seed, position, full))
                value.normal_(0.0, 1.0 if module_name in embeddings else meta[0].numel() ** -0.5, generator=generator)
            else:
                host_draws.append((value, full, module_name in embeddings))
            module._parameters[name] = nn.Parameter(value, requires_grad=False)
    _draw_on_host(host_draws, seed, position)
    if weights_dir is not None:
        _load_checkpoint(model, weights_dir, dims.is_tied_embeddings, device)
    return model


def _draw_on_host(draws: list[tuple[torch.Tensor, str, bool]], seed: int, position: int) -> None:
    """Fill each (device tensor, parameter name, is an embedding) with the CPU reference's values
    (`weights.random_matrix`), on a few threads: the host generator is serial, so a spec-size
    model (1.2 B values) took 15-80 s on one core; each parameter has its own generator, so the
    values do not depend on the threads. At most `_HOST_DRAW_THREADS` host copies exist at a time."""
    def draw(item: tuple[torch.Tensor, str, bool]) -> None:
        value, name, is_embedding = item
        value.copy_(random_matrix(name, tuple(value.shape), is_embedding, seed, position))

    if not draws:
        return
    with ThreadPoolExecutor(max_workers=_HOST_DRAW_THREADS) as pool:
        for _ in pool.map(draw, draws):  # the draws run _HOST_DRAW_THREADS at a time
            pass


def _load_checkpoint(model: Decoder, weights_dir: str, is_tied: bool, device: torch.device) -> None:
    """Copy checkpoint tensors, read onto the device, into the model by name (shapes checked), by the
    CPU loader's rules (`weights.load_checkpoint_weights`): the files `checkpoint_files.tensor_index`
    names (the safetensors index honoured, stale and duplicate files refused), the layer count
    config.json's, NaN and infinite values refused. (It globbed every file, the first name winning a
    tensor two held, and took NaN weights: a stale shard or a damaged tensor ran on the GPU only.)"""
    from safetensors import SafetensorError, safe_open

    index = tensor_index(weights_dir)
    params = {name: p for name, p in model.named_parameters() if not name.startswith("flow.")}
    if is_tied and "lm_head.weight" not in index and "model.embed_tokens.weight" in index:
        index["lm_head.weight"] = index["model.embed_tokens.weight"]  # (a tied head takes the embedding's)
    by_file = wanted_by_file(weights_dir, index, params)
    with torch.no_grad():
        for file, names in by_file.items():
            try:
                with safe_open(str(file), framework="pt", device=str(device)) as handle:
                    for name in names:
                        key = index[name][1]
                        _copy(params[name], handle.get_tensor(key), name, weights_dir)
                        check_finite(weights_dir, file, key, params[name])
            except (SafetensorError, OSError) as error:
                raise WeightsError(f"--weights {shown_path(weights_dir)}: cannot read {file.name}: {error}") from None


def _copy(param: torch.Tensor, tensor: torch.Tensor, name: str, weights_dir: str) -> None:
    if tuple(tensor.shape) != tuple(param.shape):
        raise WeightsError(f"--weights {shown_path(weights_dir)}: {name} has shape {tuple(tensor.shape)}, "
                           f"config.json implies {tuple(param.shape)}")
    param.copy_(tensor)
