"""Glue modules for the kernel tests: rendered from the hand-built plan, or checked in."""
from __future__ import annotations

from pathlib import Path
from types import ModuleType

from glue_plans import tiny_plan

from mstar.compiler.glue import render_glue
from mstar.plan.io import load_plan, sha256_file
from mstar.runtime.engine.glue_loader import load_glue, load_plan_glue
from mstar.runtime.engine.glue_reference import KeyGlue

REPO_ROOT = Path(__file__).resolve().parents[2]


def tiny_glue_module(directory: Path, page_size: int) -> ModuleType:
    path = directory / f"tiny_p{page_size}_glue.py"
    path.write_text(render_glue(tiny_plan(page_size=page_size, num_workers=2, differing_worker=True),
                                "tiny", f"tiny_p{page_size}"))
    return load_glue(path, sha256_file(path))


def key_glues(module: ModuleType) -> list[KeyGlue]:
    """Each distinct KeyGlue of the module once, in worker then key order."""
    seen: list[KeyGlue] = []
    for rank in sorted(module.GLUE_BY_WORKER):
        for key in sorted(module.GLUE_BY_WORKER[rank]):
            if all(module.GLUE_BY_WORKER[rank][key] is not known for known in seen):
                seen.append(module.GLUE_BY_WORKER[rank][key])
    return seen


def checked_in_glue(glue_path: Path) -> ModuleType:
    """A glue file of generated/, loaded as the runtime loads it: checked against its plan's hash."""
    plan_path = glue_path.with_name(glue_path.name.removesuffix("_glue.py") + ".plan")
    return load_plan_glue(plan_path, load_plan(plan_path, verify=False))


def generated_glue_files() -> list[Path]:
    return sorted((REPO_ROOT / "generated").glob("*_glue.py"))


def sample_generated_glue_files() -> list[Path]:
    """The checked-in glue the kernel tests run: orpheus's (prefill + decode looping on the
    device, streaming to the codec) when present, else the first one; [] before any exist."""
    files = generated_glue_files()
    preferred = [path for path in files if path.name == "orpheus_glue.py"]
    return preferred or files[:1]
