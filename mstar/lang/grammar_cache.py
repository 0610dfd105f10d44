"""The built LALR parser of the grammar, cached between processes in a private per-user folder.

    load_or_build(grammar_text, options, build) -> Lark

Building the LALR tables takes about 100 ms, a fifth of a whole `mstarc` process; loading them
takes about 15 ms. Lark's own `cache=True` keeps them as a pickle at a predictable name in the
shared temp folder, so anyone who can write there could make `mstarc` run their code. Here:

- the folder is `$XDG_CACHE_HOME/mstar` (default `~/.cache/mstar`), created 0700; it is used only
  when it is a real directory (not a symlink) owned by this user and not writable by group or
  others, and each file only when it is a regular file owned by this user, not group/world
  writable;
- the tables are stored with `marshal` (plain values: dicts, lists, strings, numbers), never
  pickle, and read back with Lark's loader from that plain data, so no file content is ever run;
- the file starts with a header holding a key (sha256 of the grammar, the options, the Lark and
  Python versions) and the sha256 of the payload; a file whose key or checksum does not match is
  ignored and rewritten (atomically, mode 0600).

Any failure (no home, read-only folder, a corrupt file) falls back to building the parser; the
cache is a speed-up, never a requirement.
"""
from __future__ import annotations

import hashlib
import marshal
import os
import stat
import sys
from pathlib import Path
from typing import Callable, Optional

from lark import Lark
from lark import __version__ as LARK_VERSION
from lark.grammar import Rule
from lark.lexer import TerminalDef

from mstar.files import MIB, atomic_write_bytes

_MAGIC = b"mstar-grammar-cache 1"
_MAX_CACHE_BYTES = 8 * MIB


def cache_folder() -> Optional[Path]:
    """$XDG_CACHE_HOME/mstar or ~/.cache/mstar; None when there is no home to put it in."""
    base = os.environ.get("XDG_CACHE_HOME")
    if not base:
        home = os.environ.get("HOME")
        if not home:
            return None
        base = os.path.join(home, ".cache")
    return Path(base) / "mstar"


def cache_key(grammar_text: str, options: dict) -> str:
    """What the cached tables depend on: the grammar, the options, and the Lark and Python versions."""
    described = repr(sorted(options.items())) + LARK_VERSION + repr(sys.version_info[:2])
    return hashlib.sha256((grammar_text + described).encode("utf-8")).hexdigest()


def load_or_build(grammar_text: str, options: dict, build: Callable[[], Lark]) -> Lark:
    """The parser from the cache when a trusted, intact entry matches, else `build()` (and the
    entry is rewritten for the next process)."""
    key = cache_key(grammar_text, options)
    folder = _private_folder()
    if folder is not None:
        loaded = _load(folder / f"grammar-{key[:16]}.marshal", key)
        if loaded is not None:
            return loaded
    parser = build()
    if folder is not None:
        _store(folder / f"grammar-{key[:16]}.marshal", key, parser)
    return parser


def _private_folder() -> Optional[Path]:
    """The cache folder, created 0700 if missing; None unless it is safe to trust."""
    folder = cache_folder()
    if folder is None:
        return None
    try:
        folder.mkdir(mode=0o700, parents=True, exist_ok=True)
        info = os.lstat(folder)
    except OSError:
        return None
    if not _is_private(info, stat.S_ISDIR):
        return None
    return folder


def _is_private(info: os.stat_result, is_kind: Callable[[int], bool]) -> bool:
    """Of the right kind (a symlink is not), owned by this user, not writable by group or others."""
    return (is_kind(info.st_mode) and info.st_uid == os.getuid()
            and stat.S_IMODE(info.st_mode) & 0o022 == 0)


def _load(path: Path, key: str) -> Optional[Lark]:
    """The cached parser, or None when the entry is missing, untrusted, stale or corrupt."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0))
    except OSError:
        return None
    try:
        with os.fdopen(fd, "rb") as handle:
            info = os.fstat(handle.fileno())
            if not _is_private(info, stat.S_ISREG) or info.st_size > _MAX_CACHE_BYTES:
                return None
            data = handle.read(_MAX_CACHE_BYTES + 1)
    except OSError:
        return None
    header, _, payload = data.partition(b"\n")
    if header != _MAGIC + b" " + key.encode("ascii") + b" " + hashlib.sha256(payload).hexdigest().encode("ascii"):
        return None
    try:
        tables = marshal.loads(payload)
        return Lark.__new__(Lark)._load(tables)
    except Exception:  # a stale layout from another Lark, a damaged file: rebuild instead
        return None


def _store(path: Path, key: str, parser: Lark) -> None:
    try:
        data, memo = parser.memo_serialize([TerminalDef, Rule])
        payload = marshal.dumps({"data": data, "memo": memo})
    except (ValueError, TypeError):  # a value marshal cannot hold: go without a cache
        return
    header = _MAGIC + b" " + key.encode("ascii") + b" " + hashlib.sha256(payload).hexdigest().encode("ascii")
    try:
        atomic_write_bytes(path, header + b"\n" + payload, mode=0o600)
    except OSError:
        pass
