"""Compile a spec written in a test (and its deployment) to a loaded plan, and run requests on it.

`plan_of(tmp_path, spec_text, config_text)` writes specs/<model>.mw and configs/<model>.yaml under
tmp_path, compiles them (asserting no diagnostics) and loads the plan; `run(plan, requests)` runs
them through the driver on the CPU torch engine and returns the conductor's records.
"""
from __future__ import annotations

import re
from pathlib import Path

from mstar.compiler.driver import compile_spec
from mstar.compiler.emit import write_outputs
from mstar.lang.diagnostics import Diagnostics
from mstar.plan.io import load_plan
from mstar.plan.schema import Plan
from mstar.runtime.conductor.request import Request, RequestRecord
from mstar.runtime.engine.torch_engine import TorchEngine
from mstar.runtime.serve.driver import Driver, Workload


def plan_of(tmp_path: Path, spec_text: str, config_text: str) -> Plan:
    match = re.search(r"^model (\w+)", spec_text, re.M)
    assert match is not None
    model = match.group(1)
    (tmp_path / "specs").mkdir(parents=True, exist_ok=True)
    (tmp_path / "configs").mkdir(exist_ok=True)
    spec = tmp_path / "specs" / f"{model}.mw"
    config = tmp_path / "configs" / f"{model}.yaml"
    spec.write_text(spec_text)
    config.write_text(config_text)
    diags = Diagnostics()
    result = compile_spec(spec, config, diags)
    assert result is not None, diags.render()
    write_outputs(result.plan_path, result.plan_text, result.glue_path, result.glue_text)
    return load_plan(str(result.plan_path))


def run(plan: Plan, requests: list[Request]) -> dict[str, RequestRecord]:
    driver = Driver(plan, TorchEngine(plan))
    driver.run(Workload(requests))
    return driver.conductor.records
