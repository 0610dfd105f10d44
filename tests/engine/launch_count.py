"""Count the device kernels a call would launch, on the CPU: the torch ops that run a kernel and the
Triton kernel launches, by name.

In: a callable and the modules whose Triton kernels (module attributes with `__getitem__`, the
`kernel[grid](...)` launch) to count. Out: `{name: launches}`, torch ops as `aten.<op>`.

Why: in a CUDA graph each kernel costs a few microseconds of launch and ramp however small, so a
decode step's kernel count is what its small-batch time follows; this counts it without a GPU. An
aten op counts unless it only makes a view or allocates (no kernel on a GPU either); a cast that
changes nothing never reaches the dispatcher, so it does not count, as it launches nothing. The
Triton kernels run with the counting switched off, so the interpreter's own tensor work is not
counted.
"""
from __future__ import annotations

from collections import Counter
from types import ModuleType
from typing import Callable

import torch
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

# Ops that allocate without writing (torch.empty and friends): no kernel.
ALLOCATING = {"aten.empty", "aten.empty_strided", "aten.empty_like", "aten.new_empty"}


class _Counting(TorchDispatchMode):
    def __init__(self, counts: Counter):
        super().__init__()
        self.counts = counts

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func.overloadpacket)
        if not func.is_view and name not in ALLOCATING:
            self.counts[name] += 1
        return func(*args, **(kwargs or {}))


class _Launcher:
    """Stands in for a Triton kernel: `kernel[grid](...)` counts, then launches it uncounted."""

    def __init__(self, name: str, kernel, counts: Counter):
        self.name, self.kernel, self.counts = name, kernel, counts

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.counts[self.name] += 1
            with _disable_current_modes():
                return self.kernel[grid](*args, **kwargs)
        return launch


def count_launches(call: Callable[[], object], modules: list[ModuleType]) -> dict[str, int]:
    counts: Counter = Counter()
    originals = []
    for module in modules:
        for name, value in list(vars(module).items()):
            if name.endswith("_kernel") and hasattr(value, "__getitem__") and not isinstance(value, dict):
                originals.append((module, name, value))
                setattr(module, name, _Launcher(name, value, counts))
    try:
        with torch.no_grad(), _Counting(counts):
            call()
    finally:
        for module, name, value in originals:
            setattr(module, name, value)
    return dict(counts)
