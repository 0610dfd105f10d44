"""The GPU engine's fast path for plain decoders: bf16 weights on the device, a device-side step,
CUDA graphs per plan capture family, sampling on the device, and `mstar bench engine`."""

import mstar.runtime.engine.triton_defaults  # noqa: F401  (Triton's FP fusion stated before any kernel compiles)
