"""A step's rows -> the device step's buffers by the plan's generated `pack_step` (docs/glue.md).

In: the rows (`packing.RowSpec`: the row's walk in its key, new token ids or a loop-back token,
tokens cached, page table, row slot), the key's generated glue (`KeyGlue`), the padded batch and
token bucket, and the `PackBuffers` to write (views into a decode graph's inputs and its FlashInfer
wrapper's index buffers, a piecewise bucket's inputs, or eager buffers).
Out: `GlueStep`, built on the host (`GluePacker.host_step`): one int32 array that travels to the
device in one copy (the row list, the page-table entries granted since each row was last packed,
the new token ids) and FlashInfer's small CSR arrays (qo/kv indptr, last page lengths) on the
host, where `plan()` reads them. `GluePacker.launch` then, on the device, writes the granted
pages into the page-table mirror and runs `pack_step`: token ids (a loop-back row's read from the
device token table), positions, KV write slots, page indices and last-token indices.

The page-table mirror (`[row slots, pages per sequence]`, int32) is the device copy of each row
slot's page table. It holds the rows up to the highest slot packed so far (doubling when a step
needs more): the runner hands slots out lowest first, so that is the peak number of live requests,
not the pool's page count (orpheus: 16385 slots x 8192 pages would be 512 MiB; 64 live requests
take 2 MiB). A sequence's pages only grow while its request lives, so each row slot keeps
the number of entries already mirrored and a step sends only the pages past it (a decode row
sends one page every `page_size` steps, nothing in between); `forget(slot)` when the slot changes
hands (the request ended) or its pages moved (offload).

Padding (the glue's, docs/glue.md): padding rows are zero-length segments (indptr repeats, last
page length 0; FlashInfer's decode kernels read such a row as length 0: shared/reference/
flashinfer.md, padding style B), padding tokens write their K/V to the dummy slot. A decode graph's
padding rows still run one query token each (its token count is its batch), writing the dummy slot.
"""
from __future__ import annotations

from dataclasses import dataclass
from itertools import chain

import numpy as np
import torch

from mstar.runtime.engine.glue_reference import INDEX_DTYPE, GlueLaunchError, KeyGlue, PackBuffers, RowInputs
from mstar.runtime.engine.gpu.packing import RowSpec

NUM_ROW_FIELDS = 7  # RowInputs' per-row fields, in its order
INITIAL_MIRROR_ROWS = 64  # slot rows of the page-table mirror before a step needs more
_LOOP_BACK_ENTRY = (0,)  # a loop-back row's one (ignored) entry among the host tokens
_NO_INDICES = torch.empty(0, dtype=INDEX_DTYPE)  # a GlueStep's kv_indices until its launch sets them (never written)


@dataclass
class GlueStep:
    """A step as the host sends it to `pack_step`, with the CSR arrays FlashInfer's plan() reads."""

    num_rows: int
    padded_batch: int  # row entries of the row list (the row-slot field's padding rows are slot 0)
    num_tokens: int  # real tokens
    num_pages: int  # pages the rows hold after the step (kv_indptr's last entry)
    num_updates: int  # page-table entries granted since their rows were last packed
    host: np.ndarray  # int32: row fields [7, padded_batch] | update indices | update pages | host tokens
    qo_indptr: torch.Tensor  # int32 [padded_batch + 1], host
    kv_indptr: torch.Tensor  # int32 [padded_batch + 1], host
    last_page_len: torch.Tensor  # int32 [padded_batch], host
    kv_indices: torch.Tensor  # int32 [num_pages], a view of the launch's PackBuffers (device)


