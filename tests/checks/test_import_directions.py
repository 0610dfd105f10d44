"""Imports run one way (DESIGN.md, Layout): `lang` <- `compiler` -> `plan` <- `runtime`, `cli` on
top, `mstar.files` below everything but `mstar.arg_types` (below the packages whose commands parse
arguments, and below every module whose messages clip a request's values with its `shown` or a
path with its `shown_path`: the file readers, the compiler's diagnostics, the plan, the conductor).
Inside the runtime each stage imports only itself, the plan and the step contract
(`mstar.runtime.step`); the run loop (`serve`) ties the stages together. The scheduler and the
conductor touch no tensors. Every import statement of every module is checked,
including imports inside functions."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "mstar"

# package prefix -> prefixes it may import (its own prefix is always allowed)
ALLOWED: dict[str, tuple[str, ...]] = {
    "mstar.files": ("mstar.arg_types",),  # arg_types.shown_path: an InputFileError's path, clipped
    "mstar.arg_types": (),  # argparse types of every command's parser, the runtime's bench mains too
    "mstar.lang": ("mstar.files", "mstar.arg_types"),  # shown_path: a diagnostic's file, clipped
    "mstar.plan": ("mstar.files", "mstar.arg_types"),  # arg_types.shown: the one clipper of echoed values
    "mstar.compiler": ("mstar.files", "mstar.arg_types", "mstar.lang", "mstar.plan"),
    "mstar.runtime.step": (),
    "mstar.runtime.scheduler": ("mstar.files", "mstar.plan"),
    "mstar.runtime.conductor": ("mstar.files", "mstar.arg_types", "mstar.plan", "mstar.runtime.step"),
    "mstar.runtime.engine": ("mstar.files", "mstar.arg_types", "mstar.plan", "mstar.runtime.step"),
    "mstar.runtime.serve": ("mstar.files", "mstar.arg_types", "mstar.plan", "mstar.runtime"),
    "mstar.runtime": ("mstar.files", "mstar.plan"),
    "mstar.cli": ("mstar",),
    "mstar": ("mstar",),
}
NO_TENSORS = ("mstar.runtime.scheduler", "mstar.runtime.conductor", "mstar.plan", "mstar.lang")


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _owner(module: str) -> str:
    """The longest ALLOWED prefix that `module` falls under."""
    matches = [p for p in ALLOWED if module == p or module.startswith(p + ".")]
    return max(matches, key=len)


def _is_module(name: str) -> bool:
    path = ROOT.joinpath(*name.split("."))
    return path.with_suffix(".py").exists() or (path / "__init__.py").exists()


def _imports(path: Path) -> list[tuple[int, str]]:
    """(line, module) for every import; `from P import m` counts as P.m when m is a module."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.extend((node.lineno, alias.name) for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for alias in node.names:
                full = f"{node.module}.{alias.name}"
                found.append((node.lineno, full if _is_module(full) else node.module))
    return found


def _is_under(module: str, prefix: str) -> bool:
    return module == prefix or module.startswith(prefix + ".")


def _violations() -> list[str]:
    bad = []
    for path in sorted(PACKAGE.rglob("*.py")):
        module = _module_name(path)
        owner = _owner(module)
        allowed = (owner,) + ALLOWED[owner]
        for line, imported in _imports(path):
            where = f"{path.relative_to(ROOT)}:{line}"
            top = imported.split(".")[0]
            if top == "torch" and any(_is_under(module, p) for p in NO_TENSORS):
                bad.append(f"{where}: {module} must not touch tensors (imports {imported})")
            elif top == "mstar" and not any(_is_under(imported, p) for p in allowed):
                bad.append(f"{where}: {module} imports {imported} (allowed: {', '.join(allowed)})")
    return bad


def test_imports_run_one_way():
    violations = _violations()
    assert not violations, "imports against the directions of DESIGN.md:\n" + "\n".join(violations)


@pytest.mark.parametrize("module,imported,is_ok", [
    ("mstar.runtime.engine.sim", "mstar.compiler.node_args", False),
    ("mstar.runtime.conductor.conductor", "mstar.runtime.engine.torch_engine", False),
    ("mstar.runtime.scheduler.scheduler", "mstar.runtime.conductor.request", False),
    ("mstar.runtime.serve.driver", "mstar.runtime.engine.sim", True),
    ("mstar.plan.io", "mstar.lang.parser", False),
    ("mstar.compiler.lower", "mstar.plan.schema", True),
])
def test_the_rule_itself(module, imported, is_ok):
    """The checker tells a wrong-way import from a right one (so the test above can fail)."""
    owner = _owner(module)
    allowed = (owner,) + ALLOWED[owner]
    assert any(_is_under(imported, p) for p in allowed) == is_ok
