"""The compiler driver: one spec + one deployment -> a plan and its glue, pass by pass.

    compile_spec(spec_path, config_path, diags) -> CompileResult | None

Reads as a table of contents: read the inputs, then

    1 parse            mstar.lang.parser.parse
    2 resolve          mstar.compiler.resolve, then mstar.compiler.check_args
    3 check_graph      mstar.compiler.check_graph
      load_deployment  mstar.compiler.deployment
    4 check_deployment mstar.compiler.check_deployment
    5 check_combine    mstar.compiler.check_combine, then check_roles and check_prompt_format
    6 lower            mstar.compiler.lower
      glue             mstar.compiler.glue.render_glue
    7 emit             mstar.compiler.emit

stopping after any pass that left an error in `diags` (the caller renders them). A missing or
unreadable spec file is a diagnostic (MW500; a deployment file, load_deployment's MW301), never
an exception, and so is a plan or glue past the sizes `load_plan` reads (MW501). Nothing is written here:
`emit.write_outputs(...)` writes a result's files.

Default paths: the config of `specs/<model>.mw` is `configs/<model>.yaml` beside `specs/`; the
outputs of config `X` go to `generated/X.plan` and `generated/X_glue.py` beside `specs/`.
"""
from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

from mstar.arg_types import shown_path
from mstar.compiler import (
    check_args, check_combine, check_deployment, check_graph, check_prompt_format, check_roles, emit, lower, resolve,
)
from mstar.compiler.codes import DEPLOYMENT_UNREADABLE
from mstar.compiler.deployment import Deployment, load_deployment
from mstar.files import (MAX_DEPLOYMENT_BYTES, MAX_GLUE_BYTES, MAX_PLAN_BYTES, MAX_SPEC_BYTES, InputFileError,
                         read_bytes_bounded)
from mstar.lang.ast import Span, Spec
from mstar.lang.diagnostics import Diagnostics
from mstar.lang.parser import parse
from mstar.plan.io import sha256_bytes
from mstar.plan.schema import COMPILER_VERSION, Hashes, Header, Plan

log = logging.getLogger(__name__)

# The driver's own diagnostics: an input file that cannot be read; an output the runtime would refuse.
MW500 = "MW500"
MW501 = "MW501"


@dataclass
class CompileResult:
    """What one compile produced; `plan_text`/`glue_text` are exactly the bytes to write."""

    spec: Spec
    deployment: Deployment
    plan: Plan
    plan_text: str
    glue_text: str
    plan_path: Path
    glue_path: Path
    seconds_per_pass: dict[str, float] = field(default_factory=dict)


def _above_spec(spec_path: str | os.PathLike) -> Path:
    """The directory above the spec's, absolute for an absolute spec path, else relative to the
    working directory: `llama.mw` run from specs/ is `..` (its own `parent.parent` was `.`, which
    looked for configs/ and wrote generated/ inside specs/)."""
    above = Path(os.path.abspath(spec_path)).parent.parent
    return above if Path(spec_path).is_absolute() else Path(os.path.relpath(above))


def default_config_path(spec_path: str | os.PathLike, model: str) -> Path:
    """configs/<model>.yaml in the directory above the spec's (specs/../configs)."""
    return _above_spec(spec_path) / "configs" / f"{model}.yaml"


def default_plan_path(spec_path: str | os.PathLike, config_path: str | os.PathLike) -> Path:
    """generated/<config name>.plan in the directory above the spec's."""
    return _above_spec(spec_path) / "generated" / f"{Path(config_path).stem}.plan"


def glue_path_for(plan_path: Path) -> Path:
    """The glue file written next to a plan: generated/orpheus.plan -> generated/orpheus_glue.py."""
    return plan_path.with_name(f"{plan_path.stem}_glue.py")


# The most bytes each input may have (mstar/files.py; docs/limits.md).
_INPUT_LIMITS = {"spec": MAX_SPEC_BYTES, "deployment": MAX_DEPLOYMENT_BYTES}


