"""`interpreter_child.lower_launched`: a kernel the interpreter runs but Triton's compiler refuses
(the sampler's search kernel of 2026-12-06 named two values of different types `_` in one scope,
and failed its first launch on the GPU) fails on the CPU, where CI runs; a generated glue kernel
too, loaded from its file as the runtime loads it."""
import hashlib
import inspect
import json
import textwrap

import pytest

triton = pytest.importorskip("triton")
import triton.language as tl  # noqa: E402
from interpreter_child import lower_launched  # noqa: E402
from triton.compiler.errors import CompilationError  # noqa: E402


@triton.jit
def _pair(x):
    return x.to(tl.float32), x.to(tl.int64)


@triton.jit
def _ints(x):
    return x.to(tl.int64), x.to(tl.int64)


@triton.jit
def _one_name_two_types_kernel(x_ptr, out_ptr, BLOCK: tl.constexpr):
    x = tl.load(x_ptr + tl.arange(0, BLOCK))
    _, value = _pair(x)
    if tl.program_id(0) == 0:
        _, value = _ints(x)
    tl.store(out_ptr + tl.arange(0, BLOCK), value)


@triton.jit
def _two_names_kernel(x_ptr, out_ptr, BLOCK: tl.constexpr):
    x = tl.load(x_ptr + tl.arange(0, BLOCK))
    unused_float, value = _pair(x)
    if tl.program_id(0) == 0:
        unused_int, value = _ints(x)
    tl.store(out_ptr + tl.arange(0, BLOCK), value)


def launches(tmp_path, name, place=None, options=None):
    """A launch of `name` as the interpreter's child records one; `place`: where the kernel is
    found (this module by default), `options`: the launch's (num_warps 4 by default)."""
    path = tmp_path / "signatures.jsonl"
    path.write_text(json.dumps({**(place or {"module": __name__}), "name": name, "constexprs": {"BLOCK": 16},
                                "types": {"x_ptr": "*i32", "out_ptr": "*fp32"},
                                "options": {"num_warps": 4} if options is None else options}) + "\n")
    return path


def test_a_kernel_the_compiler_refuses_fails_on_the_cpu(tmp_path):
    with pytest.raises(CompilationError, match="redefines"):
        lower_launched(launches(tmp_path, "_one_name_two_types_kernel"))


def test_its_repair_lowers(tmp_path):
    assert lower_launched(launches(tmp_path, "_two_names_kernel")) == 1


def glue_launches(tmp_path, name):
    """A glue file (glue_jit kernels, a GLUE_BY_WORKER table) holding this module's kernels, and a
    launch of `name` from it as the interpreter's child records one."""
    helpers = "\n\n".join(textwrap.dedent(inspect.getsource(fn.fn)) for fn in (_pair, _ints))
    kernels = "\n\n".join(textwrap.dedent(inspect.getsource(fn.fn)).replace("@triton.jit", "@glue_jit([], [])")
                            for fn in (_one_name_two_types_kernel, _two_names_kernel))
    source = ("import triton\nimport triton.language as tl\n\nfrom mstar.runtime.engine.glue_jit import glue_jit\n\n"
              f"{helpers}\n\n{kernels}\n\nGLUE_BY_WORKER = {{}}\n")
    (tmp_path / "glue_one.py").write_text(source)
    return launches(tmp_path, name, {"glue": "glue_one.py", "sha256": hashlib.sha256(source.encode()).hexdigest()},
                    options={})


def test_a_glue_kernel_the_compiler_refuses_fails_on_the_cpu(tmp_path):
    with pytest.raises(CompilationError, match="redefines"):
        lower_launched(glue_launches(tmp_path, "_one_name_two_types_kernel"))


def test_the_repaired_glue_kernel_lowers(tmp_path):
    assert lower_launched(glue_launches(tmp_path, "_two_names_kernel")) == 1
