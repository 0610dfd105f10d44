"""Run the check passes on a fixture the way the compiler driver does, for golden tests.

A fixture is `fixtures/NAME.expected` (the exact rendered diagnostics) with its inputs:
- `fixtures/NAME.mw`, checked alone (passes 2, 3 and the spec-level part of 5) unless
- `fixtures/NAME.yaml` is there too (then passes 4 and 5 run against it);
- without `NAME.mw`, the spec is `fixtures/base.mw` and the deployment `fixtures/NAME.yaml`
  (which may be absent on purpose: MW301).
Like the driver, it stops after the first pass that leaves an error. Paths are rendered
relative to tests/checks, so run with that as the working directory.
"""
from __future__ import annotations

from pathlib import Path
from typing import Callable, Optional

from mstar.compiler import (
    check_args,
    check_combine,
    check_deployment,
    check_graph,
    check_prompt_format,
    check_roles,
    resolve,
)
from mstar.compiler.deployment import Deployment, load_deployment, parse_deployment
from mstar.lang import ast
from mstar.lang.diagnostics import Diagnostics
from mstar.lang.parser import parse

HERE = Path(__file__).parent
FIXTURES = HERE / "fixtures"


def fixture_inputs(name: str) -> tuple[str, Optional[str]]:
    """(spec path, deployment path or None), relative to tests/checks."""
    if (FIXTURES / f"{name}.mw").exists():
        spec = f"fixtures/{name}.mw"
        config = f"fixtures/{name}.yaml" if (FIXTURES / f"{name}.yaml").exists() else None
        return spec, config
    return "fixtures/base.mw", f"fixtures/{name}.yaml"


def check_spec_text(text: str) -> Diagnostics:
    """The spec-level checks of a spec given as text (it must parse): resolve, graph, then the
    combine and capture checks without a deployment, each only while no error was found."""
    diags = Diagnostics()
    spec = parse(text, "m.mw", diags)
    assert spec is not None, diags.render()
    resolve.run(spec, diags)
    if not diags.has_errors:
        check_graph.run(spec, diags)
    if not diags.has_errors:
        check_combine.run(spec, None, diags)
    return diags


def check_texts(spec_text: str, config_text: Optional[str] = None) -> Diagnostics:
    """Every check pass on a spec and deployment given as text (`m.mw`, `m.yaml`), as the driver
    runs them: passes 2 to 5, stopping after the first that reports an error."""
    diags = Diagnostics()
    spec = parse(spec_text, "m.mw", diags)
    if spec is not None and not diags.has_errors:
        load = None if config_text is None else (lambda: parse_deployment(config_text, "m.yaml", diags))
        _run_passes(spec, load, diags)
    return diags


def run_checks(spec_path: str, config_path: Optional[str], diags: Diagnostics) -> None:
    spec = parse((HERE / spec_path).read_text(encoding="utf-8"), spec_path, diags)
    if spec is None or diags.has_errors:
        return
    _run_passes(spec, None if config_path is None else (lambda: load_deployment(config_path, diags)), diags)


def _run_passes(spec: ast.Spec, load: Optional[Callable[[], Optional[Deployment]]], diags: Diagnostics) -> None:
    """Passes 2 to 5 on a parsed spec; `load` reads the deployment (None: the spec alone)."""
    for step in (resolve.run, check_args.run, check_graph.run):
        step(spec, diags)
        if diags.has_errors:
            return
    deployment = None
    if load is not None:
        deployment = load()
        if deployment is None or diags.has_errors:
            return
        check_deployment.run(spec, deployment, diags)
        if diags.has_errors:
            return
    check_combine.run(spec, deployment, diags)
    if not diags.has_errors:
        check_roles.run(spec, diags)
    if not diags.has_errors:
        check_prompt_format.run(spec, diags)


def render_fixture(name: str) -> str:
    diags = Diagnostics()
    run_checks(*fixture_inputs(name), diags)
    return diags.render()
