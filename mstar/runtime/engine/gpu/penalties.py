"""The repetition, presence and frequency penalties on the device, for the rows of a step that have one.

In: per penalised row of the step its settings and its request's row in a `PenaltyTable`: the
device's counts of the tokens it sampled on the node (the presence and frequency penalties'
counts) and a mask of the tokens it was fed there (its history: with its samples, the repetition
penalty's set), kept between steps. Out: the step's logits with those rows penalised as the CPU
sampler penalises them (engine/sampling.py: HF's repetition rule first, then OpenAI's presence and
frequency rule), before `sampler.sample`.

The host sends the table only what it collected since the step before (a row's new sample and
fed token, a prompt chunk's tokens), so a penalised row costs the host a few list slices a step
whatever its length (before, each row's whole lists were rebuilt and moved every step). Applied
by torch ops, a step's penalties are about 43 launches, 1.3-1.4 ms of an H100 host's time, which
made a penalised workload's inter-token p50 3.6 ms against 1.45 plain; `penalty_kernels` does it
in two (the default, PENALTIES: 1.6 ms; docs/engine.md). The table holds what the
host collected and nothing else: a step launched ahead samples before the host has the token of the
step before it, the token the step feeds the row from the device token table, so such rows carry
their token table slot (`pending`) and `penalise` counts the token found there beside the table's
counts (read before the step writes its own samples back), without writing it to the table: a
step launched ahead that nobody claims leaves nothing behind. A step without a penalised row
builds nothing here.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

import numpy as np
import torch

from mstar.runtime.engine.gpu import kernels, penalty_kernels
from mstar.runtime.engine.gpu_switches import PENALTIES_CHOICES
from mstar.runtime.engine.runners.values import is_out_of_memory
from mstar.runtime.engine.sampling import output_rule, repetition_rule

_FIRST_CAPACITY = 8  # table rows at first use; doubled when penalised requests outnumber them
# How a GPU applies the penalties: "kernels" (`penalty_kernels`, two launches: on an H100 a
# penalised workload's inter-token p50 1.61 ms against 3.72 by the torch ops and 1.45 plain,
# docs/engine.md "Penalties from a device table") or "torch" (torch ops, about 43 launches a step;
# `mstar run --penalties torch`).
PENALTIES = "kernels"


def set_penalties(name: str) -> None:
    """How every later `penalise` call on a GPU applies the penalties (PENALTIES_CHOICES), process-wide."""
    global PENALTIES
    if name not in PENALTIES_CHOICES:
        raise ValueError(f"the penalties are applied by one of {', '.join(PENALTIES_CHOICES)}, got {name!r}")
    PENALTIES = name


@dataclass
class TableUpdate:
    """What a step adds to the table before it penalises, in this order: the slots emptied (a
    request new to its slot, or whose lists were replaced: read again whole), the tokens counted
    as samples, the tokens marked seen (each: the rows' slots, each row's number of tokens, the
    tokens in row order); `held`: (slot, (the sampled list, its tokens, the history list, its
    tokens)) the table holds once applied."""
    resets: list[int] = field(default_factory=list)
    counted: tuple[list[int], list[int], list[int]] = field(default_factory=lambda: ([], [], []))
    seen: tuple[list[int], list[int], list[int]] = field(default_factory=lambda: ([], [], []))
    held: list[tuple[int, tuple[Sequence[int], int, Sequence[int], int]]] = field(default_factory=list)

    @property
    def num_counted(self) -> int:
        return len(self.counted[2])

    @property
    def num_seen(self) -> int:
        return len(self.seen[2])


@dataclass
class PenaltyRows:
    rows: np.ndarray  # int64 [P]: the penalised rows' places in the step's sampled rows
    repetition: np.ndarray  # float32 [P] (1: none)
    presence: np.ndarray  # float32 [P]
    frequency: np.ndarray  # float32 [P]
    slots: np.ndarray  # int64 [P]: each row's request's row in the PenaltyTable
    update: TableUpdate
    # int64 [P]: each row's device token table slot, where its last sample waits that the host has
    # not collected (a step launched ahead: every row's), fed to it from there; None: the host has all
    pending: Optional[np.ndarray] = None

    def take(self, order: list[int]) -> "PenaltyRows":
        """The same rows after the step's rows were put in `order`."""
        return PenaltyRows(new_places(order)[self.rows], self.repetition, self.presence, self.frequency, self.slots,
                           self.update, self.pending)


