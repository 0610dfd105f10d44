"""Bounded reads and atomic writes: how every file mstar reads or replaces is handled.

In: a path, a size limit and a human name for the file ("spec", "deployment", "plan", ...).
Out: its text or bytes, or an `InputFileError` whose message names the file and the problem.
Writes go to a temporary file beside the target, are flushed and fsynced, then renamed over it,
so the old file survives any failure (a full disk, an interrupt) and readers never see half a file.

This module sits below every other package (lang, compiler, plan, runtime, cli may all import it)
and imports none of them; only mstar.arg_types, which sits as low, for `shown_path`.
"""
from __future__ import annotations

import errno
import os
import stat
import tempfile
from pathlib import Path
from typing import Optional, Sequence, Union

from mstar.arg_types import shown_path

PathLike = Union[str, "os.PathLike[str]"]

KIB = 1024
MIB = 1024 * KIB

# Limits per kind of file, far above any real file of that kind and far below what would hurt.
MAX_SPEC_BYTES = 1 * MIB
MAX_DEPLOYMENT_BYTES = 1 * MIB
MAX_PLAN_BYTES = 16 * MIB
MAX_PROMPTS_BYTES = 256 * MIB
MAX_JSON_CONFIG_BYTES = 4 * MIB  # a checkpoint's config.json, a safetensors index
MAX_TOKENIZER_BYTES = 64 * MIB  # a checkpoint's tokenizer.json (Llama 3's is 9 MB, Qwen's 11 MB)
MAX_GLUE_BYTES = 4 * MIB  # a plan's generated Triton glue
MAX_AUDIO_BYTES = 64 * MIB  # a prompt's WAV file (30 s of 16 kHz 16-bit mono is under 1 MiB)


class InputFileError(Exception):
    """A file that cannot be read as asked (missing, not a regular file, too large, not text).

    str(): "WHAT PATH: REASON"; `what`, `path` and `reason` are kept for callers that word
    their own message."""

    def __init__(self, what: str, path, reason: str):
        super().__init__(f"{what} {shown_path(path)}: {reason}")  # a path past 200 characters clipped
        self.what, self.path, self.reason = what, path, reason


def make_dirs(path: PathLike, mode: int = 0o777) -> list[Path]:
    """os.makedirs(path, exist_ok=True) without recursion: os.makedirs and Path.mkdir(parents=True)
    recurse once a missing level, so a valid path more than about 1,000 levels deep (2,200
    characters of "d/") raised RecursionError, an internal error. Missing levels are made from
    the top down; one that exists, as a directory, is left as it is. Returns the levels it made,
    top down (`remove_empty_dirs` takes them back where a command then fails)."""
    missing = []
    folder = Path(path)
    while not os.path.lexists(folder):  # a file in the way stops the walk: making below it raises ENOTDIR
        missing.append(folder)
        if folder.parent == folder:
            break
        folder = folder.parent
    if not missing and not folder.is_dir():
        raise FileExistsError(errno.EEXIST, "File exists", str(folder))
    made = []
    for level in reversed(missing):
        try:
            level.mkdir(mode=mode)
            made.append(level)
        except FileExistsError:  # made meanwhile by another process
            if not level.is_dir():
                raise
    return made


def remove_empty_dirs(made: list[Path]) -> None:
    """Remove the directories `make_dirs` made (top down), deepest first, while they are empty: a
    command refused after it made its output folder leaves nothing behind; one that wrote there
    keeps it."""
    for level in reversed(made):
        try:
            level.rmdir()
        except OSError:  # not empty (or gone): it and the levels above it stay
            return


def _open_regular(path: Path, what: str) -> tuple[int, int]:
    """An open descriptor of the file and its size; refuses anything but a regular file (a FIFO or
    /dev/zero reads forever). The checks read the opened file (fstat), not the path: a FIFO swapped
    in between a stat and the open blocked the open. O_NONBLOCK makes opening a FIFO return at once
    (it has no effect on a regular file's reads)."""
    if "\0" in str(path):
        raise InputFileError(what, repr(str(path)), "a path may not contain a NUL byte")
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0))
    except FileNotFoundError:
        raise InputFileError(what, path, "no such file") from None
    except IsADirectoryError:  # where a directory cannot be opened to read
        raise InputFileError(what, path, "is a directory, not a file") from None
    except (OSError, ValueError) as error:  # ValueError: a path the OS cannot take at all
        raise InputFileError(what, path, f"cannot read it ({getattr(error, 'strerror', None) or error})") from None
    info = os.fstat(fd)
    problem = ("is a directory, not a file" if stat.S_ISDIR(info.st_mode) else None if stat.S_ISREG(info.st_mode)
               else "not a regular file (a device, FIFO or socket is refused)")
    if problem is not None:
        os.close(fd)
        raise InputFileError(what, path, problem)
    return fd, info.st_size


def read_bytes_bounded(path: PathLike, *, max_bytes: int, what: str) -> bytes:
    """The whole file, refused when it is not a regular file or larger than `max_bytes`."""
    path = Path(path)
    fd, size = _open_regular(path, what)
    with os.fdopen(fd, "rb") as handle:
        if size > max_bytes:
            raise InputFileError(what, path, f"{size} bytes is over the limit of {max_bytes} bytes")
        try:
            data = handle.read(max_bytes + 1)  # the file may have grown since the open
        except OSError as error:
            raise InputFileError(what, path, f"cannot read it ({error.strerror or error})") from None
    if len(data) > max_bytes:
        raise InputFileError(what, path, f"over the limit of {max_bytes} bytes")
    return data


