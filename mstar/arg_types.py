"""argparse types for the commands' number options (the benches of `mstar bench` and `mstarc
bench`, `mstar run`'s) and their paths: one range check, one message.

    int_range(low, high) -> type        an int in [low, high]
    int_list(low, high) -> type         comma-separated ints, each in [low, high], repeats dropped
    integer(text) -> int                an int, its range the command's to check
    float_range(low, high) -> type      a number in [low, high] or (low, high], never NaN
    ITERS = int_range(1, 100_000)       the timed repetitions of a bench
    path_arg(text) -> str               a path that is not empty
    shown(value) -> str                 a value as a message echoes it: repr, clipped past SHOWN_CHARS
    read_int(text) -> int               int(text), also past Python's 4,300-digit limit of int()

Given as `add_argument(..., type=...)`, a value out of range (or not an integer) is refused by
argparse itself: `mstar bench NAME: error: argument --NAME: must be between 1 and 100000, got 0`
and exit status 2, before any work starts. So is an empty path (`path_arg`): `Path("")` is the
working directory, so `--root ""` (an unset shell variable) rebuilt the working directory's
generated/ and `mstarc init -o ""` wrote the spec to its default place, each with exit 0.

argparse's own `type=int` and `type=float` echoed a refused value whole (a 5000-digit one in a
5,900-character line), and `type=float` read such a number as infinity: these types echo it through
`shown`. `integer` is for an option whose range a function checks for its other callers too
(`mstar run --requests`, by the workload's `generate`, with its own message and exit status).

Like `mstar.files`, this module sits below the packages whose commands parse arguments (the bench
mains live in runtime.serve and runtime.engine, which cannot import cli) and imports none of them;
`shown` is the one clipper of messages, so the plan and the conductor import it too.
"""
from __future__ import annotations

import argparse
import math
import re
import sys
from decimal import Decimal, InvalidOperation
from typing import Any, Callable

SHOWN_CHARS = 40  # of a value echoed in a message
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


def path_arg(text: str) -> str:
    """A file or directory path that is not the empty string."""
    if not text:
        raise argparse.ArgumentTypeError("needs a path, got an empty one")
    return text


path_arg.__name__ = "path"
