"""Every generated glue kernel is compiled once for every step shape: none of its integer
parameters is specialized on its value, and (where this Triton can) none of its pointers on its
alignment, which moves with the step's number of rows (mstar/runtime/engine/glue_jit.py)."""
from __future__ import annotations

from pathlib import Path

import pytest
from glue_modules import checked_in_glue

from mstar.runtime.engine.glue_jit import CAN_SKIP_ALIGNMENT

GENERATED = Path(__file__).resolve().parents[2] / "generated"


@pytest.mark.parametrize("path", sorted(GENERATED.glob("*_glue.py")), ids=lambda p: p.stem)
def test_no_glue_kernel_parameter_is_specialized(path):
    module = checked_in_glue(path)
    kernels = [value for name, value in vars(module).items() if name.startswith("_") and name.endswith("_kernel")]
    assert kernels
    for kernel in (k.jitted for k in kernels):  # the triton.jit function each GlueKernel launches
        params = [p for p in kernel.params if not p.is_constexpr]
        pointers = [p.name for p in params if p.name.endswith("_ptr")]
        assert pointers and len(pointers) < len(params)
        assert sorted(kernel.do_not_specialize) == sorted(p.name for p in params if p.name not in pointers)
        if CAN_SKIP_ALIGNMENT:
            assert sorted(kernel.do_not_specialize_on_alignment) == sorted(pointers)