def read_text_bounded(path: PathLike, *, max_bytes: int, what: str) -> str:
    """The file as UTF-8 text (a leading byte-order mark is dropped); see `read_bytes_bounded`."""
    data = read_bytes_bounded(path, max_bytes=max_bytes, what=what)
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as error:
        raise InputFileError(what, path, f"not UTF-8 text (byte {error.start})") from None
    return text[1:] if text.startswith("\ufeff") else text


def atomic_write_bytes(path: PathLike, data: bytes, *, mode: int | None = None) -> None:
    """Replace `path` with `data` all at once; on any failure the old file is left as it was and
    the `OSError` raised names `path` (its `filename`). `mode`: the new file's permissions
    (default: the old file's, or 0644 less the umask for a new file)."""
    atomic_write_many([(path, data)], mode=mode)


def atomic_write_text(path: PathLike, text: str, *, mode: int | None = None) -> None:
    """`atomic_write_bytes` of `text` in UTF-8."""
    atomic_write_bytes(path, text.encode("utf-8"), mode=mode)


def atomic_write_many(files: Sequence[tuple[PathLike, bytes]], *, mode: int | None = None) -> None:
    """Replace several files that belong together (a plan and its glue), all or none.

    Every new file is written and fsynced to a temporary beside its target first; a failure
    there (a full disk) changes nothing. Then each is renamed over its target in the order
    given, the old file kept under a backup name (a hard link) until all are in place; if a
    rename fails, the files already replaced get their old content back. The `OSError` raised
    names the file that failed (its `filename`).
    """
    temps: list[tuple[Path, str]] = []
    regular: list[tuple[Path, bytes]] = []
    for path, data in files:
        target = _write_target(Path(path))
        if target is None:
            _write_in_place(Path(path), data)
        else:
            regular.append((target, data))
    try:
        for path, data in regular:
            temps.append((path, _write_temp(path, data, mode)))
    except BaseException:
        for _, temp in temps:
            _unlink_quietly(temp)
        raise
    replaced: list[tuple[Path, bool, Optional[str]]] = []  # (target, had a file, its backup)
    try:
        for path, temp in temps:
            existed = path.is_file()
            backup = _backup(path) if existed else None
            try:
                os.replace(temp, path)
            except OSError as error:
                if backup is not None:
                    _unlink_quietly(backup)
                raise OSError(error.errno, error.strerror or str(error), str(path)) from None
            replaced.append((path, existed, backup))
    except BaseException:
        for _, temp in temps:
            _unlink_quietly(temp)
        for path, existed, backup in reversed(replaced):
            _restore(path, existed, backup)
        raise
    for _, _, backup in replaced:
        if backup is not None:
            _unlink_quietly(backup)


def _write_target(path: Path) -> Optional[Path]:
    """The regular file a rename should replace for `path`: the file a symlink points at (so the
    link survives), `path` itself for a new or regular file, or None for a device, FIFO or socket
    (`-o /dev/stdout`), which is written in place: renaming over it would replace the node."""
    try:
        info = os.stat(path)  # follows symlinks
    except FileNotFoundError:
        return Path(os.path.realpath(path)) if path.is_symlink() else path
    except OSError as error:
        raise OSError(error.errno, error.strerror or str(error), str(path)) from None
    if stat.S_ISDIR(info.st_mode):
        raise OSError(errno.EISDIR, "is a directory", str(path))
    if not stat.S_ISREG(info.st_mode):
        return None
    return Path(os.path.realpath(path)) if path.is_symlink() else path


def _write_in_place(path: Path, data: bytes) -> None:
    try:
        with open(path, "wb") as handle:
            handle.write(data)
    except OSError as error:
        raise OSError(error.errno, error.strerror or str(error), str(path)) from None


def _write_temp(path: Path, data: bytes, mode: int | None) -> str:
    """`data` in a new fsynced temporary file beside `path`, with the permissions `path` will
    have; the temporary's name. Raises an `OSError` naming `path`."""
    directory = path.parent if str(path.parent) else Path(".")
    temp_name = None
    try:
        fd, temp_name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=directory)
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        if mode is not None:
            os.chmod(temp_name, mode)
        elif path.exists():
            # Keep the permissions the user gave the file (mkstemp creates 0600).
            os.chmod(temp_name, stat.S_IMODE(os.stat(path).st_mode))
        else:
            os.chmod(temp_name, 0o644 & ~_umask())
        return temp_name
    except OSError as error:
        if temp_name is not None:
            _unlink_quietly(temp_name)
        raise OSError(error.errno, error.strerror or str(error), str(path)) from None
    except BaseException:
        if temp_name is not None:
            _unlink_quietly(temp_name)
        raise


def _backup(path: Path) -> Optional[str]:
    """A hard link to `path`'s current file under a temporary name (None when the file system
    cannot link: then a failed later rename cannot be undone)."""
    directory = path.parent if str(path.parent) else Path(".")
    for attempt in range(100):
        name = str(directory / f".{path.name}.{os.getpid()}.{attempt}.old")
        try:
            os.link(path, name)
            return name
        except FileExistsError:
            continue
        except OSError:
            return None
    return None


def _restore(path: Path, existed: bool, backup: Optional[str]) -> None:
    """Put the old file back after a failed group write, or remove a file that was new."""
    try:
        if backup is not None:
            os.replace(backup, path)
        elif not existed:
            os.unlink(path)
    except OSError:
        pass


def _unlink_quietly(name: str) -> None:
    try:
        os.unlink(name)
    except OSError:
        pass


def _umask() -> int:
    current = os.umask(0)
    os.umask(current)
    return current
