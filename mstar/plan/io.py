"""Write and read plans: canonical JSON text in, a validated `Plan` out.

    dump_plan(plan) -> str          canonical text: sorted keys, indent 1, lists of scalars on one
                                    line, trailing newline
    load_plan(path, verify=True)    -> Plan, or PlanError with a message that says what is wrong
                                       and the `mstarc compile ...` command that fixes it
    content_hash(plan) -> str       sha256 of the canonical text with header.content_sha256 empty
    input_paths(plan_path, plan)    {"spec", "deployment", "glue"} -> the input files' paths

`load_plan` refuses: an unreadable, truncated or non-JSON file, one that is not a regular file
or is over MAX_PLAN_BYTES, JSON nested too deeply, integers outside int64, NaN or Infinity
(docs/limits.md); a plan of another schema or
compiler version; one that fails schema validation; one whose text was edited by hand
(content hash); and, with `verify`, one whose spec, deployment or glue file on disk no longer has
the sha256 recorded in the header (each read bounded: a regular file of at most its kind's
size, so a path edited to /dev/zero or a FIFO fails at once). Header paths are relative to the
plan file's directory as named, its folders' symbolic links not resolved (`_inputs_bases`).

This package is shared by the compiler and the runtime and imports neither of them.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
from pathlib import Path

from pydantic import ValidationError

from mstar.arg_types import shown_path
from mstar.files import (
    MAX_DEPLOYMENT_BYTES, MAX_GLUE_BYTES, MAX_PLAN_BYTES, MAX_SPEC_BYTES, InputFileError,
    read_bytes_bounded, read_text_bounded,
)
from mstar.plan.references import describe, reference_problems
from mstar.plan.schema import COMPILER_VERSION, SCHEMA_VERSION, Plan

log = logging.getLogger(__name__)


class PlanError(Exception):
    """A plan that cannot be used; the message is meant for the user, as is."""


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def sha256_file(path: str | os.PathLike, max_bytes: int = MAX_PLAN_BYTES, what: str = "file") -> str:
    """sha256 of a regular file of at most `max_bytes` (InputFileError otherwise)."""
    return sha256_bytes(read_bytes_bounded(path, max_bytes=max_bytes, what=what))


# The most bytes each input a plan names may have when it is re-hashed.
_INPUT_LIMITS = {"spec": MAX_SPEC_BYTES, "deployment": MAX_DEPLOYMENT_BYTES, "glue": MAX_GLUE_BYTES}
# Integers in a plan: int64, as everything that reads them.
_MAX_PLAN_INT = 2**63 - 1


def _plan_int(text: str) -> int:
    """json's int hook: refuses integers outside int64 before Python converts thousands of digits."""
    if len(text.lstrip("-")) > 19 or not -_MAX_PLAN_INT - 1 <= int(text) <= _MAX_PLAN_INT:
        raise ValueError(f"integer {text[:20]}{'...' if len(text) > 20 else ''} is out of range")
    return int(text)


def _plan_constant(text: str):
    """json's hook for NaN and Infinity, which are not JSON: a plan never holds them."""
    raise ValueError(f"{text} is not a JSON number")


def _is_flat(value) -> bool:
    return isinstance(value, list) and not any(isinstance(v, (list, dict)) for v in value)


def _emit(value, indent: int, out: list[str]) -> None:
    """JSON with sorted keys, one key per line (indent 1), and lists of scalars on one line
    (`"batch_sizes": [1, 2, 4]`) so tables stay short and diffs stay readable."""
    pad = " " * (indent + 1)
    if isinstance(value, dict) and value:
        out.append("{\n")
        items = sorted(value.items())
        for i, (key, item) in enumerate(items):
            out.append(f"{pad}{json.dumps(key, ensure_ascii=False)}: ")
            _emit(item, indent + 1, out)
            out.append(",\n" if i < len(items) - 1 else "\n")
        out.append(" " * indent + "}")
    elif isinstance(value, list) and value and not _is_flat(value):
        out.append("[\n")
        for i, item in enumerate(value):
            out.append(pad)
            _emit(item, indent + 1, out)
            out.append(",\n" if i < len(value) - 1 else "\n")
        out.append(" " * indent + "]")
    else:
        out.append(json.dumps(value, ensure_ascii=False, separators=(", ", ": ")))


def _canonical(data: dict) -> str:
    out: list[str] = []
    _emit(data, 0, out)
    out.append("\n")
    return "".join(out)


def _plan_data(plan: Plan) -> dict:
    return plan.model_dump(mode="json", by_alias=True)


def content_hash(plan: Plan) -> str:
    """sha256 of the plan's canonical text with `header.content_sha256` blanked."""
    data = _plan_data(plan)
    data["header"]["content_sha256"] = ""
    return sha256_bytes(_canonical(data).encode("utf-8"))


def dump_plan(plan: Plan) -> str:
    """The canonical text of a plan. Two equal plans give identical bytes."""
    return _canonical(_plan_data(plan))


