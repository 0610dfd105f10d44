"""A test file of Triton kernels runs its kernel cases in a child pytest of itself with
TRITON_INTERPRET=1: Triton reads the variable when it first decorates its own library, and setting
it in this process would turn every later GPU test of the session into an interpreted one.

The interpreter runs a kernel's Python, not what Triton's compiler accepts: a name typed twice in
one scope, or a value whose type differs between an `if`'s branches, passes there and fails the
first launch on a GPU. So the child also writes down every kernel it launched, with the types of
the arguments it got (and its constexprs' values), and the parent lowers each to Triton's IR for
an sm_90 target, on the CPU (`lower_launched`).

The generated glue has no module to import (engine/glue_loader.py runs a glue file's verified
bytes into a fresh module): the child copies each glue file it launched from beside the
signatures, and the parent loads that copy as the runtime does."""
import functools
import hashlib
import importlib
import inspect
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

IS_CHILD = os.environ.get("TRITON_INTERPRET") == "1"
SIGNATURES_ENV = "MSTAR_KERNEL_SIGNATURES"  # the file a child appends its launches' signatures to
# For the parent's one test that runs the child: skipped inside the child itself.
parent_only = pytest.mark.skipif(IS_CHILD, reason="this is the interpreter's process")
# A launch's options, not the kernel's arguments.
LAUNCH_OPTIONS = ("num_warps", "num_stages", "num_ctas", "maxnreg", "launch_pdl", "launch_cooperative_grid",
                  "enable_fp_fusion")
# The code filename glue_loader gives a glue file's code.
GLUE_CODE_FILENAME = re.compile(r"^<mstar glue (.+)>$")


def skip_unless_child(test_name: str) -> None:
    """Skip a kernel case outside the child (the parent's `test_name` runs it there)."""
    if not IS_CHILD:
        pytest.skip(f"runs in the interpreter's own process ({test_name})")


def run_child(test_file: str, expected: str) -> None:
    """Run `test_file` under the interpreter; it must pass with `expected` in its summary (a count
    of passed cases, so cases that all skipped would not pass for run); then every kernel it
    launched must lower for a GPU."""
    with tempfile.TemporaryDirectory() as folder:
        signatures = Path(folder) / "signatures.jsonl"
        env = dict(os.environ, TRITON_INTERPRET="1", **{SIGNATURES_ENV: str(signatures)})
        result = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", test_file],
                                env=env, capture_output=True, text=True, cwd=Path(test_file).parent)
        assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
        assert expected in result.stdout, result.stdout[-2000:]
        lowered = lower_launched(signatures)
    assert lowered, "the child launched no kernel"


def _value(value):
    """A constexpr's value as JSON: a Triton dtype by its name."""
    import triton.language as tl

    if isinstance(value, tl.constexpr):
        value = value.value
    if isinstance(value, tl.dtype):
        return {"dtype": value.name}
    return value


def _kernel_place(fn, folder: Path) -> dict:
    """Where the parent finds `fn`: its module's import name, or for a generated glue kernel the
    copy of its glue file written to `folder` (named by its hash) and that hash."""
    glue = GLUE_CODE_FILENAME.match(fn.__code__.co_filename)
    if glue is None:
        return {"module": fn.__module__}
    data = Path(glue[1]).read_bytes()
    sha256 = hashlib.sha256(data).hexdigest()
    copy = folder / f"glue_{sha256[:16]}.py"
    if not copy.exists():
        copy.write_bytes(data)
    return {"glue": copy.name, "sha256": sha256}


