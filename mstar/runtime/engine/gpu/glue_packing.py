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
_LOOP_BACK_ENTRY = [0]  # a loop-back row's one (ignored) entry among the host tokens
_NO_INDICES = torch.empty(0, dtype=INDEX_DTYPE)  # a GlueStep's kv_indices until its launch sets them (never written)


@dataclass
class GlueStep:
    """A step as the host sends it to `pack_step`, with the CSR arrays FlashInfer's plan() reads."""

    num_rows: int
    padded_batch: int  # row entries of the row list (the row-slot field's padding rows are slot 0)
    num_tokens: int  # real tokens
    num_pages: int  # pages the rows hold after the step (kv_indptr's last entry)
    num_updates: int  # page-table entries granted since their rows were last packed
    host: np.ndarray  # int32: row fields [7, padded_batch] | (0 to an even offset) | update indices, int64
    # (2 words each) | update pages | host tokens
    qo_indptr: torch.Tensor  # int32 [padded_batch + 1], host
    kv_indptr: torch.Tensor  # int32 [padded_batch + 1], host
    last_page_len: torch.Tensor  # int32 [padded_batch], host
    kv_indices: torch.Tensor  # int32 [num_pages], a view of the launch's PackBuffers (device)
    seq_lens: torch.Tensor  # int32 [padded_batch], host: each row's KV length after the step (0: padding)


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
        loop back there (the kernel would feed it token 0).

        One pass over the rows in plain Python, then one array: a serial step (a cached request's
        first, a lone decode row) waits for this before its replay, and numpy's fixed cost per call
        made a 1-row step 69 us against 15-17 (`mstar bench engine --host-pack`)."""
        constants = glue.constants
        num_walks, loop_mask, page_size = len(constants.walks), constants.device_loop_mask, self.page_size
        num_rows, pad = len(rows), padded_batch - len(rows)
        walks, counts, cached, is_fed, slots = [], [], [], [], []
        qo, kv, last, seq_lens = [0], [0], [], []
        token_lists: list = []  # each row's new token ids (a loop-back row's one ignored entry)
        most_pages: dict[int, tuple[int, int]] = {}  # slot -> (pages, row): the row that sends its entries
        num_tokens = num_pages = 0
        for index, row in enumerate(rows):
            ids, walk, slot, num_cached = row.token_ids, row.walk_index, row.row_slot, row.num_cached
            if not 0 <= walk < num_walks or (ids is None and not loop_mask >> walk & 1):
                _refuse_walk(constants, walk)
            is_fed.append(ids is None)
            count = 1 if ids is None else len(ids)
            token_lists.append(_LOOP_BACK_ENTRY if ids is None else ids)
            seq_len = num_cached + count
            pages = -(-seq_len // page_size)
            if pages > self.pages_per_seq:
                raise ValueError(f"a row needs {pages} pages, past the {self.pages_per_seq} a sequence holds")
            walks.append(walk)
            counts.append(count)
            cached.append(num_cached)
            slots.append(slot)
            num_tokens += count
            num_pages += pages
            qo.append(num_tokens)
            kv.append(num_pages)
            last.append(seq_len - (pages - 1) * page_size if pages else 0)
            seq_lens.append(seq_len)
            if slot not in most_pages or pages > most_pages[slot][0]:
                most_pages[slot] = (pages, index)
        if num_rows and max(most_pages) >= self.table.shape[0]:
            self._grow(max(most_pages) + 1)
        update_index, update_page = self._page_updates(rows, most_pages)
        num_updates = len(update_index)
        # The fields in RowInputs' order: loop_iter > 0 marks a row fed from the device token table
        # (its walk loops back there); padding rows keep slot 0 (the sink of a decode graph's row
        # slots); every real row's sampled token is the engine's (the host reads it too).
        host = _host_array([walks, counts, cached, is_fed, slots, [1] * num_rows], padded_batch, update_index,
                           update_page, token_lists, num_tokens)
        zeros = [0] * pad
        # Padding rows are zero-length segments (the offsets repeat) with last page length 0.
        csr = torch.from_numpy(np.array(qo + [num_tokens] * pad + kv + [num_pages] * pad + last + zeros
                                        + seq_lens + zeros, dtype=np.int32))
        width = padded_batch + 1
        return GlueStep(num_rows, padded_batch, num_tokens, num_pages, num_updates, host, csr[:width],
                        csr[width:2 * width], csr[2 * width:2 * width + padded_batch], _NO_INDICES,
                        csr[2 * width + padded_batch:])

    def _grow(self, num_rows: int) -> None:
        """A mirror of at least `num_rows` slot rows (stream order keeps steps in flight on the old one)."""
        if num_rows > self.num_slots:
            raise GlueLaunchError(f"row slot {num_rows - 1} is past the page-table mirror's {self.num_slots} slots")
        table = torch.zeros(min(max(num_rows, 2 * self.table.shape[0]), self.num_slots), self.pages_per_seq,
                            dtype=INDEX_DTYPE, device=self.device)
        table[:self.table.shape[0]].copy_(self.table)
        self.table = table

    def _page_updates(self, rows: list[RowSpec], most_pages: dict[int, tuple[int, int]]
                      ) -> tuple[list[int], list[int]]:
        """(flat mirror index, page) of each page-table entry the rows hold past what their slots
        have mirrored; counts them as mirrored. most_pages: each slot's most pages after the step and
        the (first) row holding them. One row per slot sends: rows share a slot when the executor
        unrolls a prompt into decode rows (one per token, all on the request's page table), and each of
        a cached request's 16 tail tokens sent the whole 65-page table (1,040 entries) before."""
        mirrored = self.num_mirrored
        update_index: list[int] = []
        update_page: list[int] = []
        for slot, (pages, index) in sorted(most_pages.items(), key=lambda item: item[1][1]):
            start = int(mirrored[slot])
            if pages > start:
                base = slot * self.pages_per_seq
                update_page.extend(rows[index].page_table[start:pages])
                update_index.extend(range(base + start, base + pages))
                mirrored[slot] = pages
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
        at = start + start % 2  # the update indices' int64 words start on an even offset (`_host_array`)
        if u:
            # One index_copy_ with the indices read as int64 from the staged words: a cached
            # request's 65 new entries took about 40 us inside its step as a tensor-indexed
            # assignment (inferred from the step's pieces on an H200's host; 17 us in a loop).
            self.table.view(-1).index_copy_(0, data[at:at + 2 * u].view(torch.int64), data[at + 2 * u:at + 3 * u])
        tokens_at = at + 3 * u
        host_tokens = self._rows[tokens_at:tokens_at + max(step.num_tokens, token_bucket)]
        walk, count, context, loop_iter, slot, emits, stream_pos = data[:start].view(NUM_ROW_FIELDS, r).unbind(0)
        inputs = RowInputs(walk, count, context, loop_iter, slot, emits, stream_pos, host_tokens)
        glue.pack_step(step.num_rows, step.padded_batch, token_bucket, inputs, self.table, loop_back, out,
                       self.dummy_slot, step.num_pages)
        step.kv_indices = out.kv_indices[:step.num_pages]
        return inputs


def _host_array(fields: list[list], padded_batch: int, update_index: list[int], update_page: list[int],
                token_lists: list, num_tokens: int) -> np.ndarray:
    """`GlueStep.host`: the row fields (the real rows' values, each padded with zeros to the
    batch; the last field, stream positions, all zeros), the update indices as int64 (low word,
    then 0) from an even offset (`GluePacker.launch` reads them so), the update pages, the tokens."""
    head: list[int] = []
    for values in fields:
        head += values
        head += [0] * (padded_batch - len(values))
    head += [0] * (padded_batch * (NUM_ROW_FIELDS - len(fields)) + NUM_ROW_FIELDS * padded_batch % 2)
    words = [0] * (2 * len(update_index))
    words[::2] = update_index
    head += words
    head += update_page
    host = np.empty(len(head) + num_tokens, dtype=np.int32)
    host[:len(head)] = head
    host[len(head):] = np.fromiter(chain.from_iterable(token_lists), dtype=np.int32, count=num_tokens)
    return host


def eager_buffers(num_tokens: int, num_rows: int, num_pages: int, device: torch.device) -> PackBuffers:
    """Fresh `PackBuffers` for an eager step (no graph reads them, so they need no fixed address)."""
    def empty(n: int) -> torch.Tensor:
        return torch.empty(n, dtype=INDEX_DTYPE, device=device)

    tokens, positions, slots = empty(3 * num_tokens).view(3, num_tokens)
    return PackBuffers(tokens, positions, slots, empty(num_rows + 1), empty(num_rows + 1), empty(max(num_pages, 1)),
                       empty(num_rows), empty(num_rows))


def _refuse_walk(constants, walk: int) -> None:
    """A row's walk is not one of the key's, or it is fed from the device token table by a walk that
    does not loop back there (the kernel would feed it token 0)."""
    if not 0 <= walk < len(constants.walks):
        raise GlueLaunchError(f"{constants.key}: a row's walk index is outside the key's walks {constants.walks}")
    raise GlueLaunchError(f"{constants.key}: a row is fed from the device token table by a walk that does not "
                          "loop back on the device")
