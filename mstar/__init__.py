"""mstar: a compiler and runtime for multimodal model walk graphs (README.md).

The Python API is imported lazily, so `import mstar` stays light (no torch, no web framework):

    from mstar import LLM, SamplingParams      # mstar/runtime/serve/api.py
    from mstar import PromptError, SamplingError, Closed, Overloaded, SetupError   # its errors
"""
from __future__ import annotations

from typing import Any

_API = "mstar.runtime.serve.api"
_LAZY = {name: _API for name in ("LLM", "SamplingParams", "Output", "PromptError", "SamplingError", "Closed",
                                 "Overloaded", "SetupError")}
__all__ = sorted(_LAZY)


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'mstar' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(module), name)


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