def _read_input(path: Path, what: str, diags: Diagnostics) -> bytes | None:
    """The file's bytes, or None with MW500: missing, not a regular file (a FIFO or /dev/zero
    would read forever), over its size limit, unreadable."""
    try:
        return read_bytes_bounded(path, max_bytes=_INPUT_LIMITS[what], what=what)
    except InputFileError as e:
        span = Span(file=repr(str(path)) if "\0" in str(path) else str(path))
        if e.reason == "no such file":
            diags.error(MW500, f"{what} file not found: {shown_path(path)}", span)
        elif e.reason.startswith("is a directory"):
            diags.error(MW500, f"{what} path is a directory, not a file: {shown_path(path)}", span)
        else:
            diags.error(MW500, f"cannot read {what} file {shown_path(e.path)}: {e.reason}", span)
    return None


def _decode(data: bytes, path: Path, what: str, diags: Diagnostics) -> str | None:
    """UTF-8 text; a leading byte-order mark is dropped (docs/limits.md), as `mstarc fmt` drops it."""
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        diags.error(MW500, f"{what} file {path} is not UTF-8 text (byte {e.start})", Span(file=str(path)))
        return None


def _header(spec: Spec, spec_path: Path, config_path: Path, plan_path: Path, glue_path: Path,
            spec_bytes: bytes, config_bytes: bytes) -> Header:
    # Relative to the plan's directory as named, not resolved: a symbolic link among the folders
    # (generated/ or specs/ linked elsewhere) changed the paths, so the plan's bytes and its hash,
    # and `mstarc regen --check` called every plan stale. The runtime reads them so (plan/io.py).
    base = Path(os.path.abspath(plan_path)).parent
    return Header(
        compiler_version=COMPILER_VERSION,
        model=spec.model,
        deployment=config_path.stem,
        spec_path=os.path.relpath(spec_path, base),
        deployment_path=os.path.relpath(config_path, base),
        glue_path=os.path.relpath(glue_path, base),
        hashes=Hashes(spec=sha256_bytes(spec_bytes), deployment=sha256_bytes(config_bytes), glue=""),
    )


class _Timer:
    """Seconds spent per pass, for `mstarc bench`."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self._start = time.perf_counter()

    def lap(self, name: str) -> None:
        now = time.perf_counter()
        self.seconds[name] = now - self._start
        self._start = now
        log.debug("pass %s: %.2f ms", name, self.seconds[name] * 1000)


def _load_spec(spec_path: Path, diags: Diagnostics, timer: _Timer) -> tuple[Spec, bytes] | None:
    """Passes 1-3 on the spec file: (spec, its bytes), or None when diags holds errors."""
    spec_bytes = _read_input(spec_path, "spec", diags)
    spec_text = None if spec_bytes is None else _decode(spec_bytes, spec_path, "spec", diags)
    if spec_bytes is None or spec_text is None:
        return None
    timer.lap("read")
    spec = parse(spec_text, str(spec_path), diags)
    timer.lap("parse")
    if spec is None or diags.has_errors:
        return None
    resolve.run(spec, diags)
    if not diags.has_errors:
        check_args.run(spec, diags)
    timer.lap("resolve")
    if diags.has_errors:
        return None
    check_graph.run(spec, diags)
    timer.lap("check_graph")
    if diags.has_errors:
        return None
    return spec, spec_bytes


def load_checked_spec(spec_path: str | os.PathLike, diags: Diagnostics) -> Spec | None:
    """A spec that passed parse, resolve and check_graph (no deployment needed: `mstarc graph`),
    or None when diags holds errors."""
    loaded = _load_spec(Path(spec_path), diags, _Timer())
    return None if loaded is None else loaded[0]


@dataclass
class Checked:
    """A spec and deployment that passed every check (passes 1-5), with their file bytes."""

    spec: Spec
    deployment: Deployment
    spec_path: Path
    config_path: Path
    spec_bytes: bytes
    config_bytes: bytes


def check_spec(
    spec_path: str | os.PathLike,
    config_path: str | os.PathLike | None,
    diags: Diagnostics,
    timer: _Timer | None = None,
) -> Checked | None:
    """Passes 1-5 (`mstarc check`); None when `diags` holds errors. config_path None: the
    spec's default config."""
    timer = timer or _Timer()
    spec_path = Path(spec_path)
    loaded = _load_spec(spec_path, diags, timer)
    if loaded is None:
        return None
    spec, spec_bytes = loaded

    if config_path is None:
        config_path = default_config_path(spec_path, spec.model)
        if not config_path.exists():
            diags.error(DEPLOYMENT_UNREADABLE,
                        f"no --config given, and the default deployment for model {spec.model!r}, "
                        f"{shown_path(config_path)}, does not exist; pass --config FILE", Span(file=str(spec_path)))
            return None
    config_path = Path(config_path)
    deployment = load_deployment(str(config_path), diags)  # an unreadable file is its MW301
    timer.lap("load_deployment")
    if deployment is None or diags.has_errors:
        return None
    config_bytes = _read_input(config_path, "deployment", diags)
    if config_bytes is None:
        return None
    check_deployment.run(spec, deployment, diags)
    timer.lap("check_deployment")
    if diags.has_errors:
        return None
    check_combine.run(spec, deployment, diags)
    if not diags.has_errors:
        check_roles.run(spec, diags)
    if not diags.has_errors:
        check_prompt_format.run(spec, diags)
    timer.lap("check_combine")
    if diags.has_errors:
        return None
    return Checked(spec, deployment, spec_path, config_path, spec_bytes, config_bytes)


