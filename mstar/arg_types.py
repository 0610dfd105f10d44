"""argparse types for the commands' integer options (the benches of `mstar bench` and `mstarc
bench`) and their paths: one range check, one message.

    int_range(low, high) -> type        an int in [low, high]
    int_list(low, high) -> type         comma-separated ints, each in [low, high], repeats dropped
    ITERS = int_range(1, 100_000)       the timed repetitions of a bench
    path_arg(text) -> str               a path that is not empty
    shown(value) -> str                 a value as a message echoes it: repr, clipped past SHOWN_CHARS

Given as `add_argument(..., type=...)`, a value out of range (or not an integer) is refused by
argparse itself: `mstar bench NAME: error: argument --NAME: must be between 1 and 100000, got 0`
and exit status 2, before any work starts. So is an empty path (`path_arg`): `Path("")` is the
working directory, so `--root ""` (an unset shell variable) rebuilt the working directory's
generated/ and `mstarc init -o ""` wrote the spec to its default place, each with exit 0.

Like `mstar.files`, this module sits below the packages whose commands parse arguments (the bench
mains live in runtime.serve and runtime.engine, which cannot import cli) and imports none of them.
"""
from __future__ import annotations

import argparse
import re
from typing import Any, Callable

SHOWN_CHARS = 40  # of a value echoed in a message
INTEGER = re.compile(r"\s*[+-]?\d+(_\d+)*\s*")  # what int() reads, at any length


def shown(value: Any) -> str:
    """repr(value) for a message, clipped to SHOWN_CHARS characters with its length after it (a
    5000-digit value was echoed whole)."""
    text = repr(value)
    if len(text) <= SHOWN_CHARS:
        return text
    size = f"{len(value)} characters" if isinstance(value, str) else f"{len(text.lstrip('-'))} digits" \
        if isinstance(value, int) else f"{len(text)} characters"
    return f"{text[:SHOWN_CHARS]}... ({size})"


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
            raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}")
        try:
            values = [one(part) for part in parts if part]
        except argparse.ArgumentTypeError as error:
            raise argparse.ArgumentTypeError(f"{text!r}: each {error}") from None
        return list(dict.fromkeys(values))

    parse.__name__ = "integer list"
    return parse


ITERS = int_range(1, 100_000)


def path_arg(text: str) -> str:
    """A file or directory path that is not the empty string."""
    if not text:
        raise argparse.ArgumentTypeError("needs a path, got an empty one")
    return text


path_arg.__name__ = "path"