def recompile_command(plan_path: str | os.PathLike, header: dict) -> str:
    """`mstarc compile SPEC --config CONFIG -o PLAN` with paths as the user would type them; an
    input the header's path does not find (a plan moved away from its inputs: the paths are
    relative to the plan's directory) stays the placeholder rather than a path that is not there."""
    def shown(key: str, placeholder: str) -> str:
        named = header.get(key)
        try:
            if not isinstance(named, str) or "\0" in named or not _input_path(plan_path, named).is_file():
                return placeholder
        except (OSError, ValueError):  # a name the OS cannot take (ENAMETOOLONG, a lone surrogate)
            return placeholder
        return _display(_input_path(plan_path, named))

    return (f"mstarc compile {shown('spec_path', 'SPEC')} --config {shown('deployment_path', 'CONFIG')} "
            f"-o {shown_path(_display(Path(plan_path)))}")


def _display(path: Path) -> str:
    """A path relative to the working directory when it lies below it, else absolute; `..`
    segments from joining header paths to the plan's directory are folded first, so a plan
    outside the working directory names `/x/specs/a.mw`, never `../../x/specs/a.mw`."""
    folded = os.path.normpath(os.path.abspath(path))
    try:
        rel = os.path.relpath(folded)
    except ValueError:
        return folded
    return folded if rel == os.pardir or rel.startswith(os.pardir + os.sep) else rel


def _read_json(path: Path) -> dict:
    if "\0" not in str(path) and not _may_exist(path):  # (a name the OS cannot take may: the read below says so)
        # a relative path says where it was looked for: a bench's default plan (generated/...) run
        # outside the repository root was "does not exist" with no hint that the folder was the cause
        where = "" if Path(path).is_absolute() else f" (looked for under {shown_path(os.getcwd())})"
        raise PlanError(f"plan {shown_path(path)} does not exist{where}; compile one with `mstarc compile SPEC`")
    try:
        text = read_text_bounded(path, max_bytes=MAX_PLAN_BYTES, what="plan")
    except InputFileError as e:
        raise PlanError(f"cannot read {e}") from None
    how = "it was truncated or edited. Recompile it with `mstarc compile SPEC --config CONFIG` or `mstarc regen`"
    try:
        data = json.loads(text, parse_int=_plan_int, parse_constant=_plan_constant)
    except json.JSONDecodeError as e:
        raise PlanError(f"plan {shown_path(path)} is not valid JSON (line {e.lineno}, column {e.colno}: {e.msg}); "
                        f"{how}") from None
    except RecursionError:
        raise PlanError(f"plan {shown_path(path)} nests its values too deeply to be a plan; {how}") from None
    except ValueError as e:  # from the hooks above
        raise PlanError(f"plan {shown_path(path)} is not a valid plan ({e}); {how}") from None
    if not isinstance(data, dict) or not isinstance(data.get("header"), dict):
        raise PlanError(f"plan {shown_path(path)} has no header object; it is not an mstarc plan")
    return data


def _check_versions(path: Path, header: dict) -> None:
    how = recompile_command(path, header)
    schema_version = header.get("schema_version")
    if schema_version != SCHEMA_VERSION:
        raise PlanError(
            f"plan {shown_path(path)} has schema version {schema_version!r}, this mstar reads version "
            f"{SCHEMA_VERSION}; recompile: {how}"
        )
    compiler_version = header.get("compiler_version")
    if compiler_version != COMPILER_VERSION:
        raise PlanError(
            f"plan {shown_path(path)} was written by mstarc {compiler_version!r}, this is mstarc "
            f"{COMPILER_VERSION}; recompile: {how}"
        )


def _validate(path: Path, data: dict) -> Plan:
    try:
        return Plan.model_validate(data)
    except ValidationError as e:
        problems = []
        for err in e.errors()[:5]:
            where = ".".join(str(p) for p in err["loc"]) or "<plan>"
            problems.append(f"  {where}: {err['msg']}")
        more = "" if e.error_count() <= 5 else f"\n  ... and {e.error_count() - 5} more"
        raise PlanError(
            f"plan {shown_path(path)} does not match the plan schema (edited by hand?):\n"
            + "\n".join(problems)
            + more
            + f"\nrecompile: {recompile_command(path, data['header'])}"
        ) from None


def _check_inputs(path: Path, plan: Plan) -> None:
    how = recompile_command(path, plan.header.model_dump())
    hashes = plan.header.hashes
    expected_hashes = {"spec": hashes.spec, "deployment": hashes.deployment, "glue": hashes.glue}
    for what, file in input_paths(path, plan).items():
        expected = expected_hashes[what]
        try:
            actual = sha256_file(file, _INPUT_LIMITS[what], what)
        except InputFileError as e:
            shown = e.path if "\0" in str(file) else shown_path(_display(file))  # e.path: the repr of a NUL path
            moved = ("" if what == "glue" or "\0" in str(file) or _may_exist(file) else
                     " (the plan names its inputs relative to its own directory: a plan moved or copied away "
                     "from them no longer finds them)")
            raise PlanError(
                f"plan {shown_path(path)}: cannot read its {what} file {shown} ({e.reason}){moved}; "
                f"recompile: {how}") from None
        if actual != expected:
            raise PlanError(
                f"plan {shown_path(path)} is stale: its {what} file {shown_path(_display(file))} changed since the "
                f"plan was compiled (sha256 {actual[:12]}..., plan has {expected[:12]}...); "
                f"recompile: {how}"
            )


