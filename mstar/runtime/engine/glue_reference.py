"""Torch references of the generated glue kernels, and the buffers both work on.

The compiler renders one Triton module per plan (`generated/<config>_glue.py`, see
docs/glue.md). Each scheduling key of a kv node gets two kernels there:

- `pack_step`: per-row metadata in, the packed FlashInfer-style step layout out (token ids,
  positions, KV write slots, qo_indptr, kv_indptr, kv_indices, last-page lengths, the row's
  last-token logits index), padded to the step's bucket;
- `scatter_after_sampling`: each row's sampled token to the on-device loop-back buffer, the
  stream buffer and the host-visible output, as the row's walk asks.

This module holds the same two functions in plain torch (`pack_step`, `scatter_after_sampling`),
used by the tests as the specification of the kernels and by the runtime as the CPU path, plus
the static buffers both sides write into (allocated once, before the first step) and the host
checks the generated launchers share. It imports neither triton nor the compiler.

All index tensors are int32 (FlashInfer refuses int64 indices).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

INDEX_DTYPE = torch.int32


@dataclass(frozen=True)
class GlueConstants:
    """The plan's constants one key's kernels are specialised on (rendered into the glue file).

    Bit i of a mask stands for `walks[i]` (the key's walk order, as in the plan's mixtures).
    """

    key: str  # KeyPlan.name
    node: str
    walks: tuple[str, ...]
    page_size: int
    max_rows: int  # most rows any step of the key holds: max of the caps and captured batches
    device_loop_mask: int  # walks whose sampled token loops back on the device
    stream_mask: int  # walks whose sampled token goes to a stream buffer
    host_mask: int  # walks whose sampled token the host must see (edges off the device, stop checks)
    batch_sizes: tuple[int, ...]  # captured batch sizes of every capture family of the key
    # Captured token counts: packed families' token buckets, batched families' batch x tokens per row.
    token_buckets: tuple[int, ...]

    @property
    def max_tokens(self) -> int:
        """The largest captured token count (0 when the key captures nothing)."""
        return max(self.token_buckets, default=0)


@dataclass
class RowInputs:
    """Per-row metadata of one step, rows 0..num_rows-1 valid (static device buffers).

    `host_tokens` holds the rows' new token ids concatenated in row order (the packed order);
    a row fed from the device loop-back buffer has one entry there, which is ignored.
    `slot` is the row's sequence slot: its page-table row and its loop-back / stream entry.
    """

    walk_index: torch.Tensor  # [max_rows] index into GlueConstants.walks
    num_tokens: torch.Tensor  # [max_rows] new tokens this step
    context_len: torch.Tensor  # [max_rows] tokens already in the row's KV sequence
    loop_iter: torch.Tensor  # [max_rows] iteration of the enclosing loop (0 outside loops)
    slot: torch.Tensor  # [max_rows]
    is_emitting: torch.Tensor  # [max_rows] 1 when this step yields the row's next token
    stream_pos: torch.Tensor  # [max_rows] where the row's token goes in its stream buffer
    host_tokens: torch.Tensor  # [max_tokens]

    @classmethod
    def allocate(cls, constants: GlueConstants, max_tokens: int, device: torch.device | str) -> "RowInputs":
        """Zeroed buffers for steps of up to max_rows rows and `max_tokens` new tokens."""
        def zeros(n: int) -> torch.Tensor:
            return torch.zeros(n, dtype=INDEX_DTYPE, device=device)

        rows = constants.max_rows
        return cls(zeros(rows), zeros(rows), zeros(rows), zeros(rows), zeros(rows), zeros(rows), zeros(rows),
                   zeros(max_tokens))


@dataclass
class PackBuffers:
    """What `pack_step` writes: the step's packed layout, valid up to the padded batch / bucket."""

    tokens: torch.Tensor  # [max_tokens] token ids; padding tokens are 0
    positions: torch.Tensor  # [max_tokens] absolute positions; padding tokens are 0
    kv_slots: torch.Tensor  # [max_tokens] page * page_size + offset of each new token's K/V
    qo_indptr: torch.Tensor  # [max_rows + 1]
    kv_indptr: torch.Tensor  # [max_rows + 1]
    kv_indices: torch.Tensor  # [max_pages] pages of every row after this step's append
    kv_last_page_len: torch.Tensor  # [max_rows] 1..page_size for real rows, 0 for padding rows
    logits_index: torch.Tensor  # [max_rows] each row's last token in the packed order

    @classmethod
    def allocate(cls, constants: GlueConstants, max_tokens: int, max_pages: int,
                 device: torch.device | str) -> "PackBuffers":
        def zeros(n: int) -> torch.Tensor:
            return torch.zeros(n, dtype=INDEX_DTYPE, device=device)

        rows = constants.max_rows
        return cls(zeros(max_tokens), zeros(max_tokens), zeros(max_tokens), zeros(rows + 1),
                   zeros(rows + 1), zeros(max_pages), zeros(rows), zeros(rows))


