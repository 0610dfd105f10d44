"""Every field of the plan schema is read by the runtime, or is header data.

A plan field the runtime never reads is either dead (the compiler writes it for nothing) or, worse,
a decision the runtime re-derives on its own. The schema is walked recursively from `Plan`; a field
counts as read when some module of mstar/runtime accesses an attribute of that name (found with
ast: `x.field` in a load context, or `getattr(x, "field")`), never by a text search that comments
or strings would satisfy. The check works on names: a field whose name another object also uses
passes when either is read, so it catches fields nobody reads at all.

A field added to the schema must be read by the runtime (or removed) for this test to pass; header
data goes in HEADER_FIELDS with the reason it is not the runtime's to read.

A reading that several stages of the runtime share lives in `mstar.plan` (its stages may import
only the plan and the step contract, not each other): a module of mstar/plan that mstar/runtime
imports reads on the runtime's behalf, so its reads count (mstar/plan/stages.py: a stage's
alternatives, read by the conductor, the engines and the server). The schema itself (whose
validators read its own fields) and the plan file's loader (header data) do not count.
"""
from __future__ import annotations

import ast
import typing
from pathlib import Path
from typing import Iterable

from pydantic import BaseModel

from mstar.plan.schema import Plan

ROOT = Path(__file__).resolve().parents[2]
RUNTIME = ROOT / "mstar" / "runtime"

# field -> why the runtime does not read it (it is about the plan file, not what the plan says)
HEADER_FIELDS = {
    "generated": "the 'do not edit' marker at the top of the file, for people",
    "header": "the header block: checked by load_plan (mstar.plan.io), not by the runtime",
    "schema_version": "checked by load_plan before the runtime gets the plan",
    "compiler_version": "checked by load_plan before the runtime gets the plan",
    "spec_path": "load_plan re-hashes the spec at this path",
    "deployment_path": "load_plan re-hashes the deployment at this path",
    "glue_path": "load_plan re-hashes the glue; the runtime finds it by mstar.plan.io.input_paths",
    "hashes": "sha256 of the inputs, re-checked by load_plan",
    "spec": "Hashes.spec, re-checked by load_plan",
    "glue": "Hashes.glue, re-checked by load_plan",
    "content_sha256": "catches hand edits; checked by load_plan",
}


def _models(model: type, seen: dict[type, None]) -> None:
    if model in seen:
        return
    seen[model] = None
    for field in model.model_fields.values():
        for inner in _types(field.annotation):
            if isinstance(inner, type) and issubclass(inner, BaseModel):
                _models(inner, seen)


def _types(annotation) -> list:
    """The classes inside an annotation (Optional, list, dict, Union, Annotated unwrapped)."""
    args = typing.get_args(annotation)
    if not args:
        return [annotation]
    return [t for arg in args for t in _types(arg)]


def plan_fields() -> dict[str, list[str]]:
    """field name -> the models that declare it (`Model.field`)."""
    seen: dict[type, None] = {}
    _models(Plan, seen)
    fields: dict[str, list[str]] = {}
    for model in seen:
        for name in model.model_fields:
            fields.setdefault(name, []).append(f"{model.__name__}.{name}")
    return fields


PLAN = ROOT / "mstar" / "plan"
NOT_READERS = {"mstar.plan.schema", "mstar.plan.io"}  # the schema's own validators; the file's loader


def plan_helpers_imported(folder: Path) -> list[Path]:
    """The modules of mstar/plan that modules under `folder` import (but NOT_READERS)."""
    found: set[str] = set()
    for path in folder.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                found.add(node.module)
                found.update(f"{node.module}.{alias.name}" for alias in node.names)
            elif isinstance(node, ast.Import):
                found.update(alias.name for alias in node.names)
    paths = [ROOT.joinpath(*name.split(".")).with_suffix(".py") for name in sorted(found)
             if name.startswith("mstar.plan.") and name not in NOT_READERS]
    return [path for path in paths if path.is_file()]


def attributes_read(folder: Path, also: Iterable[Path] = ()) -> set[str]:
    """Attribute names loaded in the modules under `folder`, and in the modules `also`."""
    read: set[str] = set()
    for path in [*folder.rglob("*.py"), *also]:
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Load):
                read.add(node.attr)
            elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "getattr"
                  and len(node.args) >= 2 and isinstance(node.args[1], ast.Constant)):
                read.add(str(node.args[1].value))
    return read


def test_every_plan_field_is_read_by_the_runtime_or_is_header_data():
    read = attributes_read(RUNTIME, plan_helpers_imported(RUNTIME))
    unread = sorted(f"{where}" for name, models in plan_fields().items()
                    if name not in read and name not in HEADER_FIELDS
                    for where in models)
    assert not unread, (
        "plan fields the runtime never reads (mstar/runtime has no attribute access of that name): read each "
        "where it has a real use, or remove it from the schema, the compiler's lowering, docs/plan.md and "
        "explain:\n  " + "\n  ".join(unread)
    )


def test_header_allow_list_names_only_schema_fields():
    stale = sorted(set(HEADER_FIELDS) - set(plan_fields()))
    assert not stale, f"HEADER_FIELDS names fields the schema no longer has: {stale}"


def test_the_check_sees_attribute_reads_not_comments(tmp_path):
    (tmp_path / "a.py").write_text("# plan.num_graphs\nx = plan.capture_memory_bytes\ny = getattr(p, 'tp_size')\n"
                                   "'plan.sp_size'\nplan.memory_bytes = 3\n")
    assert attributes_read(tmp_path) == {"capture_memory_bytes"} | {"tp_size"}


def test_a_plan_helper_the_runtime_imports_reads_for_it(tmp_path):
    (tmp_path / "a.py").write_text("from mstar.plan.stages import default_walks\nimport mstar.plan.schema\n"
                                   "from mstar.plan import output_bound\n")
    helpers = {path.relative_to(PLAN).as_posix() for path in plan_helpers_imported(tmp_path)}
    assert helpers == {"stages.py", "output_bound.py"}  # not the schema
    assert "sequence_lengths" in attributes_read(tmp_path, plan_helpers_imported(tmp_path))
    assert "sequence_lengths" not in attributes_read(tmp_path)
