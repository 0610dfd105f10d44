"""Fit a composed step to its key's step token budget, cutting prompt rows into chunks.

In: the key's tables (`token_budget`, `chunk_sizes` per walk, caps), its ready queue, the FIFO
builder's `Composition` (rows per walk, a prefix of each walk's queue), and the rows already in
the step before the queue was scanned (a speculative chain's continuing rows: their tokens and
walk bits). Out: `Fit` - the composition with rows that do not fit left out (they stay ready, at
the head of their queue) and, per walk whose rows are cut, each taken row's chunk length.

The rule (docs/runtime.md "Chunked prefill and the step token budget"):
1. rows of walks that are never cut (decode iterations: one token a row; prompts too where the
   key cuts none) come first, oldest first across those walks (each walk a prefix of its queue),
   while their tokens fit the budget; a row that cannot be cut and is larger than the whole budget
   runs alone in its step (the only way it can run at all). Oldest first: in walk order a key
   that cuts no prompt fitted its prompts (walk 0) before older decode rows, so a steady stream
   of prompts kept decode rows out of every step for as long as it lasted;
2. then rows of cut walks, in walk order and FIFO within a walk: each takes
   min(its tokens left, the walk's chunk size, the budget left) - its next chunk; a row that would
   get no token stays out, and so does every later row of its walk. With a context scale N
   (KeyPlan.chunk_context_scale) a chunk token after c tokens of the row's KV (`KeyQueue.contexts`)
   counts 1 + c / N: the chunk is the budget left times N / (N + c), at least one token while any
   is left (so a deep prompt is never starved), and takes ceil(chunk x (N + c) / N) of the budget.
So decode rows are never pushed out by a cut prompt (an uncut one older than them goes first), a cut
prompt advances by whatever the step has room for, and the step's tokens never pass the budget. The
conductor feeds a cut row's next chunk when the step comes back, and only the last chunk samples.
Cost: a few C-level list operations for the whole rows of one walk (accumulate + bisect), a sort of
the step's rows where several walks' rows are whole, one Python iteration per cut row.
"""
from __future__ import annotations

from bisect import bisect_right
from dataclasses import dataclass
from itertools import accumulate
from typing import Optional

from mstar.runtime.scheduler.batch_builder import Composition
from mstar.runtime.scheduler.key_tables import KeyTables
from mstar.runtime.scheduler.ready_queues import KeyQueue


@dataclass
class Fit:
    composition: Composition
    # per walk: the taken rows' chunk lengths, None = whole rows; None = no walk is cut
    chunks: Optional[list[Optional[list[int]]]]


def fit_if_limited(tables: KeyTables, queue: KeyQueue, composition: Composition, num_fixed_tokens: int = 0,
                   num_fixed_rows: int = 0, fixed_mask: int = 0) -> Fit:
    """`fit_tokens` on a key with a budget or chunk sizes; the composition unchanged otherwise."""
    if not tables.is_token_limited:
        return Fit(composition, None)
    return fit_tokens(tables, queue, composition, num_fixed_tokens, num_fixed_rows, fixed_mask)


def fit_tokens(tables: KeyTables, queue: KeyQueue, composition: Composition, num_fixed_tokens: int = 0,
               num_fixed_rows: int = 0, fixed_mask: int = 0) -> Fit:
    """The step of `composition` fitted to the budget (module docstring); num_fixed_*: rows
    already in the step (their tokens count against the budget; they are never left out)."""
    takes = list(composition.takes)
    chunk_sizes, all_tokens = tables.chunk_sizes, queue.tokens
    left = tables.token_budget - num_fixed_tokens
    whole = [walk for walk, take in enumerate(takes) if take and not chunk_sizes[walk]]
    if len(whole) == 1:  # one walk of whole rows (decode beside cut prompts): a prefix of it
        walk = whole[0]
        sums = list(accumulate(all_tokens[walk][:takes[walk]]))
        fits = bisect_right(sums, left)
        if fits == 0 and num_fixed_rows == 0:
            fits = 1  # too large for any step and cannot be cut: it runs alone
        takes[walk] = fits
        left -= sums[fits - 1] if fits else 0
    elif whole:
        left = _fit_oldest_first(takes, whole, queue, left, num_fixed_rows == 0)
    chunks: list[Optional[list[int]]] = [None] * len(takes)
    scale, contexts = tables.context_scale, queue.contexts
    for walk, take in enumerate(takes):
        size = chunk_sizes[walk]
        if take and size:
            cut: list[int] = []
            for request_id, tokens in zip(queue.ids[walk][:take], all_tokens[walk][:take]):
                chunk, cost = chunk_within(left, tokens, size, contexts.get(request_id, 0), scale)
                if chunk <= 0:
                    break
                cut.append(chunk)
                left -= cost
            takes[walk] = len(cut)
            chunks[walk] = cut
    mask = fixed_mask
    for walk, take in enumerate(takes):
        if take:
            mask |= 1 << walk
    if mask & (mask - 1) == 0 and mask:  # one walk left: that walk's own cap bounds it
        walk = mask.bit_length() - 1
        takes[walk] = max(0, min(takes[walk], tables.caps[mask] - num_fixed_rows))
        kept = chunks[walk]
        if kept is not None:
            chunks[walk] = kept[:takes[walk]]
    return Fit(Composition(mask, takes, num_fixed_rows + sum(takes)), chunks)


def _fit_oldest_first(takes: list[int], walks: list[int], queue: KeyQueue, left: int, is_empty: bool) -> int:
    """Rows of several walks of whole rows, oldest first across them: each row in arrival order
    joins while its tokens fit what is left, and a walk whose row does not fit takes no later row
    (each walk stays a prefix of its queue); a first row larger than the whole budget runs alone.
    Sets `takes` for those walks; returns the budget left."""
    rows = sorted((queue.runs[walk].seq_at(index), walk) for walk in walks for index in range(takes[walk]))
    fitted = dict.fromkeys(walks, 0)
    is_closed: set[int] = set()
    for _, walk in rows:
        if walk in is_closed:
            continue
        tokens = queue.tokens[walk][fitted[walk]]
        if tokens <= left or is_empty:  # (a row too large for any step: it runs alone)
            fitted[walk] += 1
            left -= tokens
            is_empty = False
            if left <= 0:
                break
        else:
            is_closed.add(walk)
    for walk in walks:
        takes[walk] = fitted[walk]
    return left


def chunk_within(left: int, tokens: int, size: int, context: int, scale: int) -> tuple[int, int]:
    """(next chunk, budget it takes) of a cut row with `tokens` left after `context` tokens of its
    KV, given `left` of the budget, the walk's chunk size and the key's context scale (0: none)."""
    if left <= 0:
        return 0, 0
    if not scale or not context:
        chunk = min(tokens, size, left)
        return chunk, chunk
    chunk = min(tokens, size, max(1, left * scale // (scale + context)))
    return chunk, -(-chunk * (scale + context) // scale)


def with_chunks(parts: list[tuple[int, list[str], list[int]]],
                chunks: list[Optional[list[int]]]) -> list[tuple[int, list[str], list[int]]]:
    """The (walk, ids, tokens) parts a queue handed out, with cut walks' tokens as chunk lengths."""
    return [(walk, ids, cut if (cut := chunks[walk]) is not None else tokens) for walk, ids, tokens in parts]
