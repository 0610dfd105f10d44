"""A spec compiled against a deployment of the test's own, for tests that need a plan variant the
checked-in plans are not (a stop token the tiny model samples, a deployment split across ranks).

    compiled(spec, deployment, folder) -> the plan's path (its glue beside it)
"""
from __future__ import annotations

from pathlib import Path


def compiled(spec: Path, deployment: Path, folder: Path) -> Path:
    """`spec` compiled against `deployment` into `folder`, its plan and glue written; the test fails
    with the compiler's diagnostics when it does not compile."""
    from mstar.compiler.driver import compile_spec
    from mstar.compiler.emit import write_outputs
    from mstar.lang.diagnostics import Diagnostics

    diags = Diagnostics()
    result = compile_spec(spec, deployment, diags, folder)
    assert result is not None, diags.render()
    write_outputs(result.plan_path, result.plan_text, result.glue_path, result.glue_text)
    return Path(result.plan_path)
