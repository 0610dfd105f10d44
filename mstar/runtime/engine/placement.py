"""Where the torch engine's models run: the CPU (fp32, the reference path) or a CUDA GPU.

`resolve_device(name)` checks `--device` (cpu, cuda, cuda:N). On a GPU each model is wrapped in
`OnDevice`: its weights live on the device in fp32 and every call runs under bf16 autocast;
tensor arguments move to the device on the way in and results come back to the host as fp32 (or
their integer dtype). The engine's boundary (conductor values, sampling with per-request CPU
generators, media) therefore stays on the host, and the runners need no device logic of their own.
KV caches and recurrent states are allocated on the device by the runner (`Placement`).

On the CPU nothing is wrapped: the reference path is unchanged, bit for bit.
"""
from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any

import torch


class DeviceError(ValueError):
    """`--device` names a device this machine does not have."""


@dataclass(frozen=True)
class Placement:
    device: torch.device = torch.device("cpu")

    @property
    def is_cpu(self) -> bool:
        return self.device.type == "cpu"

    @property
    def kv_dtype(self) -> torch.dtype:
        """KV cache dtype: fp32 on the CPU (exact reference), bf16 on a GPU (what FlashInfer takes)."""
        return torch.float32 if self.is_cpu else torch.bfloat16


CPU = Placement()


def resolve_device(name: str) -> Placement:
    try:
        device = torch.device(name)
    except (RuntimeError, TypeError):
        raise DeviceError(f"--device {name!r}: not a device name (cpu, cuda, cuda:N)") from None
    if device.type == "cpu":
        if device.index not in (None, 0):  # torch takes "cpu:5" for the CPU
            raise DeviceError(f"--device {name!r}: not a device name (cpu, cuda, cuda:N)")
        return CPU
    if device.type != "cuda":
        raise DeviceError(f"--device {name!r}: only cpu and cuda are supported")
    if not torch.cuda.is_available():
        raise DeviceError(f"--device {name}: this machine has no CUDA GPU that torch can use "
                          f"(torch {torch.__version__}); run on the CPU with --device cpu")
    index = device.index or 0
    if index >= torch.cuda.device_count():
        raise DeviceError(f"--device {name}: there are only {torch.cuda.device_count()} CUDA device(s)")
    return Placement(torch.device("cuda", index))


def to_device(value: Any, device: torch.device) -> Any:
    if isinstance(value, torch.Tensor):
        return value.to(device, non_blocking=True)
    if hasattr(value, "to_device"):
        return value.to_device(device)
    if isinstance(value, (list, tuple)):
        return type(value)(to_device(v, device) for v in value)
    return value


def to_host(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        value = value.detach().cpu()
        return value.float() if value.is_floating_point() else value
    if isinstance(value, dict):
        return {k: to_host(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(to_host(v) for v in value)
    return value


class OnDevice:
    """A model on a GPU that looks like the host model to its runner (see the module docstring)."""

    def __init__(self, module: torch.nn.Module, placement: Placement):
        self._module = module.to(placement.device)
        self._device = placement.device

    def _call(self, function, *args: Any, **kwargs: Any) -> Any:
        args = to_device(args, self._device)
        kwargs = {k: to_device(v, self._device) for k, v in kwargs.items()}
        with torch.device(self._device), torch.autocast("cuda", dtype=torch.bfloat16):
            return to_host(function(*args, **kwargs))

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._call(self._module, *args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._module, name)
        if inspect.ismethod(attr):
            return lambda *args, **kwargs: self._call(attr, *args, **kwargs)
        return attr
