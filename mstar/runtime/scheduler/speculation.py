"""Speculation chains: step N+1 of an on-device loop, decided while step N runs.

Input: the running batch, its key's tables and ready queue, the plan's SpeculationPlan per walk
of the key, the rows that continue. Output: a `ChainStep` (the continuing rows plus the fresh
rows the FIFO builder adds) or None, meaning "yield": build the next step with
`WorkerScheduler.next_batch` once step N's results are in.

The yield rule keeps chains from starving anything: a chain speculates only when its step takes
every ready row of its key and nothing else on the worker is waiting. Fresh rows of the chain's
own walk join after the continuing rows; rows of another walk of the key make the chain yield,
unless the plan's `mixes_walks` is on for the chain's (node, walk), in which case they are merged
under the mixture's cap and rows limits (and the chain still yields if one does not fit).

Past a chunk step: when step N feeds prompt chunks (rows of a walk the key cuts), the chain goes on
only when every such row is cut in N (`StepRow.is_partial`: chunks left, named in `cut` with its
tokens left after N): those rows continue too, each with its next chunk,
min(tokens left, the walk's chunk size, the budget left after the decode rows) - what
`token_budget.fit_tokens` would give it once N's rest came back ready. It yields (as before) when
a row of a cut walk takes its last chunk in N (its first decode row is ready only after N), when a
row of a cut walk is waiting in the queue (the FIFO order between prompts), when a cut row was
removed, or when a cut row would get no token. A step of prompt rows alone (nothing whose loop goes
on) chains the same way when every one of them is cut with chunks left, on a key whose plan
chains steps at all (`_prompt_chain`): a lone prompt's chunk steps run one ahead of the other.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Sequence, Union

from mstar.plan.schema import SpeculationPlan
from mstar.runtime.scheduler.batch import Batch
from mstar.runtime.scheduler.batch_builder import Composition, compose
from mstar.runtime.scheduler.key_tables import KeyTables
from mstar.runtime.scheduler.ready_queues import KeyQueue
from mstar.runtime.scheduler.token_budget import chunk_within, fit_if_limited, fit_tokens


@dataclass
class ChainStep:
    """A speculative step: `continuing` rows of walk index `walk` first, then `composition`'s
    fresh rows taken from the ready queue."""

    walk: Optional[int]  # None: a chain of prompt chunks alone (no row of N loops on)
    continuing: list[str]
    continuing_tokens: list[int]
    composition: Composition
    chunks: Optional[list[Optional[list[int]]]] = None  # cut walks' chunk lengths (token_budget.py)
    cut_parts: list[tuple[int, list[str], list[int]]] = field(default_factory=list)  # (walk, ids, next chunks)
    # the cut rows' KV tokens before their next chunks (KeyQueue.contexts, once the chain is taken)
    cut_contexts: dict[str, int] = field(default_factory=dict)


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
    cut: Sequence[tuple[str, int]] = (),
) -> Optional[ChainStep]:
    """Decide step N+1 of `running`'s chain without changing the queue; None = yield.

    continuing: rows of running's chain walk that loop again (None = all of them);
    num_tokens: tokens each continuing row feeds (one count, or one per continuing row);
    is_other_work_waiting: another key or a TP follower batch has work ready on this worker;
    cut: (request id, tokens left after N) of running's rows cut in N with chunks left.
    """
    if running.is_follower or tables.is_followed or is_other_work_waiting:
        return None
    walk = chain_walk(tables, specs, running)
    if walk is None:
        return _prompt_chain(tables, queue, specs, running, cut, removed)
    cut_rows: list[tuple[int, str, int, int]] = []
    if _feeds_chunks(tables, running):
        found = _cut_rows(tables, queue, running, cut, removed, walk)
        if found is None:
            return None
        cut_rows = found
    rows, tokens = _continuing_rows(tables, running, walk, continuing, num_tokens, removed)
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
    if cut_rows:
        return _past_chunks(tables, queue, walk, rows, tokens, counts, cut_rows)
    fit = fit_if_limited(tables, queue, compose(tables, queue, num_rows, bit, counts), sum(tokens), num_rows, bit)
    composition, chunks = fit.composition, fit.chunks
    if composition.num_rows - num_rows < queue.num_ready:
        return None  # a ready row would be left waiting behind the chain
    return ChainStep(walk, rows, tokens, composition, chunks)


def _continuing_rows(tables: KeyTables, running: Batch, walk: int, continuing: Optional[Sequence[str]],
                     num_tokens: Union[int, Sequence[int]], removed: set[str]) -> tuple[list[str], list[int]]:
    """The rows of the chain's walk that loop again and their tokens (plan_chain_step's arguments),
    less removed requests."""
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
    return rows, tokens


def _cut_rows(tables: KeyTables, queue: KeyQueue, running: Batch, cut: Sequence[tuple[str, int]],
              removed: set[str], walk: Optional[int]) -> Optional[list[tuple[int, str, int, int]]]:
    """Running's rows of cut walks as (walk index, request id, tokens left after N, KV tokens after
    N), in step order, when every one of them has chunks left and none is of the chain's `walk`
    (None: a chain of prompt chunks alone); None (yield) otherwise (module docstring)."""
    left = dict(cut)
    walk_index, sizes, contexts = tables.walk_index, tables.chunk_sizes, queue.contexts
    rows = []
    for request_id, name, fed in zip(running.request_ids, running.walks, running.num_tokens):
        index = walk_index[name]
        if not sizes[index]:
            continue
        tokens = left.get(request_id, 0)
        if tokens <= 0 or index == walk or request_id in removed:
            return None  # its last chunk (its first decode row comes after N), or not a prompt row
        rows.append((index, request_id, tokens, contexts.get(request_id, 0) + fed))
    if any(size and queue.num_ready_walk(index) for index, size in enumerate(sizes)):
        return None  # a prompt waiting in the queue: the FIFO order between prompts decides after N
    return rows


def _prompt_chain(tables: KeyTables, queue: KeyQueue, specs: list[Optional[SpeculationPlan]], running: Batch,
                  cut: Sequence[tuple[str, int]], removed: set[str]) -> Optional[ChainStep]:
    """Step N held prompt rows alone (a prompt prefilling while nothing decodes), each cut with
    chunks left: N+1 is their next chunks, with fresh rows of walks never cut as past any chunk
    step (`_past_chunks`), on a key whose plan chains steps at all (a walk that speculates). Without
    it a lone prompt's chunk steps ran one after the other, the host's launch of each in series
    with the device's step (docs/runtime.md, "Past a lone prompt's chunk steps")."""
    if not cut or not _feeds_chunks(tables, running) or not any(s is not None and s.can_speculate for s in specs):
        return None
    walk_index, sizes = tables.walk_index, tables.chunk_sizes
    if not all(sizes[walk_index[name]] for name in running.walks):
        return None  # a row of a walk never cut that does not loop on: nothing to chain it with
    cut_rows = _cut_rows(tables, queue, running, cut, removed, None)
    if not cut_rows:
        return None
    return _past_chunks(tables, queue, None, [], [], [0] * len(tables.walks), cut_rows)


