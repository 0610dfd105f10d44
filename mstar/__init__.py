"""mstar: a compiler and runtime for multimodal model walk graphs (README.md).

The Python API is imported lazily, so `import mstar` stays light (no torch, no web framework):

    from mstar import LLM, SamplingParams      # mstar/runtime/serve/api.py
"""
from __future__ import annotations

from typing import Any

_LAZY = {"LLM": "mstar.runtime.serve.api", "SamplingParams": "mstar.runtime.serve.api",
         "Output": "mstar.runtime.serve.api"}
__all__ = sorted(_LAZY)


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'mstar' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(module), name)


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