class GluePacker:
    def __init__(self, page_size: int, num_slots: int, pages_per_seq: int, dummy_slot: int, device: torch.device,
                 initial_rows: int = INITIAL_MIRROR_ROWS):
        """num_slots: row slots (the device token table's entries); pages_per_seq: the most pages a
        sequence holds (max_seq_len over the page size, rounded up); initial_rows: the mirror's
        slot rows before a step needs more."""
        self.page_size, self.dummy_slot, self.device = page_size, dummy_slot, device
        self.num_slots, self.pages_per_seq = num_slots, pages_per_seq
        self.table = torch.zeros(min(num_slots, initial_rows), pages_per_seq, dtype=INDEX_DTYPE, device=device)
        self.num_mirrored = np.zeros(num_slots, dtype=np.int64)  # entries of each slot's row on the device
        self._rows = torch.zeros(0, dtype=INDEX_DTYPE, device=device)  # the row list's device side

    def forget(self, slot: int) -> None:
        """The slot's pages are no longer the mirrored ones (new owner, pages moved)."""
        self.num_mirrored[slot] = 0

    def host_step(self, glue: KeyGlue, rows: list[RowSpec], padded_batch: int) -> GlueStep:
        """The step's row list and CSR arrays on the host; advances the mirror's counts (the
        launch that follows sends the pages). Raises GlueLaunchError for a row whose walk is not
        one of the key's, or that is fed from the device token table by a walk the plan does not
        loop back there (the kernel would feed it token 0)."""
        num_rows, page_size = len(rows), self.page_size
        constants = glue.constants
        # One pass over the rows: (walk, fed from the device, cached, slot, new tokens) each.
        walks, is_fed, cached, slots, counts = np.fromiter(
            chain.from_iterable((r.walk_index, r.token_ids is None, r.num_cached, r.row_slot,
                                 1 if r.token_ids is None else len(r.token_ids)) for r in rows),
            dtype=np.int64, count=5 * num_rows).reshape(num_rows, 5).T
        if num_rows and (int(walks.min()) < 0 or int(walks.max()) >= len(constants.walks)):
            raise GlueLaunchError(f"{constants.key}: a row's walk index is outside the key's walks {constants.walks}")
        if bool(((is_fed == 1) & ((constants.device_loop_mask >> walks) & 1 == 0)).any()):
            raise GlueLaunchError(f"{constants.key}: a row is fed from the device token table by a walk that does "
                                  "not loop back on the device")
        seq_lens = cached + counts
        pages = -(-seq_lens // page_size)
        if num_rows and int(pages.max()) > self.pages_per_seq:
            raise ValueError(f"a row needs {int(pages.max())} pages, past the {self.pages_per_seq} a sequence holds")
        if num_rows and int(slots.max()) >= self.table.shape[0]:
            self._grow(int(slots.max()) + 1)
        update_index, update_page = self._page_updates(rows, slots, pages)
        num_updates = len(update_index)
        num_tokens = int(counts.sum())
        r = padded_batch
        host = np.zeros(NUM_ROW_FIELDS * r + 2 * num_updates + num_tokens, dtype=np.int32)
        fields = host[:NUM_ROW_FIELDS * r].reshape(NUM_ROW_FIELDS, r)
        fields[0, :num_rows] = walks
        fields[1, :num_rows] = counts
        fields[2, :num_rows] = cached
        # loop_iter > 0 marks a row fed from the device token table (its walk loops back there).
        fields[3, :num_rows] = is_fed
        fields[4, :num_rows] = slots  # padding rows keep slot 0 (the sink of a decode graph's row slots)
        fields[5, :num_rows] = 1  # every row's sampled token is the engine's (the host reads it too)
        start = NUM_ROW_FIELDS * r
        host[start:start + num_updates] = update_index
        host[start + num_updates:start + 2 * num_updates] = update_page
        host[start + 2 * num_updates:] = np.fromiter(
            chain.from_iterable(_LOOP_BACK_ENTRY if row.token_ids is None else row.token_ids for row in rows),
            dtype=np.int64, count=num_tokens)
        qo, kv = _offsets(counts, r), _offsets(pages, r)
        last = np.zeros(r, dtype=np.int32)
        last[:num_rows] = np.where(pages > 0, seq_lens - (pages - 1) * page_size, 0)
        return GlueStep(num_rows, r, num_tokens, int(kv[num_rows]), num_updates, host, torch.from_numpy(qo),
                        torch.from_numpy(kv), torch.from_numpy(last), _NO_INDICES)

    def _grow(self, num_rows: int) -> None:
        """A mirror of at least `num_rows` slot rows (stream order keeps steps in flight on the old one)."""
        if num_rows > self.num_slots:
            raise GlueLaunchError(f"row slot {num_rows - 1} is past the page-table mirror's {self.num_slots} slots")
        table = torch.zeros(min(max(num_rows, 2 * self.table.shape[0]), self.num_slots), self.pages_per_seq,
                            dtype=INDEX_DTYPE, device=self.device)
        table[:self.table.shape[0]].copy_(self.table)
        self.table = table

    def _page_updates(self, rows: list[RowSpec], slots: np.ndarray, pages: np.ndarray) -> tuple[list[int], list[int]]:
        """(flat mirror index, page) of each page-table entry the rows hold past what their slots
        have mirrored; counts them as mirrored. Only rows that gained pages touch their page tables."""
        mirrored = self.num_mirrored[slots]
        update_rows = np.flatnonzero(pages > mirrored).tolist()
        if len(update_rows) > 1:
            update_rows = _one_row_per_slot(update_rows, slots, pages)
        update_index: list[int] = []
        update_page: list[int] = []
        for i in update_rows:
            start, end, base = int(mirrored[i]), int(pages[i]), int(slots[i]) * self.pages_per_seq
            update_page.extend(rows[i].page_table[start:end])
            update_index.extend(range(base + start, base + end))
        if update_rows:
            # Repeated slots in a step (never from the scheduler) must not roll the count back.
            np.maximum.at(self.num_mirrored, slots[update_rows], pages[update_rows])
        return update_index, update_page

    def row_buffer(self, size: int, token_bucket: int) -> torch.Tensor:
        """The device buffer the step's host array is copied into: `size` entries, and room past
        them for host tokens up to the bucket (the launch check wants host_tokens as long as the
        bucket; the kernel reads only the real tokens, which the copy holds)."""
        need = size + token_bucket
        if self._rows.shape[0] < need:
            self._rows = torch.zeros(2 * need, dtype=INDEX_DTYPE, device=self.device)
        return self._rows[:size]

    def launch(self, glue: KeyGlue, step: GlueStep, data: torch.Tensor, token_bucket: int, out: PackBuffers,
               loop_back: torch.Tensor) -> RowInputs:
        """On the device: the granted pages into the mirror, then one `pack_step` launch into `out`.
        data: the step's host array on the device, copied into the last `row_buffer`. Returns the step's
        `RowInputs` (views of data), which `scatter_after_sampling` reads after sampling."""
        r, u = step.padded_batch, step.num_updates
        start = NUM_ROW_FIELDS * r
        fields = data[:start].view(NUM_ROW_FIELDS, r)
        if u:
            self.table.view(-1)[data[start:start + u]] = data[start + u:start + 2 * u]
        tokens_at = start + 2 * u
        host_tokens = self._rows[tokens_at:tokens_at + max(step.num_tokens, token_bucket)]
        inputs = RowInputs(fields[0], fields[1], fields[2], fields[3], fields[4], fields[5], fields[6], host_tokens)
        glue.pack_step(step.num_rows, step.padded_batch, token_bucket, inputs, self.table, loop_back, out,
                       self.dummy_slot, step.num_pages)
        step.kv_indices = out.kv_indices[:step.num_pages]
        return inputs


def _offsets(sizes: np.ndarray, padded_batch: int) -> np.ndarray:
    """int32 [padded_batch + 1] CSR offsets of `sizes`; padding rows repeat the total (zero length)."""
    offsets = np.zeros(padded_batch + 1, dtype=np.int32)
    np.cumsum(sizes, out=offsets[1:sizes.shape[0] + 1])
    offsets[sizes.shape[0] + 1:] = offsets[sizes.shape[0]]
    return offsets


def eager_buffers(num_tokens: int, num_rows: int, num_pages: int, device: torch.device) -> PackBuffers:
    """Fresh `PackBuffers` for an eager step (no graph reads them, so they need no fixed address)."""
    def empty(n: int) -> torch.Tensor:
        return torch.empty(n, dtype=INDEX_DTYPE, device=device)

    tokens, positions, slots = empty(3 * num_tokens).view(3, num_tokens)
    return PackBuffers(tokens, positions, slots, empty(num_rows + 1), empty(num_rows + 1), empty(max(num_pages, 1)),
                       empty(num_rows), empty(num_rows))


def _one_row_per_slot(update_rows: list[int], slots: np.ndarray, pages: np.ndarray) -> list[int]:
    """The rows that send page-table entries, one per slot: the one holding the most pages. Rows
    share a slot when the executor unrolls a prompt into decode rows (one per token, all on the
    request's page table): each of a cached request's 16 tail tokens sent the whole 65-page table
    (1,040 entries: 177 us of `host_step` on a 2-core machine, 112 us with one row's 65)."""
    update_slots = slots[update_rows].tolist()
    if len(set(update_slots)) == len(update_slots):
        return update_rows
    best: dict[int, int] = {}
    for row, slot in zip(update_rows, update_slots):
        if slot not in best or pages[row] > pages[best[slot]]:
            best[slot] = row
    return sorted(best.values())
