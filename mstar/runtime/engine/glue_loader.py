"""Load a generated glue module (`generated/<config>_glue.py`) after checking it against its plan.

In:  the path of a glue file the compiler wrote and the sha256 its plan's header records
     (`load_plan_glue(plan_path, plan)` passes both).
Out: the module, whose `GLUE_BY_WORKER[rank][key name]` is a `glue_reference.KeyGlue`.

The glue is generated Python and is run; the plan itself is data and is never executed. What runs
is exactly the bytes whose hash matched: the file is read once (bounded, a regular file), hashed,
compiled from those bytes and executed into a fresh module. Importing it by path instead ran
something else than what was checked: the import reads the file again (a swap after `load_plan`'s
check, minutes earlier while weights load, ran unchecked code) and prefers a bytecode file in
`__pycache__/` whose header only records the source's mtime and size (a planted .pyc ran although
the .py's hash matched).

Triton compiles (or, under its interpreter, re-executes) a kernel from the source that
`inspect.getsourcelines` returns, which `linecache` reads from the code's file name. The code is
therefore named `<mstar glue PATH>`, a name no file has, and the verified lines are put in
`linecache` under it (no mtime: `checkcache` keeps such an entry), so Triton sees the checked
source and never the disk's; were the entry dropped, getsourcelines fails rather than reading a
file. Each load gets a fresh module object under a private name, never entered in `sys.modules`,
so two plans' glue files never shadow each other.

Triton's interpreter (kernels run on CPU tensors) is chosen when the process starts, by
TRITON_INTERPRET=1 in the environment before triton is first imported; this loader does not
switch it.
"""
from __future__ import annotations

import hashlib
import io
import linecache
import os
from pathlib import Path
from types import ModuleType

from mstar.files import MAX_GLUE_BYTES, InputFileError, read_bytes_bounded
from mstar.plan.io import input_paths
from mstar.plan.schema import Plan


class GlueLoadError(Exception):
    """The glue file is missing, differs from its plan's hash or does not import; the message says
    how to regenerate it."""


def load_plan_glue(plan_path: str | os.PathLike, plan: Plan) -> ModuleType:
    """The glue the plan at `plan_path` names (beside it), checked against the plan's hash."""
    return load_glue(input_paths(plan_path, plan)["glue"], plan.header.hashes.glue)


def load_glue(path: str | os.PathLike, sha256: str) -> ModuleType:
    """Run the glue file at `path` if its bytes have `sha256`, and check that it has the tables
    the runtime reads."""
    path = Path(path)
    try:
        data = read_bytes_bounded(path, max_bytes=MAX_GLUE_BYTES, what="glue file")
    except InputFileError as error:
        raise GlueLoadError(f"{error}; run `mstarc regen` to generate it") from None
    actual = hashlib.sha256(data).hexdigest()
    if actual != sha256:
        raise GlueLoadError(
            f"glue file {path} is not the one its plan was compiled with (sha256 {actual[:12]}..., plan has "
            f"{sha256[:12]}...); it is generated: run `mstarc regen` (or recompile the plan) rather than editing it")
    digest = hashlib.sha256(str(path.resolve()).encode()).hexdigest()[:12]
    module = ModuleType(f"mstar_glue_{path.stem}_{digest}")
    filename = f"<mstar glue {path}>"
    try:
        source = data.decode("utf-8")
        code = compile(source, filename, "exec", dont_inherit=True)
        lines = io.StringIO(source, newline=None).readlines()  # split as linecache reads a file
        if lines and not lines[-1].endswith("\n"):
            lines[-1] += "\n"
        linecache.cache[filename] = (len(data), None, lines, filename)
        exec(code, module.__dict__)  # the verified bytes above, and nothing read since
    except Exception as error:  # any failure of generated code is reported the same way
        raise GlueLoadError(
            f"glue file {path} failed to import ({type(error).__name__}: {error}); "
            "it is generated: run `mstarc regen` rather than editing it") from error
    if not isinstance(getattr(module, "GLUE_BY_WORKER", None), dict):
        raise GlueLoadError(f"glue file {path} has no GLUE_BY_WORKER table; run `mstarc regen`")
    return module