def _signature(kernel, args, kwargs, folder: Path) -> dict:
    """The launch as lowering needs it: the kernel's place, each argument's Triton type (or a
    constexpr's value) and the launch options."""
    from triton.runtime.jit import mangle_type

    fn = kernel.fn
    signature = inspect.signature(fn)
    bound = signature.bind(*args, **{k: v for k, v in kwargs.items() if k not in LAUNCH_OPTIONS})
    bound.apply_defaults()
    constexprs = {name for name, param in signature.parameters.items() if "constexpr" in str(param.annotation)}
    return {**_kernel_place(fn, folder), "name": fn.__name__,
            "constexprs": {name: _value(bound.arguments[name]) for name in constexprs},
            "types": {name: mangle_type(value) for name, value in bound.arguments.items() if name not in constexprs},
            "options": {k: v for k, v in kwargs.items() if k in LAUNCH_OPTIONS}}


def _record_launches(path: str) -> None:
    """In the child: every interpreted launch's signature appended to `path`, once each."""
    from triton.runtime.interpreter import InterpretedFunction

    seen: set[str] = set()
    run = InterpretedFunction.run

    def recording_run(self, *args, grid, warmup, **kwargs):
        line = json.dumps(_signature(self, args, kwargs, Path(path).parent), sort_keys=True)
        if line not in seen:
            seen.add(line)
            with open(path, "a") as out:
                out.write(line + "\n")
        return run(self, *args, grid=grid, warmup=warmup, **kwargs)

    InterpretedFunction.run = recording_run


def lower_launched(path: Path) -> int:
    """Lower each launch written to `path` for an sm_90 GPU (no device needed): the first launch of
    each kernel compiled whole, through ptxas to a cubin (about 1-2 s a kernel), the others to
    Triton's IR (their types and constexprs, milliseconds); the number lowered. A kernel the
    compiler refuses raises its CompilationError."""
    import triton
    from triton._C.libtriton import ir
    from triton.compiler.compiler import make_backend

    target = _sm90()
    backend = make_backend(target)
    launches = [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
    compiled: set[tuple[str, str]] = set()
    for launch in launches:
        source = _source(launch, path.parent)
        kernel = (launch.get("module") or launch["glue"], launch["name"])
        if kernel not in compiled:
            compiled.add(kernel)
            triton.compile(source, target=target, options=launch["options"])
            continue
        options = backend.parse_options(launch["options"])
        context = ir.context()
        ir.load_dialects(context)
        backend.load_dialects(context)
        source.make_ir(target, options, backend.get_codegen_implementation(options), backend.get_module_map(),
                       context)
    return len(launches)


def compiled_for_sm90(kernel, types: dict, constexprs: dict, options: dict):
    """`kernel` compiled whole for an sm_90 GPU on the CPU (its `.asm` has the ptx)."""
    import triton

    return triton.compile(_source({"module": kernel.fn.__module__, "name": kernel.fn.__name__, "types": types,
                                   "constexprs": constexprs}), target=_sm90(), options=options)


def _sm90():
    from triton.backends.compiler import GPUTarget

    return GPUTarget("cuda", 90, 32)


@functools.cache
def _glue_module(path: Path, sha256: str):
    from mstar.runtime.engine.glue_loader import load_glue

    return load_glue(path, sha256)


def _source(launch: dict, folder: Path | None = None):
    """A recorded launch as Triton's compiler takes it (a glue kernel's file copy is in `folder`)."""
    import triton.language as tl
    from triton.compiler.compiler import ASTSource

    if "glue" in launch:
        module = _glue_module(folder / launch["glue"], launch["sha256"])
    else:
        module = importlib.import_module(launch["module"])
    kernel = getattr(module, launch["name"])
    kernel = getattr(kernel, "jitted", kernel)  # a glue kernel's GlueKernel wraps the JIT function
    constexprs = {name: getattr(tl, value["dtype"]) if isinstance(value, dict) else value
                  for name, value in launch["constexprs"].items()}
    return ASTSource(kernel, {**launch["types"], **{name: "constexpr" for name in constexprs}}, constexprs)


if IS_CHILD and os.environ.get(SIGNATURES_ENV):
    _record_launches(os.environ[SIGNATURES_ENV])
