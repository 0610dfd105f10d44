"""argparse types for the commands' number options (the benches of `mstar bench` and `mstarc
bench`, `mstar run`'s) and their paths: one range check, one message.

    int_range(low, high) -> type        an int in [low, high]
    int_list(low, high) -> type         comma-separated ints, each in [low, high], repeats dropped
    integer(text) -> int                an int, its range the command's to check
    float_range(low, high) -> type      a number in [low, high] or (low, high], never NaN
    ITERS = int_range(1, 100_000)       the timed repetitions of a bench
    path_arg(text) -> str               a path the OS can name: not empty, no name or whole too long
    weights_arg(text) -> str            a --weights entry, DIR or NODE=DIR, its DIR as path_arg takes it
    path_problem(path) -> str or None   why path_arg refuses a path (mstar run's and the Python API's check)
    weights_problem(entry) -> ...       why weights_arg refuses an entry
    weights_list_problem(entries) -> .. the first weights_problem of a list (empty entries left out)
    shown(value) -> str                 a value as a message echoes it: repr, clipped past SHOWN_CHARS
    shown_path(path) -> str             a path as a message names it: whole, clipped past SHOWN_PATH_CHARS
    shown_text(text, most) -> str       text whole, or its head and tail past `most` characters
    shown_error(error) -> str           an unexpected exception's type and text, clipped (internal errors)
    os_error_text(error) -> str         an OSError's strerror and file names, clipped
    read_int(text) -> int               int(text), also past Python's 4,300-digit limit of int()

Given as `add_argument(..., type=...)`, a value out of range (or not an integer) is refused by
argparse itself: `mstar bench NAME: error: argument --NAME: must be between 1 and 100000, got 0`
and exit status 2, before any work starts. So is an empty path (`path_arg`): `Path("")` is the
working directory, so `--root ""` (an unset shell variable) rebuilt the working directory's
generated/ and `mstarc init -o ""` wrote the spec to its default place, each with exit 0. So is a
path the OS cannot name (a name in it longer than NAME_MAX bytes, or the whole PATH_MAX bytes or
more): os.stat raised ENAMETOOLONG from deep inside, an internal error (`mstarc regen --root`) or
`mstar: error: [Errno 36] File name too long: '<all 5,000 characters>'`.

argparse's own `type=int` and `type=float` echoed a refused value whole (a 5000-digit one in a
5,900-character line), and `type=float` read such a number as infinity: these types echo it through
`shown`. `integer` is for an option whose range a function checks for its other callers too
(`mstar run --requests`, by the workload's `generate`, with its own message and exit status).

Like `mstar.files`, this module sits below the packages whose commands parse arguments (the bench
mains live in runtime.serve and runtime.engine, which cannot import cli) and imports none of them;
`shown` is the one clipper of the values messages echo (`shown_path` of the paths they name), so
the plan, the conductor and the file readers import them too.
"""
from __future__ import annotations

import argparse
import math
import os
import re
import sys
from decimal import Decimal, InvalidOperation
from typing import Any, Callable, Optional

SHOWN_CHARS = 40  # of a value echoed in a message
# of a path named in a message: real paths are shorter and are named whole (`shown`'s 40 would cut
# a test's or a checkpoint's path); past it, its head and its tail (the file's own name) are kept
SHOWN_PATH_CHARS = 200
NAME_MAX, PATH_MAX = 255, 4096  # Linux's limits in bytes, where os.pathconf cannot say
INTEGER = re.compile(r"\s*[+-]?\d+(_\d+)*\s*")  # what int() reads, at any length


def shown(value: Any) -> str:
    """repr(value) for a message, clipped to SHOWN_CHARS characters with its length after it (a
    5000-digit value was echoed whole)."""
    try:
        text = repr(value)
    except ValueError:  # an int past Python's 4,300-digit limit of int -> str (repr raised)
        return _shown_long_int(value)
    if len(text) <= SHOWN_CHARS:
        return text
    size = f"{len(value)} characters" if isinstance(value, str) else f"{len(text.lstrip('-'))} digits" \
        if isinstance(value, int) else f"{len(text)} characters"
    return f"{text[:SHOWN_CHARS]}... ({size})"


