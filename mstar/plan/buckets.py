"""Capture bucket lookups, shared by the compiler (which writes them) and load_plan (which rebuilds
and compares them).

    batch_pad_table(batch_sizes, max_rows) -> table   table[b] = smallest captured batch size >= b,
                                                      0 above every size (eager); table[0] = 0;
                                                      one entry per b up to max(max_rows, largest size)
    family_max_rows(key, family_name) -> int          the largest cap of a mixture replaying it
    pick_smallest(families, num_rows, num_tokens,     where a step lands among a mixture's families of
                  is_guided) -> CapturePick           its guidance mode: the scheduler's choice, and
                                                      the GPU bench's
    serves(family, is_guided) -> bool                 a step of that guidance mode may replay it
"""
from __future__ import annotations

from bisect import bisect_left
from dataclasses import dataclass
from typing import Optional

from mstar.plan.schema import CaptureFamily, KeyPlan


def batch_pad_table(batch_sizes: list[int], max_rows: int) -> list[int]:
    sizes = sorted(batch_sizes)
    table = [0]
    for b in range(1, max(max_rows, sizes[-1] if sizes else 0) + 1):
        i = bisect_left(sizes, b)
        table.append(sizes[i] if i < len(sizes) else 0)
    return table


def family_max_rows(key: KeyPlan, family_name: str) -> int:
    return max((entry.cap for entry in key.mixtures
                if entry.capture == family_name or family_name in entry.also_captures), default=0)


@dataclass(frozen=True)
class CapturePick:
    """Where a step of a given size lands: capture name or None (eager), padded batch, token bucket."""

    capture: Optional[str]
    padded_batch: int
    token_bucket: int


EAGER = CapturePick(None, 0, 0)


def serves(family: CaptureFamily, is_guided: bool) -> bool:
    """Whether a step of this guidance mode may replay the family: its mode is the step's, or "any"."""
    return family.guidance == "any" or (family.guidance == "guided") == is_guided


def pick_smallest(families: tuple[CaptureFamily, ...], num_rows: int, num_tokens: list[int],
                  is_guided: bool = False) -> CapturePick:
    """Several families serve one mixture (per-shape captures of a walk, or one replayed from
    another walk): the reference's matching rule. Only families whose guidance mode is the step's
    (`is_guided`: some row's request requires guidance) or "any" are candidates. Each family's key
    for the step is its padded batch and its tokens (batched: padded batch x tokens_per_row, and
    only when no row feeds more than tokens_per_row, since the tokens a row feeds are what tell
    such families apart; packed: the smallest token bucket that holds the step's tokens). The
    smallest (tokens, padded batch) wins, the first family listed on a tie; none holds it: eager."""
    best: Optional[tuple[int, int]] = None
    pick = EAGER
    longest = max(num_tokens, default=0)
    for family in families:
        if not serves(family, is_guided):
            continue
        pad = family.batch_pad
        padded = pad[num_rows] if num_rows < len(pad) else 0
        if padded == 0:
            continue
        if family.kind == "batched":
            if longest > family.tokens_per_row:
                continue
            tokens, bucket = padded * family.tokens_per_row, 0
        else:
            at = bisect_left(family.token_buckets, sum(num_tokens))
            if at == len(family.token_buckets):
                continue
            tokens = bucket = family.token_buckets[at]
        if best is None or (tokens, padded) < best:
            best, pick = (tokens, padded), CapturePick(family.name, padded, bucket)
    return pick
