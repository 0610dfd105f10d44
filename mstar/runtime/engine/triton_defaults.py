"""The Triton compile defaults mstar's kernels were measured and tested with, stated rather than inherited.

Triton 3.9 warns that `TRITON_DEFAULT_FP_FUSION` is unset and that its default (multiply and add
fused into one FMA) turns off in 3.10, which pyproject's `triton>=3.0,<4` admits. Every kernel here
(the generated glue, engine/gpu's fused kernels, the decode and prefill attention, the gated
delta-net and sampling kernels) was measured and held bit for bit on the GPU with fusion on
(Triton 3.6 on the GPU image), so a Triton upgrade must not change their rounding or speed
silently. Importing this module keeps fusion on unless the environment already chose (a user's
`TRITON_DEFAULT_FP_FUSION=0` is honoured); it is a process default, read by Triton at each compile,
so it is set before any of our kernels compiles: `glue_jit` (every generated glue module) and
`engine/gpu/__init__.py` (every GPU kernel module) import it.
"""
from __future__ import annotations

import os

FP_FUSION_VARIABLE = "TRITON_DEFAULT_FP_FUSION"

os.environ.setdefault(FP_FUSION_VARIABLE, "1")
