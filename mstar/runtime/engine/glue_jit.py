"""How the generated glue's kernels are compiled: one variant for every step shape.

In: the kernel's integer and pointer parameter names. Out: the `triton.jit` decorator to apply.

The glue's pointer arguments are views into one staged buffer (`glue_packing.GluePacker.launch`:
row field i starts i * num_rows int32s in), so their 16-byte alignment changes with the step's
number of rows, and Triton specializes a kernel on each pointer's alignment as it does on each
integer's value. A step of a new shape (41 rows after a run of 40: a prompt's first chunk beside
the decode rows) then compiled, or loaded from the disk cache, a variant of its own inside the
step. `glue_jit` turns both specializations off, the alignment one where this Triton has it
(`do_not_specialize_on_alignment`); the glue's loads are a few hundred int32s a step, so the
vector width they give up costs nothing measurable.

With both off, the only things a variant depends on are the tensors' dtypes and whether each
integer fits 32 bits, so `GlueKernel` launches a step whose arguments match an earlier step's
straight through that variant's compiled launcher, skipping the JIT's argument binding and cache
lookup. On an H200's host a launch through the JIT took 23 us in a loop and 41-43 us inside a
serial step (its code cold), where a cached request's first step waits for its `pack_step`
before the replay; through the variant's launcher 9 us in a loop (inside a step not measured).
"""
from __future__ import annotations

import inspect
from typing import Any, Callable, Optional, Sequence

import torch
import triton
from triton import knobs
from triton.runtime import driver

import mstar.runtime.engine.triton_defaults  # noqa: F401  (FP fusion stated before a glue kernel compiles)

CAN_SKIP_ALIGNMENT = "do_not_specialize_on_alignment" in inspect.signature(triton.jit).parameters


INT32_MIN, INT32_MAX = -2 ** 31, 2 ** 31 - 1


def glue_jit(ints: Sequence[str], pointers: Sequence[str]) -> Callable:
    options: dict = {"do_not_specialize": list(ints)}
    if CAN_SKIP_ALIGNMENT:
        options["do_not_specialize_on_alignment"] = list(pointers)
    return lambda fn: GlueKernel(triton.jit(**options)(fn))


class GlueKernel:
    """A generated glue kernel, launched as `kernel[grid](*args)` like the `triton.jit` function it
    wraps. The first launch of each argument signature (dtypes, 32-bit integers or not) goes
    through the JIT; later ones call the variant it returned as the JIT itself would (module
    docstring). Under Triton's interpreter every launch goes through the JIT."""

    def __init__(self, jitted: Any) -> None:
        self.jitted = jitted
        self._variants: dict[tuple, Any] = {}

    def __getitem__(self, grid: tuple[int, ...]) -> Callable[..., None]:
        return lambda *args: self._launch(grid, args)

    def _launch(self, grid: tuple[int, ...], args: tuple) -> None:
        signature = _signature(args)
        variant = self._variants.get(signature) if signature is not None else None
        if variant is None:
            compiled = self.jitted[grid](*args)
            # An interpreted launch returns no compiled kernel; without the alignment switch a
            # variant also depends on each pointer's alignment, which the signature does not hold.
            if signature is not None and CAN_SKIP_ALIGNMENT and hasattr(compiled, "packed_metadata"):
                self._variants[signature] = compiled
            return
        # The JIT's own launch of a bound variant (triton/runtime/jit.py), hooks and all.
        stream = driver.active.get_current_stream(driver.active.get_current_device())
        variant.run(grid[0], grid[1] if len(grid) > 1 else 1, grid[2] if len(grid) > 2 else 1, stream,
                    variant.function, variant.packed_metadata, variant.launch_metadata(grid, stream, *args),
                    knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook, *args)


def _signature(args: tuple) -> Optional[tuple]:
    """What a variant depends on (module docstring): each tensor's dtype, and int for each plain
    integer within 32 bits (Triton's i32); None for anything else (a bool, a wider integer), which
    always takes the JIT."""
    signature: list = []
    for arg in args:
        if isinstance(arg, torch.Tensor):
            signature.append(arg.dtype)
        elif type(arg) is int and INT32_MIN <= arg <= INT32_MAX:
            signature.append(int)
        else:
            return None
    return tuple(signature)