def _inputs_bases(plan_path: str | os.PathLike) -> list[Path]:
    """The directories the header's input paths may be relative to, as mstarc wrote them: the
    plan's directory as named (a symbolic link among its folders not resolved: mstarc writes the
    same paths with or without one), or for a plan that is itself a symbolic link the directory of
    the file it names (mstarc writes through the link, the glue beside that file); after the named
    one, the real one (a plan written by an mstarc that resolved the folders' links); the path's
    own for one the OS cannot resolve (a NUL)."""
    if "\0" in str(plan_path):
        return [Path(plan_path).parent]
    real = Path(os.path.realpath(plan_path)).parent
    try:
        if Path(plan_path).is_symlink():
            return [real]
    except (OSError, ValueError):  # a name the OS cannot take (ENAMETOOLONG)
        return [real]
    named = Path(os.path.abspath(plan_path)).parent
    return [named] if named == real else [named, real]


def _input_path(plan_path: str | os.PathLike, name: str) -> Path:
    """A header's input path `name` joined to the first of `_inputs_bases` where it may exist
    (else the first), its `..` folded as mstarc made them: by the names, not through a linked
    folder (`generated/../specs` with generated/ a link is the specs/ beside that link)."""
    found = [Path(os.path.normpath(base / name)) for base in _inputs_bases(plan_path)]
    return next((path for path in found if _may_exist(path)), found[0])


def _may_exist(path: Path) -> bool:
    """path.exists(), true where the OS cannot say (a name it cannot take: ENAMETOOLONG raised)."""
    try:
        return path.exists()
    except (OSError, ValueError):
        return True


def _is_glue_name(name: str) -> bool:
    """A glue path as mstarc writes it: a bare file name, NAME_glue.py, beside the plan. The
    runtime imports the glue as Python, so a plan edited to name a file elsewhere (its hash
    recomputed: the plan's own hash only catches careless edits) must not reach an import."""
    return name == Path(name).name and name.endswith("_glue.py") and not any(c in name for c in "\\\0")


def input_paths(plan_path: str | os.PathLike, plan: Plan) -> dict[str, Path]:
    """The plan's inputs on disk: {"spec", "deployment", "glue"} -> path (header paths are
    relative to `_inputs_bases`). The runtime imports the glue from `["glue"]`."""
    header = plan.header
    return {
        "spec": _input_path(plan_path, header.spec_path),
        "deployment": _input_path(plan_path, header.deployment_path),
        "glue": _input_path(plan_path, header.glue_path),
    }


def load_plan(path: str | os.PathLike, verify: bool = True) -> Plan:
    """Read, validate and (with `verify`) re-check a plan against its inputs on disk.

    Raises PlanError (never another exception for a bad file) naming what is wrong and how to
    recompile. Without `verify` the input files are not re-hashed (the content hash, versions
    and schema are always checked).
    """
    path = Path(path)
    data = _read_json(path)
    _check_versions(path, data["header"])
    plan = _validate(path, data)
    try:
        actual = content_hash(plan)
    except UnicodeEncodeError:  # a "\ud800" escape in the JSON: an internal error of every command before
        raise PlanError(f"plan {shown_path(path)} holds a string with an unpaired surrogate (a \\udXXX escape), "
                        "which mstarc never writes: it was edited by hand. Recompile: "
                        f"{recompile_command(path, data['header'])}") from None
    if plan.header.content_sha256 != actual:
        raise PlanError(
            f"plan {shown_path(path)} was edited after it was compiled (content hash mismatch); "
            f"recompile: {recompile_command(path, data['header'])}"
        )
    problems = reference_problems(plan)
    if problems:
        raise PlanError(
            f"plan {shown_path(path)}: its tables do not fit together ({describe(problems)}); mstarc does not "
            f"write such a plan, so it was edited by hand. Recompile: {recompile_command(path, data['header'])}"
        )
    if not _is_glue_name(plan.header.glue_path):
        raise PlanError(
            f"plan {shown_path(path)} names its glue {plan.header.glue_path!r}; the runtime imports that file, so it "
            f"must be a file beside the plan named NAME_glue.py, as mstarc writes it. Recompile: "
            f"{recompile_command(path, data['header'])}"
        )
    if verify:
        _check_inputs(path, plan)
    log.info("loaded plan %s: model %s, deployment %s, %d nodes, %d workers%s", path, plan.header.model,
             plan.header.deployment, len(plan.nodes), len(plan.workers),
             "" if verify else " (inputs not re-hashed)")
    return plan