def new_places(order: list[int]) -> np.ndarray:
    """Each old row's place once a step's rows are put in `order` (new place i held old row order[i])."""
    places = np.empty(len(order), dtype=np.int64)
    places[order] = np.arange(len(order))
    return places


def _holds(held: tuple, sampled: Sequence[int], history: Sequence[int]) -> bool:
    """Whether a table row holding `held` (the sampled list, its tokens, the history list, its
    tokens) holds a prefix of these lists. The engine's lists only grow in place, so a list object
    other than the one held (none held yet aside) or one shorter than held means the row must be
    read again whole."""
    held_sampled, samples, held_history, known = held
    return ((held_sampled is sampled or not samples) and (held_history is history or not known)
            and samples <= len(sampled) and known <= len(history))


class PenaltyTable:
    """Per penalised request on a node, a row of int32 counts of its samples and a uint8 mask of
    the tokens it was fed, `[capacity, vocab]` on the device (allocated at the first penalised
    step, so runs without penalties hold nothing), and on the host what each row holds."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.counts: Optional[torch.Tensor] = None
        self.seen: Optional[torch.Tensor] = None
        self._slot_of: dict[str, int] = {}
        # slot -> (the sampled list, its tokens held, the history list, its tokens held)
        self._held: dict[int, tuple[Sequence[int], int, Sequence[int], int]] = {}
        self._free: list[int] = []

    def rows(self, penalised: Sequence[tuple[int, Any, Sequence[int]]], node: str,
             pending_slots: Optional[list[int]] = None) -> PenaltyRows:
        """The step's `PenaltyRows` from (row place, RequestState, tokens fed this step) of each
        penalised row (a non-empty list); pending_slots: each one's device token table slot where
        its last sample waits uncollected (a step launched ahead; None: the host has them all).
        Into the update, per row: what its table row lacks of its lists on `node` (its new samples;
        its new history and this step's fed tokens where it has a repetition penalty). One plain
        loop over the penalised rows: it is their host cost a step (`mstar bench runner`)."""
        update = TableUpdate()
        counted_slots, counted_lengths, counted = update.counted
        seen_slots, seen_lengths, seen = update.seen
        places: list[int] = []
        slots: list[int] = []
        factors: list[tuple[float, float, float]] = []
        slot_of, held_of, held_now = self._slot_of, self._held, update.held
        for place, request, fed in penalised:
            slot = slot_of.get(request.request_id)
            if slot is None:
                slot = slot_of[request.request_id] = self._free.pop() if self._free else len(slot_of)
            params = request.params
            repetition = params.repetition_penalty
            factors.append((repetition, params.presence_penalty, params.frequency_penalty))
            sampled = request.sampled.get(node, ())
            num_sampled = len(sampled)
            if repetition != 1.0:
                history = request.history.get(node, ())
                num_history = len(history) + len(fed)  # (fed: history once the step ran, held as such)
            else:
                history, num_history = (), 0
            held = held_of.get(slot)
            if held is None or not _holds(held, sampled, history):  # new, or its lists replaced (KV moved in)
                update.resets.append(slot)
                samples = known = 0
            else:
                _, samples, _, known = held
            places.append(place)
            slots.append(slot)
            if num_sampled > samples:
                counted_slots.append(slot)
                counted_lengths.append(num_sampled - samples)
                counted += sampled[samples:]
            if num_history > known:
                seen_slots.append(slot)
                seen_lengths.append(num_history - known)
                seen += history[known:]
                seen += fed
            held_now.append((slot, (sampled, num_sampled, history, num_history)))
        columns = np.array(factors, dtype=np.float32).reshape(-1, 3).T.copy()  # (each penalty contiguous)
        pending = None if pending_slots is None else np.array(pending_slots, dtype=np.int64)
        return PenaltyRows(np.array(places, dtype=np.int64), columns[0], columns[1], columns[2],
                           np.array(slots, dtype=np.int64), update, pending)

    def reserve(self, request_id: str, vocab: int) -> Optional[str]:
        """The request's row taken and the table grown to hold it, at its first step before that
        step launches (gpu/runner.py): None, or why the device has no memory for it, and the request
        fails alone. (Grown inside `penalise`, a failed allocation failed every row of the step.)"""
        if request_id in self._slot_of:
            return None
        was_free = bool(self._free)
        slot = self._free.pop() if was_free else len(self._slot_of)
        try:
            self._grow(slot + 1, vocab)
        except Exception as error:
            if was_free:
                self._free.append(slot)
            if not is_out_of_memory(error):
                raise
            return (f"the device has no memory left for the penalty table's row of this request ({5 * vocab} "
                    f"bytes: int32 counts and a uint8 mask over the vocabulary of {vocab}; {len(self._slot_of)} "
                    "penalised requests hold one now)")
        self._slot_of[request_id] = slot
        return None

    def forget(self, request_id: str) -> None:
        """The request's row freed for the next penalised request (which empties it first)."""
        slot = self._slot_of.pop(request_id, None)
        if slot is not None:
            self._held.pop(slot, None)
            self._free.append(slot)

    def prepare(self, update: TableUpdate, vocab: int) -> None:
        """The rows `update` names made and emptied where it says (queued on the current stream,
        behind the steps that read them before); its pairs are written by `penalise`."""
        need = max(update.held)[0] + 1 if update.held else 0  # (a step's slots differ: the first items decide)
        self._grow(need, vocab)
        assert self.counts is not None and self.seen is not None
        if update.resets:
            resets = torch.tensor(update.resets, dtype=torch.int64).to(self.device, non_blocking=True)
            self.counts.index_fill_(0, resets, 0)
            self.seen.index_fill_(0, resets, 0)

    def commit(self, update: TableUpdate) -> None:
        """The host's record that the device rows hold `update` (`penalise` writes them first; a
        stand-in executor without a device keeps only the record: serve/bench_runner.py)."""
        self._held.update(update.held)

    def _grow(self, need: int, vocab: int) -> None:
        """At least `need` rows: twice the rows held (at least _FIRST_CAPACITY), else, where the
        device has no room for that, exactly `need`."""
        if self.counts is not None and self.counts.shape[0] >= need:
            return
        have = 0 if self.counts is None else self.counts.shape[0]
        try:
            counts, seen = self._allocate(max(_FIRST_CAPACITY, 2 * have, need), vocab)
        except Exception as error:
            if not is_out_of_memory(error) or max(_FIRST_CAPACITY, 2 * have) <= need:
                raise
            counts, seen = self._allocate(need, vocab)
        if self.counts is not None and self.seen is not None:
            counts[:have] = self.counts
            seen[:have] = self.seen
        self.counts, self.seen = counts, seen

    def _allocate(self, capacity: int, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
        return (torch.zeros(capacity, vocab, dtype=torch.int32, device=self.device),
                torch.zeros(capacity, vocab, dtype=torch.uint8, device=self.device))


def penalise(logits: torch.Tensor, rows: PenaltyRows, table: PenaltyTable,
             loop_tokens: Optional[torch.Tensor] = None, is_fused: Optional[bool] = None) -> torch.Tensor:
    """`logits` `[R, V]` with the penalised rows penalised (a new float32 tensor), `rows.update`
    written to `table` first; loop_tokens: the device token table, where `rows.pending`'s
    uncollected samples are. is_fused: by `penalty_kernels` (None: as PENALTIES says, where they
    run, a GPU with Triton; False: torch ops, as on the CPU)."""
    if rows.pending is not None and loop_tokens is None:
        raise ValueError("penalise: rows with uncollected samples need the device token table")
    vocab = logits.shape[1]
    if is_fused is None:
        is_fused = PENALTIES == "kernels" and kernels.available(logits.device)
    table.prepare(rows.update, vocab)
    out = (_penalised_by_kernels if is_fused else _penalised_by_torch)(logits, rows, table, loop_tokens)
    table.commit(rows.update)
    return out


def _pairs(update: TableUpdate, vocab: int) -> np.ndarray:
    """int64: the counted pairs' slots and tokens, then the seen pairs' (tokens taken mod vocab,
    as the CPU rules take them)."""
    columns = []
    for slots, lengths, tokens in (update.counted, update.seen):
        columns.append(np.repeat(np.array(slots, dtype=np.int64), lengths))
        columns.append(np.array(tokens, dtype=np.int64) % vocab)
    return np.concatenate(columns)


def _penalised_by_kernels(logits: torch.Tensor, rows: PenaltyRows, table: PenaltyTable,
                          loop_tokens: Optional[torch.Tensor]) -> torch.Tensor:
    """Two copies to the device (the pairs with the rows' places and slots, then their factors)
    and two launches."""
    assert table.counts is not None and table.seen is not None
    vocab, num_rows = logits.shape[1], len(rows.rows)
    pairs = _pairs(rows.update, vocab)
    pending = rows.pending if rows.pending is not None else np.full(num_rows, -1, dtype=np.int64)
    host = np.concatenate([pairs, rows.rows, rows.slots, pending])
    factors = np.concatenate([rows.repetition, rows.presence, rows.frequency]).astype(np.float32)
    on_device = torch.from_numpy(host).to(logits.device, non_blocking=True)
    penalty_kernels.update_table(table.counts, table.seen, on_device, rows.update.num_counted,
                                 rows.update.num_seen)
    out = logits.to(torch.float32, copy=True)
    penalty_kernels.penalise_rows(logits, out, table.counts, table.seen, on_device[len(pairs):],
                                  torch.from_numpy(factors).to(logits.device, non_blocking=True),
                                  loop_tokens if loop_tokens is not None else table.counts)
    return out


def _penalised_by_torch(logits: torch.Tensor, rows: PenaltyRows, table: PenaltyTable,
                        loop_tokens: Optional[torch.Tensor]) -> torch.Tensor:
    assert table.counts is not None and table.seen is not None
    device, vocab = logits.device, logits.shape[1]

    def moved(array: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(array)).to(device, non_blocking=True)

    pairs = moved(_pairs(rows.update, vocab))
    num_counted, num_seen = rows.update.num_counted, rows.update.num_seen
    if num_counted:
        table.counts.index_put_((pairs[:num_counted], pairs[num_counted:2 * num_counted]),
                                torch.ones(num_counted, dtype=table.counts.dtype, device=device), accumulate=True)
    if num_seen:
        table.seen[pairs[2 * num_counted:2 * num_counted + num_seen], pairs[2 * num_counted + num_seen:]] = 1
    logits = logits.float()
    places, slots = moved(rows.rows), moved(rows.slots)
    sub = logits.index_select(0, places)
    counts = table.counts.index_select(0, slots).to(sub.dtype)
    if rows.pending is not None and loop_tokens is not None:
        pending = loop_tokens.index_select(0, moved(rows.pending)).long() % vocab
        counts.index_put_((torch.arange(len(rows.pending), device=device), pending),
                          torch.ones(len(rows.pending), dtype=sub.dtype, device=device), accumulate=True)
    seen = table.seen.index_select(0, slots).bool() | (counts > 0)
    sub = repetition_rule(sub, seen, moved(rows.repetition))
    sub = output_rule(sub, counts, moved(rows.presence), moved(rows.frequency))
    return logits.index_copy(0, places, sub)
