"""Random steps for comparing generated glue kernels with the torch references.

`compare_pack` / `compare_scatter` run the kernel launcher and the reference on copies of the
same inputs and buffers (buffers start as random garbage, so entries either side leaves alone
must match too) and raise AssertionError naming the first differing buffer.
"""
from __future__ import annotations

import dataclasses

import torch

from mstar.runtime.engine import glue_reference as ref
from mstar.runtime.engine.glue_reference import GlueConstants, PackBuffers, RowInputs, TokenBuffers

MIN_SLOTS = 16
STREAM_CAPACITY = 8
PAD_SLOT = 3  # slot 3 of page 0, the dummy page
MAX_SEQ_LEN = 64


@dataclasses.dataclass
class Step:
    num_rows: int
    padded_batch: int
    token_bucket: int
    inputs: RowInputs
    page_table: torch.Tensor
    sampled: torch.Tensor

    @property
    def num_slots(self) -> int:
        return self.page_table.shape[0]


def random_step(constants: GlueConstants, gen: torch.Generator, device: str, max_rows: int) -> Step:
    """A step of at most `max_rows` random rows of the key's walks, padded to a captured bucket
    or run eagerly."""
    def randint(low: int, high: int, size=()) -> torch.Tensor:
        return torch.randint(low, high + 1, size, generator=gen)

    num_rows = int(randint(0, min(max_rows, constants.max_rows)))
    num_slots = max(MIN_SLOTS, constants.max_rows)
    num_walks = len(constants.walks)
    walk_index = randint(0, num_walks - 1, (num_rows,))
    # Walk 0 rows are prompt chunks, the others one-token steps (as prefill / decode are).
    num_tokens = torch.where(walk_index == 0, randint(0, 12, (num_rows,)), 1)
    context_len = randint(0, MAX_SEQ_LEN - 13, (num_rows,))
    total = int(num_tokens.sum())
    bigger_batches = [b for b in constants.batch_sizes if b >= num_rows]
    bigger_buckets = [t for t in constants.token_buckets if t >= total]
    if bigger_batches and bigger_buckets and int(randint(0, 1)):  # replays a capture
        padded_batch, token_bucket = bigger_batches[0], bigger_buckets[0]
    else:  # eager
        padded_batch, token_bucket = num_rows, total + int(randint(0, 9))
    max_tokens = max(constants.max_tokens, token_bucket, 1)
    inputs = RowInputs.allocate(constants, max_tokens, device)
    fields = {
        "walk_index": walk_index, "num_tokens": num_tokens, "context_len": context_len,
        "loop_iter": randint(0, 2, (num_rows,)), "slot": torch.randperm(num_slots, generator=gen)[:num_rows],
        "is_emitting": randint(0, 1, (num_rows,)), "stream_pos": randint(-1, STREAM_CAPACITY, (num_rows,)),
    }
    for name, values in fields.items():
        getattr(inputs, name)[:num_rows] = values.to(device)
    inputs.host_tokens.copy_(randint(0, 999, (max_tokens,)).to(device))
    pages_per_seq = -(-MAX_SEQ_LEN // constants.page_size)
    # Page 0 is the dummy page; live pages are distinct so a wrong gather shows.
    page_table = (torch.randperm(num_slots * pages_per_seq, generator=gen) + 1).reshape(num_slots, pages_per_seq)
    sampled = randint(0, 99_999, (constants.max_rows,))
    return Step(num_rows, padded_batch, token_bucket, inputs, page_table.to(torch.int32).to(device),
                sampled.to(device))


def garbage_pack_buffers(constants: GlueConstants, step: Step, gen: torch.Generator, device: str) -> PackBuffers:
    out = PackBuffers.allocate(constants, step.inputs.host_tokens.numel(),
                               constants.max_rows * step.page_table.shape[1], device)
    for field in dataclasses.fields(out):
        buffer = getattr(out, field.name)
        buffer.copy_(torch.randint(-50, 50, buffer.shape, generator=gen).to(device))
    return out


def garbage_token_buffers(constants: GlueConstants, step: Step, gen: torch.Generator, device: str) -> TokenBuffers:
    buffers = TokenBuffers.allocate(constants, step.num_slots, STREAM_CAPACITY, device)
    for field in dataclasses.fields(buffers):
        buffer = getattr(buffers, field.name)
        buffer.copy_(torch.randint(-50, 50, buffer.shape, generator=gen).to(device))
    return buffers


def _clone(buffers):
    return type(buffers)(**{f.name: getattr(buffers, f.name).clone() for f in dataclasses.fields(buffers)})


def _assert_same(expected, actual, what: str) -> None:
    for field in dataclasses.fields(expected):
        want, got = getattr(expected, field.name).cpu(), getattr(actual, field.name).cpu()
        if not torch.equal(want, got):
            raise AssertionError(f"{what}: {field.name} differs\n reference {want.tolist()}\n kernel    {got.tolist()}")


def compare_pack(key_glue: ref.KeyGlue, seed: int, device: str, max_rows: int = 1 << 30) -> None:
    constants = key_glue.constants
    gen = torch.Generator().manual_seed(seed)
    step = random_step(constants, gen, device, max_rows)
    loop_back = torch.randint(0, 999, (step.num_slots,), generator=gen).to(torch.int32).to(device)
    expected = garbage_pack_buffers(constants, step, gen, device)
    actual = _clone(expected)
    num_pages = step_pages(constants, step)
    ref.pack_step(constants, step.num_rows, step.padded_batch, step.token_bucket, step.inputs, step.page_table,
                  loop_back, expected, PAD_SLOT, num_pages)
    key_glue.pack_step(step.num_rows, step.padded_batch, step.token_bucket, step.inputs, step.page_table,
                       loop_back, actual, PAD_SLOT, num_pages)
    _assert_same(expected, actual, f"pack_step seed {seed} ({step.num_rows} rows -> {step.padded_batch})")


def step_pages(constants: GlueConstants, step: Step) -> int:
    """The step's page count as the host computes it (`step_offsets` on the rows' CPU values)."""
    n = step.num_rows
    return int(ref.step_offsets(constants, step.inputs.num_tokens[:n].cpu(), step.inputs.context_len[:n].cpu(),
                                step.padded_batch)[1][-1])


def compare_scatter(key_glue: ref.KeyGlue, seed: int, device: str, max_rows: int = 1 << 30) -> None:
    constants = key_glue.constants
    gen = torch.Generator().manual_seed(seed)
    step = random_step(constants, gen, device, max_rows)
    expected = garbage_token_buffers(constants, step, gen, device)
    actual = _clone(expected)
    ref.scatter_after_sampling(constants, step.num_rows, step.sampled, step.inputs, expected)
    key_glue.scatter_after_sampling(step.num_rows, step.sampled, step.inputs, actual)
    _assert_same(expected, actual, f"scatter_after_sampling seed {seed} ({step.num_rows} rows)")