def _past_chunks(tables: KeyTables, queue: KeyQueue, walk: Optional[int], rows: list[str], tokens: list[int],
                 counts: list[int], cut_rows: list[tuple[int, str, int, int]]) -> Optional[ChainStep]:
    """The chain step after a chunk step: the continuing rows (of `walk`; none for a chain of
    prompt chunks alone) and fresh rows of walks never cut (the queue holds no row of a cut walk:
    `_cut_rows`), fitted to the budget first, then each cut row's next chunk in the budget left
    (token_budget.py's order); None when a cut row gets no token or the rows do not fit the
    mixture's cap and rows limits."""
    mask = 0 if walk is None else 1 << walk
    for index, _, _, _ in cut_rows:
        counts[index] += 1
        mask |= 1 << index
    num_fixed = len(rows) + len(cut_rows)
    if num_fixed > tables.caps[mask] or any(counts[w] > limit for w, limit in tables.limited_walks[mask]):
        return None
    num_tokens = sum(tokens)
    fit = fit_tokens(tables, queue, compose(tables, queue, num_fixed, mask, counts), num_tokens, num_fixed, mask)
    composition = fit.composition
    if composition.num_rows - num_fixed < queue.num_ready:
        return None  # a ready row would be left waiting behind the chain
    left = tables.token_budget - num_tokens
    for index, take in enumerate(composition.takes):
        if take:
            left -= sum(queue.tokens[index][:take])
    parts: dict[int, tuple[int, list[str], list[int]]] = {}
    for index, request_id, num_left, context in cut_rows:
        chunk, cost = chunk_within(left, num_left, tables.chunk_sizes[index], context, tables.context_scale)
        if chunk <= 0:
            return None  # no room for its next chunk: N+1 is built after N, as the budget decides
        left -= cost
        part = parts.setdefault(index, (index, [], []))
        part[1].append(request_id)
        part[2].append(chunk)
    contexts = {request_id: context for _, request_id, _, context in cut_rows} if tables.context_scale else {}
    return ChainStep(walk, rows, tokens, composition, fit.chunks, list(parts.values()), contexts)


def _feeds_chunks(tables: KeyTables, running: Batch) -> bool:
    """Step N holds rows of a walk whose prompts are cut: the next chunk (or the first decode row
    after the last one) is ready as soon as N ends, so step N+1 is built then, not now."""
    return tables.is_token_limited and any(size and running.mask >> w & 1 for w, size in enumerate(tables.chunk_sizes))
