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
"""
from __future__ import annotations

import inspect
from typing import Callable, Sequence

import triton

CAN_SKIP_ALIGNMENT = "do_not_specialize_on_alignment" in inspect.signature(triton.jit).parameters


def glue_jit(ints: Sequence[str], pointers: Sequence[str]) -> Callable:
    options: dict = {"do_not_specialize": list(ints)}
    if CAN_SKIP_ALIGNMENT:
        options["do_not_specialize_on_alignment"] = list(pointers)
    return triton.jit(**options)