def compile_spec(
    spec_path: str | os.PathLike,
    config_path: str | os.PathLike | None,
    diags: Diagnostics,
    plan_path: str | os.PathLike | None = None,
) -> CompileResult | None:
    """Compile one spec against one deployment (passes 1-7); None when `diags` holds errors.

    config_path None: the spec's default config. plan_path None: generated/<config>.plan; an
    existing directory: <config>.plan inside it.
    """
    timer = _Timer()
    checked = check_spec(spec_path, config_path, diags, timer)
    if checked is None:
        return None
    spec, deployment = checked.spec, checked.deployment
    if plan_path is None:
        plan_path = default_plan_path(checked.spec_path, checked.config_path)
    plan_path = Path(plan_path)
    if plan_path.is_dir():  # `-o generated/`: the default name inside that folder
        plan_path = plan_path / f"{checked.config_path.stem}.plan"
    if plan_path.is_symlink():
        # The plan is written through the link (as shell redirection does), so its glue goes beside
        # the file it lands in, named after it: beside the link, the plan named "../lnk/x_glue.py"
        # and every run refused it. The runtime finds the glue beside the plan's real file.
        plan_path = Path(os.path.realpath(plan_path))
    glue_path = glue_path_for(plan_path)
    header = _header(spec, checked.spec_path, checked.config_path, plan_path, glue_path,
                     checked.spec_bytes, checked.config_bytes)
    plan = lower.run(spec, deployment, header)
    timer.lap("lower")
    glue_text = render_glue(plan)
    timer.lap("glue")
    plan = emit.finish(plan, glue_text)
    plan_text = emit.plan_text(plan)
    timer.lap("emit")
    if not _outputs_fit(plan_text, glue_text, checked.spec_path, diags):
        return None
    log.info("compiled %s with %s in %.1f ms", checked.spec_path, checked.config_path,
             sum(timer.seconds.values()) * 1000)
    return CompileResult(spec, deployment, plan, plan_text, glue_text, plan_path, glue_path, timer.seconds)


def _outputs_fit(plan_text: str, glue_text: str, spec_path: Path, diags: Diagnostics) -> bool:
    """Whether the plan and its glue are within the sizes `load_plan` reads (mstar/files.py); MW501
    otherwise, nothing written: a plan the runtime then refused would pass `mstarc compile`."""
    fits = True
    for what, text, limit in (("plan", plan_text, MAX_PLAN_BYTES), ("glue", glue_text, MAX_GLUE_BYTES)):
        size = len(text.encode("utf-8"))
        if size > limit:
            diags.error(MW501, f"the {what} would be {size:,} bytes, past the {limit:,} that `mstar run` reads "
                               f"(docs/limits.md): fewer walks, nodes or captures",
                        Span(file=str(spec_path)))
            fits = False
    return fits


def render_glue(plan: Plan) -> str:
    """The Triton glue of a plan (GLUE helper's templates). The glue reads the plan's tables,
    never its hashes; model and config names only go into its header comment. Imported here,
    on use, because it pulls in Jinja2, which `mstarc check` does not need."""
    from mstar.compiler.glue import render_glue as render

    return render(plan, plan.header.model, plan.header.deployment)
