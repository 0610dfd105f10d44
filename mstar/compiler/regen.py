"""Rebuild generated/ from specs/ and configs/ (`mstarc regen`), or check it is current.

In:  a repository root holding configs/*.yaml, specs/<model>.mw and generated/.
Out: `expected_outputs(root, diags) -> dict[Path, str]` (every plan and glue file the compiler
     makes: one pair per config, compiled against the spec its `model:` names);
     `stale_files(root, expected) -> list[Stale]` (missing, different or orphaned files);
     `write(root, expected)` rewrites what differs and deletes orphans.

An orphan is a `*.plan` or `*_glue.py` in generated/ that no config produces any more.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from mstar.compiler.deployment import load_deployment
from mstar.compiler.driver import MW500, compile_spec
from mstar.files import (MAX_GLUE_BYTES, MAX_PLAN_BYTES, InputFileError, atomic_write_many, make_dirs,
                         read_bytes_bounded)
from mstar.lang.diagnostics import Diagnostics


@dataclass(frozen=True)
class Stale:
    path: Path
    reason: str  # "missing", "differs", "orphan"


def config_pairs(root: Path, diags: Diagnostics) -> list[tuple[Path, Path]]:
    """(spec, config) for every configs/*.yaml, the spec named by its `model:` key."""
    pairs = []
    for config in sorted((root / "configs").glob("*.yaml")):
        deployment = load_deployment(str(config), diags)
        if deployment is None:
            continue
        spec = root / "specs" / f"{deployment.model}.mw"
        if not spec.is_file():
            diags.error(MW500, f"config {config.name} names model '{deployment.model}' but {spec} "
                        "does not exist", deployment.span_of("model"))
            continue
        pairs.append((spec, config))
    return pairs


def expected_outputs(root: Path, diags: Diagnostics) -> dict[Path, str]:
    """Every generated file's exact text; empty for pairs that failed (errors in diags)."""
    outputs: dict[Path, str] = {}
    for spec, config in config_pairs(root, diags):
        result = compile_spec(spec, config, diags, root / "generated" / f"{config.stem}.plan")
        if result is not None:
            outputs[result.plan_path] = result.plan_text
            outputs[result.glue_path] = result.glue_text
    return outputs


def _generated_files(root: Path) -> list[Path]:
    folder = root / "generated"
    return sorted(list(folder.glob("*.plan")) + list(folder.glob("*_glue.py")))


def stale_files(root: Path, expected: dict[Path, str]) -> list[Stale]:
    stale = []
    for path, text in sorted(expected.items()):
        if not path.is_file():
            stale.append(Stale(path, "missing"))
        elif _current_bytes(path) != text.encode("utf-8"):
            stale.append(Stale(path, "differs"))
    for path in _generated_files(root):
        if path not in expected:
            stale.append(Stale(path, "orphan"))
    return stale


def _current_bytes(path: Path) -> bytes | None:
    """What a generated file holds now; None (so: differs) when it cannot be read as a file of
    its kind (too large, not a regular file)."""
    limit = MAX_PLAN_BYTES if path.suffix == ".plan" else MAX_GLUE_BYTES
    try:
        return read_bytes_bounded(path, max_bytes=limit, what="generated file")
    except InputFileError:
        return None


def write(root: Path, expected: dict[Path, str]) -> list[Stale]:
    """Bring generated/ up to date; returns what was changed. Every changed file is replaced in
    one group (mstar.files.atomic_write_many): a failure leaves generated/ as it was, each plan
    with the glue it was compiled with; orphans are removed only after that."""
    changed = stale_files(root, expected)
    writes = [item.path for item in changed if item.reason != "orphan"]
    for path in writes:
        make_dirs(path.parent)
    atomic_write_many([(path, expected[path].encode("utf-8")) for path in writes])
    for item in changed:
        if item.reason == "orphan":
            item.path.unlink()
    return changed

