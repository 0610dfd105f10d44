"""Load a generated glue module (`generated/<config>_glue.py`) by file path.

In:  the path of a glue file the compiler wrote (the plan's header names it and records its
     sha256; `mstar.plan.io.load_plan` checks the hash).
Out: the module, whose `GLUE_BY_WORKER[rank][key name]` is a `glue_reference.KeyGlue`.

The glue is generated, checked-in Python, so it is imported like any module; the plan itself is
data and is never executed. Each load gets a fresh module object under a private name, so two
plans' glue files never shadow each other in `sys.modules`.

Triton's interpreter (kernels run on CPU tensors) is chosen when the process starts, by
TRITON_INTERPRET=1 in the environment before triton is first imported; this loader does not
switch it.
"""
from __future__ import annotations

import hashlib
import importlib.util
from pathlib import Path
from types import ModuleType


class GlueLoadError(Exception):
    """The glue file is missing or does not import; the message says how to regenerate it."""


def load_glue(path: str | Path) -> ModuleType:
    """Import the glue file at `path` and check that it has the tables the runtime reads."""
    path = Path(path)
    if not path.is_file():
        raise GlueLoadError(f"glue file {path} does not exist; run `mstarc regen` to generate it")
    digest = hashlib.sha256(str(path.resolve()).encode()).hexdigest()[:12]
    module_name = f"mstar_glue_{path.stem}_{digest}"
    spec = importlib.util.spec_from_file_location(module_name, path)
    if spec is None or spec.loader is None:
        raise GlueLoadError(f"glue file {path} cannot be imported as a Python module")
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except Exception as error:  # any failure of generated code is reported the same way
        raise GlueLoadError(
            f"glue file {path} failed to import ({type(error).__name__}: {error}); "
            "it is generated: run `mstarc regen` rather than editing it") from error
    if not isinstance(getattr(module, "GLUE_BY_WORKER", None), dict):
        raise GlueLoadError(f"glue file {path} has no GLUE_BY_WORKER table; run `mstarc regen`")
    return module