@dataclass
class TokenBuffers:
    """Where sampled tokens go: kept across steps, indexed by sequence slot (host_out by row)."""

    loop_back: torch.Tensor  # [num_slots] the next input token of rows looping on the device
    stream_tokens: torch.Tensor  # [num_slots, stream_capacity]
    host_out: torch.Tensor  # [max_rows] device side of the host-visible copy

    @classmethod
    def allocate(cls, constants: GlueConstants, num_slots: int, stream_capacity: int,
                 device: torch.device | str) -> "TokenBuffers":
        return cls(torch.zeros(num_slots, dtype=INDEX_DTYPE, device=device),
                   torch.zeros(num_slots, stream_capacity, dtype=INDEX_DTYPE, device=device),
                   torch.zeros(constants.max_rows, dtype=INDEX_DTYPE, device=device))


@dataclass(frozen=True)
class KeyGlue:
    """One key's entry in a glue module's `KEYS`: its constants and its two launchers.

    The launchers take the same arguments as `pack_step` / `scatter_after_sampling` below,
    without the leading `constants`.
    """

    constants: GlueConstants
    pack_step: Callable[..., None]
    scatter_after_sampling: Callable[..., None]


class GlueLaunchError(ValueError):
    """A launch whose sizes do not fit the key's constants or the given buffers."""


def check_pack_launch(constants: GlueConstants, num_rows: int, padded_batch: int, token_bucket: int,
                      inputs: RowInputs, page_table: torch.Tensor, out: PackBuffers, num_pages: int) -> None:
    """Host-side checks on sizes only (no device read): raise GlueLaunchError with the reason.

    num_pages: the pages the step's rows hold after it (kv_indptr's last entry), which the host
    knows: it computes the offsets for FlashInfer's plan() anyway (`step_offsets`)."""
    _check_rows(constants, num_rows)
    if padded_batch < num_rows or padded_batch > constants.max_rows:
        raise GlueLaunchError(
            f"{constants.key}: padded batch {padded_batch} must lie in [{num_rows}, {constants.max_rows}]")
    # A padded step replays a capture: both its sizes are captured ones. An eager step pads
    # nothing (padded_batch == num_rows) and may take any token count.
    if padded_batch != num_rows and padded_batch not in constants.batch_sizes:
        raise GlueLaunchError(
            f"{constants.key}: padded batch {padded_batch} is not a captured batch size "
            f"{list(constants.batch_sizes)} (an eager step pads to its own row count)")
    if padded_batch != num_rows and token_bucket not in constants.token_buckets:
        raise GlueLaunchError(
            f"{constants.key}: token bucket {token_bucket} of a padded step is not a captured "
            f"token count {list(constants.token_buckets)}")
    if token_bucket < 0 or token_bucket > min(out.tokens.numel(), inputs.host_tokens.numel()):
        raise GlueLaunchError(
            f"{constants.key}: token bucket {token_bucket} exceeds the token buffers "
            f"({out.tokens.numel()} packed, {inputs.host_tokens.numel()} host)")
    if page_table.dim() != 2 or page_table.stride(1) != 1:
        raise GlueLaunchError(
            f"{constants.key}: page table must be 2-D [slots, pages per sequence] with contiguous rows")
    # The step's own page count against kv_indices, not the most its rows could hold (rows x
    # pages per sequence): an eager step's buffer holds exactly its pages. A decode graph's
    # holds its batch x a row's most pages (`packing.max_row_pages`), never just the pool's pages:
    # rows sharing a cached prefix index its pages once each.
    if num_pages < 0 or num_pages > num_rows * page_table.shape[1]:
        raise GlueLaunchError(
            f"{constants.key}: {num_pages} pages for {num_rows} rows, more pages than their page-table rows "
            f"hold (at most {page_table.shape[1]} each)")
    if num_pages > out.kv_indices.numel():
        raise GlueLaunchError(
            f"{constants.key}: kv_indices holds {out.kv_indices.numel()} pages, the step has {num_pages}")


