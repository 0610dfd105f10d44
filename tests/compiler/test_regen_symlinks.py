"""`mstarc regen` and `regen --check` give the same bytes whether specs/, configs/ or generated/
is a symbolic link to a folder elsewhere: a plan's header names its inputs relative to its
directory as named, not resolved (resolved, a linked folder changed every header path, so every
plan's bytes and hash, and `--check` called them all stale). The runtime finds a plan's inputs so
(plan/io.py `input_paths`), and still those of a plan written relative to its real folder."""
from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from mstar.cli.mstarc import main
from mstar.compiler.driver import compile_spec
from mstar.lang.diagnostics import Diagnostics
from mstar.plan.io import input_paths, load_plan

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = ("orpheus", "llama")


def _layout(root: Path) -> None:
    """specs/, configs/ and generated/ as the repository has them, for CONFIGS."""
    shutil.copytree(ROOT / "specs", root / "specs")
    (root / "configs").mkdir()
    (root / "generated").mkdir()
    for name in CONFIGS:
        shutil.copy(ROOT / "configs" / f"{name}.yaml", root / "configs")
        for made in (f"{name}.plan", f"{name}_glue.py"):
            shutil.copy(ROOT / "generated" / made, root / "generated")


def _linked(tmp_path: Path, folder: str) -> Path:
    """The layout in tmp_path/repo with `folder` moved to tmp_path/elsewhere/deeper and linked back
    (deeper: a path from the real folder read from the link's must not land on the file by chance)."""
    root = tmp_path / "repo"
    root.mkdir()
    _layout(root)
    moved = tmp_path / "elsewhere" / "deeper" / folder
    moved.parent.mkdir(parents=True)
    shutil.move(str(root / folder), moved)
    (root / folder).symlink_to(moved, target_is_directory=True)
    return root


@pytest.mark.parametrize("folder", ["specs", "configs", "generated"])
def test_regen_gives_the_same_bytes_through_a_linked_folder(tmp_path, folder, capsys):
    root = _linked(tmp_path, folder)
    assert main(["regen", "--check", "--root", str(root)]) == 0, capsys.readouterr()
    assert main(["regen", "--root", str(root)]) == 0
    for name in CONFIGS:
        for made in (f"{name}.plan", f"{name}_glue.py"):
            assert (root / "generated" / made).read_bytes() == (ROOT / "generated" / made).read_bytes(), made
        plan_path = root / "generated" / f"{name}.plan"
        load_plan(plan_path)  # verify: its spec, deployment and glue found and hashed
        paths = input_paths(plan_path, load_plan(plan_path, verify=False))
        assert paths["spec"] == root / "specs" / f"{name}.mw"  # beside the link, not beside its target


def test_a_plan_written_relative_to_its_real_folder_still_finds_its_inputs(tmp_path):
    """Compiled to generated/'s real folder (or by an mstarc that resolved the links), the header
    paths lead from there; run through the link, the plan still finds them."""
    root = _linked(tmp_path, "generated")
    real_plan = tmp_path / "elsewhere" / "deeper" / "generated" / "llama.plan"
    diags = Diagnostics()
    result = compile_spec(root / "specs" / "llama.mw", root / "configs" / "llama.yaml", diags, real_plan)
    assert result is not None and not diags.has_errors
    assert result.plan.header.spec_path == "../../../repo/specs/llama.mw"
    real_plan.write_text(result.plan_text)
    result.glue_path.write_text(result.glue_text)
    plan_path = root / "generated" / "llama.plan"
    load_plan(plan_path)
    assert input_paths(plan_path, load_plan(plan_path, verify=False))["spec"] == root / "specs" / "llama.mw"
