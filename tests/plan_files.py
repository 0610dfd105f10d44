"""A plan written where `mstar run` and `mstarc explain` can read it beside its sources (the plan
refusal tests of tests/compiler and tests/plan)."""
from __future__ import annotations

import shutil
from pathlib import Path

from mstar.plan.io import dump_plan
from mstar.plan.schema import Plan

ROOT = Path(__file__).resolve().parents[1]


def written_beside_its_sources(plan: Plan, name: str, tmp_path: Path) -> Path:
    """`plan` as generated/NAME.plan under tmp_path, with the specs, configs and glue it names."""
    for sub in ("specs", "configs"):
        shutil.copytree(ROOT / sub, tmp_path / sub)
    path = tmp_path / "generated" / f"{name}.plan"
    path.parent.mkdir()
    shutil.copy(ROOT / "generated" / f"{name}_glue.py", path.parent)
    path.write_text(dump_plan(plan))
    return path