def check_scatter_launch(constants: GlueConstants, num_rows: int, sampled: torch.Tensor) -> None:
    _check_rows(constants, num_rows)
    if sampled.numel() < num_rows:
        raise GlueLaunchError(f"{constants.key}: {sampled.numel()} sampled tokens for {num_rows} rows")


def _check_rows(constants: GlueConstants, num_rows: int) -> None:
    if num_rows < 0 or num_rows > constants.max_rows:
        raise GlueLaunchError(f"{constants.key}: {num_rows} rows, the key holds at most {constants.max_rows}")


def pack_step(constants: GlueConstants, num_rows: int, padded_batch: int, token_bucket: int,
              inputs: RowInputs, page_table: torch.Tensor, loop_back: torch.Tensor,
              out: PackBuffers, pad_slot: int, num_pages: int) -> None:
    """Write the packed layout of rows 0..num_rows-1, padded to `padded_batch` rows and
    `token_bucket` tokens, into `out` (see `pack_step` in docs/glue.md for each buffer).

    Row i owns packed tokens [qo_indptr[i], qo_indptr[i+1]) at positions context_len[i] + t; its
    KV sequence after the step has L = context_len + num_tokens tokens on ceil(L / page_size)
    pages, the first ones of its page-table row. Padding rows are zero-length segments (offsets
    repeat, last-page length 0); padding tokens are token 0 at position 0 writing K/V to
    `pad_slot` (a reserved dummy page's slot, so a captured graph never touches live pages).
    Tokens past `token_bucket` are not written. `num_pages` is the step's page count as the host
    computed it (`step_offsets`); the reference also checks that it agrees.
    """
    check_pack_launch(constants, num_rows, padded_batch, token_bucket, inputs, page_table, out, num_pages)
    page_size, device = constants.page_size, out.tokens.device
    counts = inputs.num_tokens[:num_rows].long()
    contexts = inputs.context_len[:num_rows].long()
    slots = inputs.slot[:num_rows].long()
    pages = (contexts + counts + page_size - 1) // page_size
    if num_rows and int(pages.max()) > page_table.shape[1]:
        raise GlueLaunchError(f"{constants.key}: a row needs more pages than its page-table row holds")
    qo, kv, last = step_offsets(constants, counts, contexts, padded_batch)
    if int(kv[-1]) != num_pages:
        raise GlueLaunchError(f"{constants.key}: the host counted {num_pages} pages, the rows hold {int(kv[-1])}")

    # Per new token: its row, and its index inside the row's segment.
    rows = torch.arange(num_rows, device=device)
    token_row = torch.repeat_interleave(rows, counts)
    num_step_tokens = token_row.numel()
    positions = contexts[token_row] + torch.arange(num_step_tokens, device=device) - qo[token_row]
    is_from_device = _has_walk(constants.device_loop_mask, len(constants.walks), inputs.walk_index[:num_rows])
    is_from_device &= inputs.loop_iter[:num_rows] > 0
    table = page_table.long()
    tokens = torch.where(is_from_device[token_row], loop_back.long()[slots[token_row]],
                         inputs.host_tokens[:num_step_tokens].long())
    kv_slots = table[slots[token_row], positions // page_size] * page_size + positions % page_size
    page_row = torch.repeat_interleave(rows, pages)
    kv_indices = table[slots[page_row], torch.arange(page_row.numel(), device=device) - kv[page_row]]

    num_written = min(num_step_tokens, token_bucket)
    num_pad_tokens = max(token_bucket - num_step_tokens, 0)
    pad = torch.zeros(num_pad_tokens, dtype=torch.long, device=device)
    _write(out.tokens, 0, torch.cat([tokens[:num_written], pad]))
    _write(out.positions, 0, torch.cat([positions[:num_written], pad]))
    _write(out.kv_slots, 0, torch.cat([kv_slots[:num_written], pad + pad_slot]))
    _write(out.kv_indices, 0, kv_indices[:out.kv_indices.numel()])
    _write(out.qo_indptr, 0, qo)
    _write(out.kv_indptr, 0, kv)
    _write(out.kv_last_page_len, 0, last)
    _write(out.logits_index, 0, torch.clamp(qo[1:] - 1, min=0))


def scatter_after_sampling(constants: GlueConstants, num_rows: int, sampled: torch.Tensor,
                           inputs: RowInputs, buffers: TokenBuffers) -> None:
    """Send each emitting row's sampled token where its walk needs it.

    For row i < num_rows with is_emitting[i] != 0, of walk w and slot s:
    loop_back[s] = token when w loops back on the device; stream_tokens[s, stream_pos[i]] =
    token when w streams (positions outside the buffer are dropped); host_out[i] = token when
    the host must see w's token. Every other entry is left as it was.
    """
    check_scatter_launch(constants, num_rows, sampled)
    num_walks = len(constants.walks)
    walks = inputs.walk_index[:num_rows]
    slots = inputs.slot[:num_rows].long()
    tokens = sampled[:num_rows].to(buffers.loop_back.dtype)
    is_emitting = inputs.is_emitting[:num_rows] != 0
    to_loop = is_emitting & _has_walk(constants.device_loop_mask, num_walks, walks)
    buffers.loop_back[slots[to_loop]] = tokens[to_loop]
    stream_pos = inputs.stream_pos[:num_rows].long()
    to_stream = is_emitting & _has_walk(constants.stream_mask, num_walks, walks)
    to_stream &= (stream_pos >= 0) & (stream_pos < buffers.stream_tokens.shape[1])
    buffers.stream_tokens[slots[to_stream], stream_pos[to_stream]] = tokens[to_stream]
    to_host = is_emitting & _has_walk(constants.host_mask, num_walks, walks)
    buffers.host_out[:num_rows][to_host] = tokens[to_host]


def step_offsets(constants: GlueConstants, num_tokens: torch.Tensor, context_len: torch.Tensor,
                 padded_batch: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(qo_indptr, kv_indptr, kv_last_page_len) of a step, int64 on num_tokens' device, exactly
    as `pack_step` writes them; one entry per real row in `num_tokens` / `context_len`.

    FlashInfer's `plan()` reads these on the host: pass the rows' CPU tensors here, next to the
    device-side `pack_step` launch, instead of copying the kernel's output back (a sync).
    """
    page_size = constants.page_size
    counts, seq_lens = num_tokens.long(), context_len.long() + num_tokens.long()
    pages = (seq_lens + page_size - 1) // page_size
    last = torch.zeros(padded_batch, dtype=torch.long, device=counts.device)
    last[:counts.numel()] = torch.where(pages > 0, seq_lens - (pages - 1) * page_size, 0)
    return _offsets(counts, padded_batch), _offsets(pages, padded_batch), last


def _offsets(sizes: torch.Tensor, padded_batch: int) -> torch.Tensor:
    """[padded_batch + 1] CSR offsets of `sizes`; padding rows repeat the total (zero length)."""
    offsets = torch.zeros(padded_batch + 1, dtype=torch.long, device=sizes.device)
    offsets[1:sizes.numel() + 1] = torch.cumsum(sizes, 0)
    offsets[sizes.numel() + 1:] = offsets[sizes.numel()]
    return offsets


def _has_walk(mask: int, num_walks: int, walk_index: torch.Tensor) -> torch.Tensor:
    """Per walk index: is it a walk of the key (0 <= w < num_walks) with bit w of `mask` set."""
    walk = walk_index.long()
    is_valid = (walk >= 0) & (walk < num_walks)
    return is_valid & (((mask >> walk.clamp(0, max(num_walks - 1, 0))) & 1) == 1)


def _write(dest: torch.Tensor, start: int, values: torch.Tensor) -> None:
    """Copy `values` into dest[start:] (dest's dtype and device)."""
    if values.numel():
        dest[start:start + values.numel()] = values.to(dtype=dest.dtype, device=dest.device)

