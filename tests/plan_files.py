"""Plans edited as a hand would edit them (JSON changed, the content hash recomputed, so only the
loader's table checks can catch it), the lookups such edits use, and a plan written where `mstar
run` and `mstarc explain` can read it beside its sources (the plan refusal tests of tests/compiler
and tests/plan)."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

from mstar.plan.io import content_hash, dump_plan
from mstar.plan.schema import Plan

ROOT = Path(__file__).resolve().parents[1]


def rehashed(plan: Plan) -> Plan:
    """`plan` with its header's content hash recomputed."""
    return plan.model_copy(update={"header": plan.header.model_copy(update={"content_sha256": content_hash(plan)})})


def edited_plan(name: str, edit) -> Plan:
    """generated/NAME.plan's JSON edited by `edit`, re-validated, its content hash recomputed."""
    data = json.loads((ROOT / "generated" / f"{name}.plan").read_text())
    edit(data)
    return rehashed(Plan.model_validate(data))


def plan_walk(data: dict, name: str) -> dict:
    return next(w for w in data["walks"] if w["name"] == name)


def plan_node(data: dict, name: str) -> dict:
    return next(n for n in data["nodes"] if n["name"] == name)


def plan_key(data: dict, name: str) -> dict:
    return next(k for w in data["workers"] for k in w["keys"] if k["name"] == name)


def written_beside_its_sources(plan: Plan, name: str, tmp_path: Path) -> Path:
    """`plan` as generated/NAME.plan under tmp_path, with the specs, configs and glue it names."""
    for sub in ("specs", "configs"):
        shutil.copytree(ROOT / sub, tmp_path / sub)
    path = tmp_path / "generated" / f"{name}.plan"
    path.parent.mkdir()
    shutil.copy(ROOT / "generated" / f"{name}_glue.py", path.parent)
    path.write_text(dump_plan(plan))
    return path
