"""Every file mstarc replaces survives a failed write (issue 15, point 4).

A full disk is simulated by a write hook: `os.fsync` (or `os.replace`, for a failure between the
renames of a plan and its glue) raising ENOSPC. Each test checks the old file's bytes are
untouched, no temporary is left beside it, the exit status is 1 and the message names the file.
"""
from __future__ import annotations

import errno
import os
import shutil
from pathlib import Path

import pytest

from mstar.cli.mstarc import main
from mstar.files import atomic_write_many
from mstar.plan.io import load_plan

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture()
def repo(tmp_path) -> Path:
    shutil.copytree(ROOT / "specs", tmp_path / "specs")
    (tmp_path / "configs").mkdir()
    for name in ("orpheus", "llama"):
        shutil.copy(ROOT / "configs" / f"{name}.yaml", tmp_path / "configs")
    return tmp_path


def _fail_nth(monkeypatch, name: str, n: int) -> None:
    """The n-th call (1-based) of os.`name` raises ENOSPC."""
    real = getattr(os, name)
    calls = []

    def failing(*args, **kwargs):
        calls.append(1)
        if len(calls) == n:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real(*args, **kwargs)

    monkeypatch.setattr(os, name, failing)


def _snapshot(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir()) if p.is_file()}


def test_fmt_write_on_a_full_disk_keeps_the_spec(repo, monkeypatch, capsys):
    spec = repo / "specs" / "orpheus.mw"
    spec.write_text(spec.read_text().replace("model orpheus", "model   orpheus"))
    before = _snapshot(spec.parent)
    _fail_nth(monkeypatch, "fsync", 1)
    assert main(["fmt", "--write", str(spec)]) == 1
    err = capsys.readouterr().err
    assert f"cannot write {spec}" in err and "No space left" in err
    assert _snapshot(spec.parent) == before


@pytest.mark.parametrize("hook, n", [("fsync", 2), ("replace", 2)],
                         ids=["plan temporary not written", "plan rename fails after the glue's"])
def test_failed_compile_keeps_the_old_plan_and_its_glue(repo, monkeypatch, capsys, hook, n):
    spec = repo / "specs" / "orpheus.mw"
    plan = repo / "out" / "orpheus.plan"
    assert main(["compile", str(spec), "--config", str(repo / "configs" / "orpheus.yaml"), "-o", str(plan)]) == 0
    before = _snapshot(plan.parent)
    # Another deployment whose plan and glue both differ (page size 32 instead of 16).
    other = repo / "configs" / "orpheus_pages.yaml"
    other.write_text((repo / "configs" / "orpheus.yaml").read_text().replace("page_size: 16", "page_size: 32"))
    _fail_nth(monkeypatch, hook, n)
    assert main(["compile", str(spec), "--config", str(other), "-o", str(plan)]) == 1
    err = capsys.readouterr().err
    assert "cannot write" in err and "No space left" in err and "orpheus.plan" in err
    monkeypatch.undo()
    assert _snapshot(plan.parent) == before
    load_plan(plan)  # the old plan still matches its glue, spec and deployment
    # and without the failure the new pair differs from the old one in both files
    assert main(["compile", str(spec), "--config", str(other), "-o", str(plan)]) == 0
    after = _snapshot(plan.parent)
    assert after.keys() == before.keys() and all(after[k] != before[k] for k in before)


def test_failed_regen_leaves_generated_as_it_was(repo, monkeypatch, capsys):
    assert main(["regen", "--root", str(repo)]) == 0
    before = _snapshot(repo / "generated")
    config = repo / "configs" / "orpheus.yaml"
    config.write_text(config.read_text().replace("page_size: 16", "page_size: 32"))
    llama = repo / "configs" / "llama.yaml"
    llama.write_text(llama.read_text() + "\nmax_consecutive_follower_batches: 2\n")
    _fail_nth(monkeypatch, "fsync", 3)
    assert main(["regen", "--root", str(repo)]) == 1
    assert "No space left" in capsys.readouterr().err
    assert _snapshot(repo / "generated") == before


def test_failed_graph_write_keeps_the_old_picture(repo, monkeypatch, capsys):
    picture = repo / "walks.svg"
    picture.write_text("<svg>old</svg>\n")
    _fail_nth(monkeypatch, "fsync", 1)
    assert main(["graph", str(repo / "specs" / "orpheus.mw"), "-o", str(picture)]) == 1
    assert f"cannot write {picture}" in capsys.readouterr().err
    assert _snapshot(repo) == {"walks.svg": b"<svg>old</svg>\n"}


def test_group_write_rolls_back_and_keeps_modes(tmp_path, monkeypatch):
    first, second, new = tmp_path / "a", tmp_path / "b", tmp_path / "c"
    first.write_bytes(b"old a")
    second.write_bytes(b"old b")
    os.chmod(first, 0o640)
    _fail_nth(monkeypatch, "replace", 3)
    with pytest.raises(OSError) as raised:
        atomic_write_many([(first, b"new a"), (new, b"new c"), (second, b"new b")])
    assert raised.value.filename == str(second)
    monkeypatch.undo()
    assert _snapshot(tmp_path) == {"a": b"old a", "b": b"old b"}
    atomic_write_many([(first, b"new a"), (new, b"new c")])
    assert _snapshot(tmp_path) == {"a": b"new a", "b": b"old b", "c": b"new c"}
    assert os.stat(first).st_mode & 0o777 == 0o640


def test_a_device_target_is_written_in_place_never_renamed_over(tmp_path):
    """`-o /dev/stdout` (or /dev/null) must not rename a temporary over the device node."""
    from mstar.files import atomic_write_text

    before = os.stat("/dev/null")
    atomic_write_text("/dev/null", "discarded")
    after = os.stat("/dev/null")
    assert (before.st_ino, before.st_rdev) == (after.st_ino, after.st_rdev)
    assert not list(Path("/dev").glob(".null.*"))


def test_a_symlink_target_keeps_the_link_and_replaces_what_it_points_at(tmp_path):
    from mstar.files import atomic_write_text

    real = tmp_path / "real.svg"
    real.write_text("old")
    link = tmp_path / "link.svg"
    link.symlink_to(real)
    atomic_write_text(link, "new")
    assert link.is_symlink() and real.read_text() == "new"


def test_a_directory_target_is_an_error_naming_it(tmp_path):
    from mstar.files import atomic_write_text

    with pytest.raises(OSError) as caught:
        atomic_write_text(tmp_path, "x")
    assert caught.value.filename == str(tmp_path)