def _shown_long_int(value: Any) -> str:
    """An int repr cannot write, as `shown` writes a long one: its first digits (a quotient short
    enough to write) and how many there are."""
    if not isinstance(value, int):  # a container holding such an int
        return f"a {type(value).__name__} holding an integer of too many digits to write"
    size = abs(value)
    digits = int(size.bit_length() * math.log10(2))  # the digit count, or one below it
    while 10 ** digits <= size:
        digits += 1
    head = ("-" if value < 0 else "") + str(size // 10 ** (digits - SHOWN_CHARS))
    return f"{head[:SHOWN_CHARS]}... ({digits} digits)"


def read_int(text: str) -> int:
    """int(text) (ValueError where it is no integer), also past Python's 4,300-digit limit of int(),
    which guards servers against slow conversion: a command-line value (at most 128 KiB, under a
    second) read through Decimal, so its message can say it is too large rather than no integer."""
    try:
        return int(text)
    except ValueError:
        if INTEGER.fullmatch(text) is None:
            raise
    try:
        return int(Decimal(text))
    except InvalidOperation:  # what Decimal and INTEGER read differently (no case known)
        raise ValueError(f"not an integer: {shown(text)}") from None


def int_range(low: int, high: int) -> Callable[[str], int]:
    """Every count has an upper bound: `--iters 10**12` or `--runs 10**9` ran for ever."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            # an integer past int()'s 4,300 digits is out of range, not "not an integer"
            what = "an integer" if INTEGER.fullmatch(text) is None else f"between {low} and {high}"
            raise argparse.ArgumentTypeError(f"must be {what}, got {shown(text)}") from None
        if not low <= value <= high:
            raise argparse.ArgumentTypeError(f"must be between {low} and {high}, got {shown(value)}")
        return value

    parse.__name__ = "integer"  # argparse names the type in some messages
    return parse


def int_list(low: int, high: int) -> Callable[[str], list[int]]:
    """`--budgets 224,192`: each part an int in [low, high], in the order given, repeats dropped."""
    one = int_range(low, high)

    def parse(text: str) -> list[int]:
        parts = [part.strip() for part in text.split(",")]
        if not any(parts):
            raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {shown(text)}")
        try:
            values = [one(part) for part in parts if part]
        except argparse.ArgumentTypeError as error:
            raise argparse.ArgumentTypeError(f"{shown(text)}: each {error}") from None
        return list(dict.fromkeys(values))

    parse.__name__ = "integer list"
    return parse


def integer(text: str) -> int:
    """An int as `type=int` reads it, for an option whose range the command checks with its own
    message. One past int()'s digit limit is refused here, not read (`read_int`): the code after it
    writes the value with str(), which raises past that limit (`mstar run --kv-pages` of 5000 digits
    on the torch engine: "mstar: error: Exceeds the limit (4300 digits) for integer string conversion")."""
    try:
        return int(text)
    except ValueError:
        what = "an integer" if INTEGER.fullmatch(text) is None else \
            f"an integer of at most {sys.get_int_max_str_digits()} digits"
        raise argparse.ArgumentTypeError(f"must be {what}, got {shown(text)}") from None


def float_range(low: float, high: float, *, is_low_open: bool = False) -> Callable[[str], float]:
    """A number in [low, high] ((low, high] with is_low_open): NaN never, inf only where high is
    inf. `type=float` read a 5000-digit `--rate` as inf (every arrival at once) and took "nan"."""
    interval = f"{'(' if is_low_open else '['}{low:g}, {high:g}]"

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            value = None
        is_inside = value is not None and (low < value if is_low_open else low <= value) and value <= high
        if value is None or not is_inside:
            # the text as given where the number is not what it says ("1e400" reads as inf)
            said = shown(value) if value is not None and math.isfinite(value) else shown(text)
            raise argparse.ArgumentTypeError(f"must be a number in {interval}, got {said}")
        return value

    parse.__name__ = "number"
    return parse


ITERS = int_range(1, 100_000)


def shown_path(path: Any) -> str:
    """A path (str, bytes or os.PathLike) as a message names it: as written, unquoted as messages
    name paths, up to SHOWN_PATH_CHARS characters; past that its head and tail around "..." and
    its length (a 5,000-character --prompts was echoed whole in "cannot read prompts file ...")."""
    try:
        text = os.fsdecode(path)
    except TypeError:  # not a path at all: what the caller was given, written as it is
        text = str(path)
    return shown_text(text, SHOWN_PATH_CHARS)


SHOWN_ERROR_CHARS = 1000  # of an unexpected exception's text in an "internal error" line


def shown_text(text: str, most: int = SHOWN_ERROR_CHARS) -> str:
    """`text` whole up to `most` characters; past that its head and tail around "..." and its
    length (the tail often names what failed: a file's name, an exception's last words)."""
    if len(text) <= most:
        return text
    keep = most // 2 - 10
    return f"{text[:keep]}...{text[-keep:]} ({len(text)} characters)"


def shown_error(error: BaseException) -> str:
    """An unexpected exception as an "internal error" line names it: its type and its text, clipped
    by `shown_text` (a value of 5,000 characters in the text came out whole); a text that cannot be
    made (its __str__ raised) is named as such."""
    try:
        text = str(error)
    except Exception:  # noqa: BLE001 - the line must come out whatever the exception holds
        text = "(its message could not be written)"
    return shown_text(f"{type(error).__name__}: {text}")


def os_error_text(error: OSError) -> str:
    """An OSError as a message says it: its strerror and the file name(s) it names through
    `shown_path` (str(error) put "[Errno 36]" and the whole 5,000-character name in the line)."""
    if error.strerror is None:  # raised with a message of its own, not by a system call
        return shown_path(str(error))
    names = [shown_path(name) for name in (error.filename, error.filename2) if name is not None]
    return error.strerror + (f": {' -> '.join(names)}" if names else "")


def _os_limits(text: str) -> tuple[int, int]:
    """NAME_MAX and PATH_MAX (bytes) of the file system a path starts on: its root's, or the
    working directory's for a relative path; Linux's where os.pathconf cannot say."""
    where = os.sep if os.path.isabs(text) else os.curdir
    try:
        name_max, path_max = os.pathconf(where, "PC_NAME_MAX"), os.pathconf(where, "PC_PATH_MAX")
    except (AttributeError, OSError, ValueError):  # no pathconf (Windows), or the working directory is gone
        return NAME_MAX, PATH_MAX
    return name_max if name_max > 0 else NAME_MAX, path_max if path_max > 0 else PATH_MAX  # -1: no limit told


def path_problem(path: Any) -> Optional[str]:
    """Why `path` is no path the OS can name, worded to follow its option's name (`--plan needs a
    path ...`), or None. Checked before any use: os.stat raised ENAMETOOLONG from wherever the
    path was first touched (`mstarc regen --root`: an internal error), and the message held the
    path whole. A name longer than NAME_MAX bytes, or a whole of PATH_MAX bytes or more (the
    count holds the C string's NUL), is refused as the kernel refuses it."""
    text = os.fsdecode(path)
    if not text:
        return "needs a path, got an empty one"
    if "\0" in text:
        return f"needs a path without a NUL byte, got {shown(text)}"
    try:
        size = len(os.fsencode(text))
    except UnicodeEncodeError:  # a lone surrogate (the Python API's "\ud800"): os.stat raised it too
        return f"needs a path the file system can encode, got {shown(text)}"
    name_max, path_max = _os_limits(text)
    if size >= path_max:
        return (f"needs a path shorter than {path_max} bytes (this system's limit), got one of {size} bytes: "
                f"{shown(text)}")
    parts = text.split(os.sep) if os.altsep is None else text.replace(os.altsep, os.sep).split(os.sep)
    longest = max(len(os.fsencode(part)) for part in parts)
    if longest > name_max:
        return (f"needs a path whose names are at most {name_max} bytes each (this system's limit), got one "
                f"with a name of {longest} bytes: {shown(text)}")
    return None


def _checked_by(problem_of: Callable[[str], Optional[str]]) -> Callable[[str], str]:
    """An argparse type taking the text as it is where `problem_of` finds nothing wrong."""
    def parse(text: str) -> str:
        problem = problem_of(text)
        if problem is not None:
            raise argparse.ArgumentTypeError(problem)
        return text

    parse.__name__ = "path"  # argparse names the type in some messages
    return parse


# A file or directory path the OS can name (`path_problem`): not the empty string.
path_arg = _checked_by(path_problem)


def weights_problem(entry: Any) -> Optional[str]:
    """`path_problem` of a `--weights` entry, DIR or NODE=DIR: None where the entry or its DIR (the
    part after the first '='; which one it is, the plan's nodes decide) is a path the OS can name,
    so `NODE=` followed by a path near the limits is taken; `LLM=` is weights_by_node's to refuse."""
    problem = path_problem(entry)
    _, sep, directory = os.fsdecode(entry).partition("=")
    return None if problem is None or (sep and path_problem(directory) is None) else problem


def weights_list_problem(entries: Any) -> Optional[str]:
    """The first `weights_problem` of a list of `--weights` entries, or None; an empty entry is
    left to the loader (weights_by_node), which words it."""
    for entry in entries or ():
        problem = weights_problem(entry) if os.fspath(entry) else None
        if problem is not None:
            return problem
    return None


# A `--weights` entry as `weights_problem` takes it.
weights_arg = _checked_by(weights_problem)
