"""The grammar cache never runs a planted file (issue 15, point 10).

Lark's own `cache=True` unpickled `$TMPDIR/.lark_cache_<user>_<sha256>_<py>.tmp`, a name anyone
can compute and anyone who can write the temp folder can plant. These tests plant a pickle that
makes a directory when unpickled at that old name, and at the new cache's name (with a wrong and
with a right checksum), run `mstarc check` in a fresh process, and find no directory made.
"""
from __future__ import annotations

import getpass
import hashlib
import os
import pickle
import stat
import subprocess
import sys
from pathlib import Path

import lark

from mstar.lang import grammar_cache
from mstar.lang.parser import _LARK_OPTIONS, GRAMMAR_PATH

ROOT = Path(__file__).resolve().parents[2]


class _Plant:
    """Unpickling this makes the directory `marker`: proof that a planted file ran."""

    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):
        return (os.mkdir, (self.marker,))


def _old_lark_cache_path(temp: Path) -> Path:
    """The file Lark's `cache=True` read, computed as Lark 1.x does, for the options mstar used."""
    options = dict(_LARK_OPTIONS, cache=True)
    options_text = "".join(k + str(v) for k, v in options.items())
    digest = hashlib.sha256((GRAMMAR_PATH.read_text(encoding="utf-8") + options_text + lark.__version__
                             + str(sys.version_info[:2])).encode("utf-8")).hexdigest()
    return temp / f".lark_cache_{getpass.getuser()}_{digest}_{sys.version_info[0]}_{sys.version_info[1]}.tmp"


def _run_check(tmp_path: Path) -> subprocess.CompletedProcess:
    env = dict(os.environ, TMPDIR=str(tmp_path / "temp"), XDG_CACHE_HOME=str(tmp_path / "cache"),
               PYTHONPATH=str(ROOT))
    return subprocess.run([sys.executable, "-m", "mstar.cli.mstarc", "check", "specs/orpheus.mw"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)


def _new_cache_file(tmp_path: Path) -> Path:
    key = grammar_cache.cache_key(GRAMMAR_PATH.read_text(encoding="utf-8"), _LARK_OPTIONS)
    return tmp_path / "cache" / "mstar" / f"grammar-{key[:16]}.marshal"


def test_pickle_planted_at_the_old_temp_path_is_not_run(tmp_path):
    (tmp_path / "temp").mkdir()
    marker = tmp_path / "planted_code_ran"
    old = _old_lark_cache_path(tmp_path / "temp")
    # Lark's format: the grammar's sha256 on a line, then pickles (Lark unpickles the first one
    # even when the line does not match).
    old.write_bytes(old.name.split("_")[3].encode() + b"\n" + pickle.dumps(_Plant(marker)))
    result = _run_check(tmp_path)
    assert result.returncode == 0, result.stderr
    assert not marker.exists()
    assert [p.name for p in (tmp_path / "temp").iterdir()] == [old.name]  # nothing new in the temp folder


def test_cache_is_private_and_a_planted_pickle_there_is_not_run(tmp_path):
    assert _run_check(tmp_path).returncode == 0
    cache_file = _new_cache_file(tmp_path)
    assert stat.S_IMODE(os.stat(cache_file.parent).st_mode) == 0o700
    assert stat.S_IMODE(os.stat(cache_file).st_mode) == 0o600
    header = cache_file.read_bytes().partition(b"\n")[0]
    magic_and_key = header.rsplit(b" ", 1)[0]
    marker = tmp_path / "planted_code_ran"
    payload = pickle.dumps(_Plant(marker))
    for checksum in (b"0" * 64, hashlib.sha256(payload).hexdigest().encode()):
        cache_file.write_bytes(magic_and_key + b" " + checksum + b"\n" + payload)
        os.chmod(cache_file, 0o600)
        result = _run_check(tmp_path)
        assert result.returncode == 0, result.stderr
        assert not marker.exists()
        # The bad entry was replaced by a good one.
        assert cache_file.read_bytes().partition(b"\n")[0] != magic_and_key + b" " + checksum


def test_cache_loads_what_it_stored(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    grammar = GRAMMAR_PATH.read_text(encoding="utf-8")
    built = []

    def build():
        built.append(1)
        return lark.Lark(grammar, **_LARK_OPTIONS)

    first = grammar_cache.load_or_build(grammar, _LARK_OPTIONS, build)
    second = grammar_cache.load_or_build(grammar, _LARK_OPTIONS, build)
    assert len(built) == 1
    text = (ROOT / "specs" / "orpheus.mw").read_text(encoding="utf-8")
    assert first.parse(text, start="spec") == second.parse(text, start="spec")


def test_shared_or_foreign_cache_is_not_trusted(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    grammar = GRAMMAR_PATH.read_text(encoding="utf-8")
    parser = lark.Lark(grammar, **_LARK_OPTIONS)
    grammar_cache.load_or_build(grammar, _LARK_OPTIONS, lambda: parser)
    folder = tmp_path / "mstar"
    (entry,) = folder.iterdir()
    key = grammar_cache.cache_key(grammar, _LARK_OPTIONS)
    assert grammar_cache._load(entry, key) is not None
    os.chmod(entry, 0o666)  # writable by anyone: ignored
    assert grammar_cache._load(entry, key) is None
    os.chmod(entry, 0o600)
    os.chmod(folder, 0o777)  # a folder others can write: not used at all
    assert grammar_cache._private_folder() is None
    os.chmod(folder, 0o700)
    link = tmp_path / "link.marshal"
    link.symlink_to(entry)  # a symlink is never followed
    assert grammar_cache._load(link, key) is None
