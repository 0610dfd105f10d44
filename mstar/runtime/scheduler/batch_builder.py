"""The FIFO batch builder: which ready rows of one key join the next step.

Rule (docs/runtime.md "## Scheduler"): rows are considered in FIFO order (arrival sequence) across
the key's walks. A row of walk w joins unless the step's cap with w present - the plan's
MixtureEntry cap for the new mask: w's own cap in a one-walk step, the combined walk's cap (or the
smallest cap among the walks present) once the step mixes walks - is at or below the rows already
in the step, or unless joining would break a `rows W <= n` limit of a mixed step (checked for
every walk present when the step first becomes mixed). Rows of one walk keep their FIFO order:
once a row of walk w is pushed out, later rows of w stay out of this step too, so the rows
scheduled are a prefix of each walk's queue. Rows pushed out stay in their queue (`returned`).

Cost: the decisions run over runs of consecutive same-walk rows (found by bisect on each walk's
sequence runs), not over rows: one-walk keys decide in O(1), mixed keys in O(walk alternations).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import AbstractSet

from mstar.runtime.scheduler.batch import Batch
from mstar.runtime.scheduler.key_tables import KeyTables
from mstar.runtime.scheduler.ready_queues import KeyQueue

_AFTER_ALL = 1 << 62  # larger than any arrival sequence number


@dataclass
class Composition:
    """The builder's decision: the step's mask and how many rows each walk's queue gives."""

    mask: int
    takes: list[int]
    num_rows: int


def compose(
    tables: KeyTables,
    queue: KeyQueue,
    num_rows: int = 0,
    mask: int = 0,
    counts: list[int] | None = None,
) -> Composition:
    """Decide the next step of one key from its ready queue, without changing the queue.

    num_rows, mask, counts: rows already in the step before the queue is scanned (a speculative
    chain's continuing rows); counts[w] are included in num_rows. Returns the final mask and, per
    walk, how many rows of that walk's queue join (a prefix). `Composition.num_rows` includes the
    rows given in advance.
    """
    ids, runs = queue.ids, queue.runs
    num_walks = len(ids)
    takes = [0] * num_walks
    caps = tables.caps
    with_rows = [w for w in range(num_walks) if ids[w]]
    if len(with_rows) == 1 and (mask == 0 or mask == 1 << with_rows[0]):
        return _compose_one_walk(with_rows[0], len(ids[with_rows[0]]), caps, num_rows, mask, takes)

    counts = list(counts) if counts is not None else [0] * num_walks
    limits, is_mixed, limited = tables.limits, tables.is_mixed, tables.limited_walks
    heads = [0] * num_walks  # next unscanned row per walk
    open_walks = with_rows
    while open_walks:
        walk, next_seq = _oldest_head(open_walks, runs, heads)
        num_walk_rows = len(ids[walk])
        bit = 1 << walk
        if not mask & bit:
            # The row would add a walk to the step: the new mask's cap and limits decide.
            new_mask = mask | bit
            counts[walk] += 1
            if caps[new_mask] <= num_rows or any(counts[w] > limit for w, limit in limited[new_mask]):
                counts[walk] -= 1
                open_walks.remove(walk)
                continue
            mask = new_mask
            num_rows += 1
            heads[walk] += 1
            takes[walk] += 1
            if heads[walk] == num_walk_rows:
                open_walks.remove(walk)
                continue
        # A run of this walk's rows older than every other walk's head, under a fixed mask.
        start = heads[walk]
        end = num_walk_rows if next_seq == _AFTER_ALL else runs[walk].index_at_or_after(next_seq, start)
        room = caps[mask] - num_rows
        if is_mixed[mask]:
            room = min(room, limits[walk] - counts[walk])
        take = min(end - start, max(room, 0))
        heads[walk] += take
        takes[walk] += take
        counts[walk] += take
        num_rows += take
        if take < end - start or heads[walk] == num_walk_rows:
            open_walks.remove(walk)
    return Composition(mask, takes, num_rows)


def _compose_one_walk(walk: int, num_ready: int, caps: list[int], num_rows: int, mask: int,
                      takes: list[int]) -> Composition:
    """One walk and no mixing: the walk's own cap bounds the step, no rows limits apply."""
    take = min(num_ready, caps[1 << walk] - num_rows)
    if take <= 0:
        return Composition(mask, takes, num_rows)
    takes[walk] = take
    return Composition(mask | 1 << walk, takes, num_rows + take)


def _oldest_head(open_walks: list[int], runs, heads: list[int]) -> tuple[int, int]:
    """The walk holding the oldest unscanned row, and the oldest head among the other walks
    (`_AFTER_ALL` when there is none)."""
    walk = open_walks[0]
    head_seq = runs[walk].seq_at(heads[walk])
    next_seq = _AFTER_ALL
    for other in open_walks[1:]:
        seq = runs[other].seq_at(heads[other])
        if seq < head_seq:
            next_seq, walk, head_seq = head_seq, other, seq
        elif seq < next_seq:
            next_seq = seq
    return walk, next_seq


def make_batch(
    worker: int,
    tables: KeyTables,
    mask: int,
    parts: list[tuple[int, list[str], list[int]]],
    is_speculative: bool = False,
    guided: AbstractSet[str] = frozenset(),
) -> Batch:
    """Assemble a Batch from (walk index, request ids, tokens) parts in the key's walk order,
    with label, attention and capture bucket looked up for the mask. `guided`: requests of the
    key that require guidance; the step is guided when it holds one (read only on a key whose
    captures are keyed by guidance mode)."""
    walks = tables.walks
    if len(parts) == 1:
        walk, request_ids, num_tokens = parts[0]
        row_walks = [walks[walk]] * len(request_ids)
    else:
        request_ids, row_walks, num_tokens = [], [], []
        for walk, ids, tokens in parts:
            request_ids += ids
            row_walks += [walks[walk]] * len(ids)
            num_tokens += tokens
    is_guided = tables.is_guidance_keyed and not guided.isdisjoint(request_ids)
    pick = tables.pick_capture(mask, len(request_ids), num_tokens, is_guided)
    return Batch(
        worker=worker,
        key=tables.name,
        node=tables.node,
        mask=mask,
        label=tables.labels[mask],
        request_ids=request_ids,
        walks=row_walks,
        num_tokens=num_tokens,
        capture=pick.capture,
        padded_batch=pick.padded_batch,
        token_bucket=pick.token_bucket,
        attention=tables.attention[mask],
        is_speculative=is_speculative,
        is_guided=is_guided,
    )
