"""The repetition, presence and frequency penalties on the device, for the rows of a step that have one.

In: per penalised row of the step its settings and, from the host, the tokens it has seen on the
node (its history and this step's fed tokens: with the tokens it sampled, the repetition penalty's
set) and the tokens it sampled there (the presence and frequency penalties' counts, and seen). Out: the
step's logits with those rows penalised as the CPU sampler penalises them (engine/sampling.py:
HF's repetition rule first, then OpenAI's presence and frequency rule), before `sampler.sample`.

The host's lists are whole only when the step was launched after the row's previous step was
collected: a step launched ahead samples before the host has the token of the step before it. That
token is the one the step feeds the row from the device token table, so such rows carry their
table slot (`pending`) and `penalise` counts the token found there among their samples (it is read
before the step's own samples are written back). Only penalised rows cost anything: a step without
one builds nothing here.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch

from mstar.runtime.engine.sampling import output_rule, repetition_rule


@dataclass
class PenaltyRows:
    rows: np.ndarray  # int64 [P]: the penalised rows' places in the step's sampled rows
    repetition: np.ndarray  # float32 [P] (1: none)
    presence: np.ndarray  # float32 [P]
    frequency: np.ndarray  # float32 [P]
    seen: tuple[np.ndarray, np.ndarray]  # int64 (row among the P, token): the repetition penalty's tokens
    sampled: tuple[np.ndarray, np.ndarray]  # int64 (row among the P, token), once a sample
    # int64 [P]: each row's device token table slot, where its last sample waits that the host has
    # not collected (a step launched ahead: every row's), fed to it from there; None: the host has all
    pending: Optional[np.ndarray] = None

    def take(self, order: list[int]) -> "PenaltyRows":
        """The same rows after the step's rows were put in `order`."""
        return PenaltyRows(new_places(order)[self.rows], self.repetition, self.presence, self.frequency, self.seen,
                           self.sampled, self.pending)


def new_places(order: list[int]) -> np.ndarray:
    """Each old row's place once a step's rows are put in `order` (new place i held old row order[i])."""
    places = np.empty(len(order), dtype=np.int64)
    places[order] = np.arange(len(order))
    return places


def penalty_rows(penalised: list[tuple[int, object, np.ndarray, np.ndarray]],
                 pending_slots: Optional[list[int]] = None) -> Optional[PenaltyRows]:
    """From (row place, SamplingParams, tokens seen, tokens sampled: int64 arrays, `TokenArrays`)
    of each penalised row; None for none. pending_slots: each one's device token table slot where
    its last sample waits uncollected (a step launched ahead; None: the host has them all)."""
    if not penalised:
        return None
    places, params, seen, sampled = zip(*penalised)

    def pairs(arrays: tuple[np.ndarray, ...]) -> tuple[np.ndarray, np.ndarray]:
        rows = np.repeat(np.arange(len(arrays), dtype=np.int64), [len(a) for a in arrays])
        return rows, np.concatenate([np.asarray(a, dtype=np.int64) for a in arrays])

    def values(name: str) -> np.ndarray:
        return np.array([getattr(p, name) for p in params], dtype=np.float32)

    pending = None if pending_slots is None else np.array(pending_slots, dtype=np.int64)
    return PenaltyRows(np.array(places, dtype=np.int64), values("repetition_penalty"), values("presence_penalty"),
                       values("frequency_penalty"), pairs(seen), pairs(sampled), pending)


class TokenArrays:
    """A request's token lists (its history on a node, its samples there) as int64 arrays, kept
    between steps: the lists only grow (`extend`, `append`), so each step converts only the tokens
    added since. Rebuilding both lists' arrays whole each step (a 1,000-token prompt's history for
    each of 64 penalised rows) took 2.5 ms of the host's step (`mstar bench runner --prompt-len
    1000 --sampling '{"repetition_penalty": 1.1}'`)."""

    def __init__(self) -> None:
        self._arrays: dict[tuple[str, str], list] = {}  # key -> [buffer, tokens in it]

    def of(self, key: tuple[str, str], tokens: list[int]) -> np.ndarray:
        """`tokens` as an int64 array, a view of the kept buffer (`key`: which list; a list that
        shrank is read again whole; the buffer doubles when full, so a step's few new tokens are
        one slice assignment)."""
        entry = self._arrays.get(key)
        count = len(tokens)
        if entry is None or entry[1] > count:
            entry = self._arrays[key] = [np.empty(max(16, 2 * count), dtype=np.int64), 0]
        buffer, known = entry
        if known < count:
            if count > len(buffer):
                grown = np.empty(2 * count, dtype=np.int64)
                grown[:known] = buffer[:known]
                buffer = entry[0] = grown
            buffer[known:count] = tokens[known:count]
            entry[1] = count
        return buffer[:count]


def penalise(logits: torch.Tensor, rows: PenaltyRows, loop_tokens: Optional[torch.Tensor] = None) -> torch.Tensor:
    """`logits` `[R, V]` (float32) with the penalised rows penalised (a new tensor); loop_tokens:
    the device token table, where `rows.pending`'s uncollected samples are."""
    device, vocab = logits.device, logits.shape[1]

    def moved(array: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(array)).to(device, non_blocking=True)

    places = moved(rows.rows)
    sub = logits.index_select(0, places)
    counts = torch.zeros_like(sub)
    sampled_rows, sampled_tokens = (moved(a) for a in rows.sampled)
    if rows.pending is not None:
        if loop_tokens is None:
            raise ValueError("penalise: rows with uncollected samples need the device token table")
        slots = moved(rows.pending)
        sampled_rows = torch.cat([sampled_rows, torch.arange(len(rows.pending), device=device)])
        sampled_tokens = torch.cat([sampled_tokens, loop_tokens.index_select(0, slots).long()])
    counts.index_put_((sampled_rows, sampled_tokens % vocab), torch.ones_like(sampled_rows, dtype=sub.dtype),
                      accumulate=True)
    seen = counts > 0
    seen_rows, seen_tokens = (moved(a) for a in rows.seen)
    seen[seen_rows, seen_tokens % vocab] = True
    sub = repetition_rule(sub, seen, moved(rows.repetition))
    sub = output_rule(sub, counts, moved(rows.presence), moved(rows.frequency))
    return logits.index_copy(0, places, sub)
