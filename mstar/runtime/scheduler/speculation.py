"""Speculation chains: step N+1 of an on-device loop, decided while step N runs.

Input: the running batch, its key's tables and ready queue, the plan's SpeculationPlan per walk
of the key, the rows that continue. Output: a `ChainStep` (the continuing rows plus the fresh
rows the FIFO builder adds) or None, meaning "yield": build the next step with
`WorkerScheduler.next_batch` once step N's results are in.

The yield rule keeps chains from starving anything: a chain speculates only when its step takes
every ready row of its key and nothing else on the worker is waiting, and not after a step that
feeds a prompt chunk (the prompt's next chunk is ready as soon as that step ends). Fresh rows of the chain's
own walk join after the continuing rows; rows of another walk of the key make the chain yield,
unless the plan's `mixes_walks` is on for the chain's (node, walk), in which case they are merged
under the mixture's cap and rows limits (and the chain still yields if one does not fit).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence, Union

from mstar.plan.schema import SpeculationPlan
from mstar.runtime.scheduler.batch import Batch
from mstar.runtime.scheduler.batch_builder import Composition, compose
from mstar.runtime.scheduler.key_tables import KeyTables
from mstar.runtime.scheduler.ready_queues import KeyQueue
from mstar.runtime.scheduler.token_budget import fit_if_limited


@dataclass
class ChainStep:
    """A speculative step: `continuing` rows of walk index `walk` first, then `composition`'s
    fresh rows taken from the ready queue."""

    walk: int
    continuing: list[str]
    continuing_tokens: list[int]
    composition: Composition
    chunks: Optional[list[Optional[list[int]]]] = None  # cut walks' chunk lengths (token_budget.py)


def chain_walk(tables: KeyTables, specs: list[Optional[SpeculationPlan]], running: Batch) -> Optional[int]:
    """The walk index whose rows loop back on the device in `running`, or None."""
    if running.label is not None:
        walk = tables.walk_index[running.label]
        spec = specs[walk]
        return walk if spec is not None and spec.can_speculate else None
    for walk, spec in enumerate(specs):
        if running.mask >> walk & 1 and spec is not None and spec.can_speculate:
            return walk
    return None


def plan_chain_step(
    tables: KeyTables,
    queue: KeyQueue,
    specs: list[Optional[SpeculationPlan]],
    running: Batch,
    continuing: Optional[Sequence[str]],
    num_tokens: Union[int, Sequence[int]],
    removed: set[str],
    is_other_work_waiting: bool,
) -> Optional[ChainStep]:
    """Decide step N+1 of `running`'s chain without changing the queue; None = yield.

    continuing: rows of running's chain walk that loop again (None = all of them);
    num_tokens: tokens each continuing row feeds (one count, or one per continuing row);
    is_other_work_waiting: another key or a TP follower batch has work ready on this worker.
    """
    if running.is_follower or tables.is_followed or is_other_work_waiting or _feeds_chunks(tables, running):
        return None
    walk = chain_walk(tables, specs, running)
    if walk is None:
        return None
    if continuing is None:
        if running.label is not None:
            rows = list(running.request_ids)
        else:
            name = tables.walks[walk]
            rows = [rid for rid, w in zip(running.request_ids, running.walks) if w == name]
    else:
        rows = list(continuing)
    if isinstance(num_tokens, int):
        tokens = [num_tokens] * len(rows)
    else:
        tokens = list(num_tokens)
    if continuing is not None and running.label is None:
        # A mixed step: only rows of the chain's walk loop back on the device.
        name = tables.walks[walk]
        walk_of = dict(zip(running.request_ids, running.walks))
        kept = [i for i, rid in enumerate(rows) if walk_of.get(rid) == name]
        rows = [rows[i] for i in kept]
        tokens = [tokens[i] for i in kept]
    if removed and not removed.isdisjoint(rows):
        kept = [i for i, rid in enumerate(rows) if rid not in removed]
        rows = [rows[i] for i in kept]
        tokens = [tokens[i] for i in kept]
    bit = 1 << walk
    num_rows = len(rows)
    if num_rows == 0 or num_rows > tables.caps[bit]:
        return None
    num_other = queue.num_ready - queue.num_ready_walk(walk)
    spec = specs[walk]  # chain_walk picked a walk with a speculation entry
    if num_other and (spec is None or not spec.mixes_walks):
        return None
    counts = [0] * len(tables.walks)
    counts[walk] = num_rows
    fit = fit_if_limited(tables, queue, compose(tables, queue, num_rows, bit, counts), sum(tokens), num_rows, bit)
    composition, chunks = fit.composition, fit.chunks
    if composition.num_rows - num_rows < queue.num_ready:
        return None  # a ready row would be left waiting behind the chain
    return ChainStep(walk, rows, tokens, composition, chunks)


def _feeds_chunks(tables: KeyTables, running: Batch) -> bool:
    """Step N holds rows of a walk whose prompts are cut: the next chunk (or the first decode row
    after the last one) is ready as soon as N ends, so step N+1 is built then, not now."""
    return tables.is_token_limited and any(size and running.mask >> w & 1 for w, size in enumerate(tables.chunk_sizes))
