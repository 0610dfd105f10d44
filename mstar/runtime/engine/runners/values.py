"""Turning the conductor's edge values into tensors, and synthesising absent media.

Edge values are opaque to the conductor: token ids arrive as lists of ints (or lists of such lists
when a stream chunk concatenates items), embeddings and latents as float tensors (or lists of them),
masks as bool tensors, signals such as `time_index` as ints. `classify` sorts one value into
tokens / embeddings / nothing-to-feed; `synthesise` makes deterministic stand-in media from the
request seed when the conductor found none (it passes None). `chunk_of` keeps the positions a row
feeds this step when the scheduler cut its prompt into chunks.
"""
from __future__ import annotations

import zlib
from dataclasses import dataclass
from typing import Any, Literal, Optional

import numpy as np
import torch

from mstar.runtime.engine.models.kinds import CallInfo
from mstar.runtime.step import RowResult, StepRow


class InputError(ValueError):
    """A row's input value has a form the node cannot consume (the row fails alone)."""


class RequestInputError(InputError):
    """The value the node cannot take came with the request itself (its audio, its prompt), not
    from another node: the client's fault rather than the deployment's."""


def input_error(call: CallInfo, name: Optional[str], message: str) -> InputError:
    """The error for a value of the call's input `name` that the node cannot take: the client's
    (`RequestInputError`) where the plan says that input holds the request's own media
    (`CallInfo.request_inputs`), else the deployment's (another node's output, such as audio a
    codec made, or a stand-in)."""
    is_own = name is not None and name in call.request_inputs
    return RequestInputError(message) if is_own else InputError(message)


def classify_input(call: CallInfo, name: str, value: Any) -> Classified:
    """`classify` of the call's input `name`, its error said as `input_error`'s."""
    try:
        return classify(name, value)
    except InputError as error:
        raise input_error(call, name, str(error)) from None


def failed_row(request_id: str, node_name: str, error: Exception) -> RowResult:
    """The result of a row whose input the node could not take; a request's own bad input is
    flagged so the server can answer it as a bad request."""
    return RowResult(request_id, error=f"node {node_name}: {error}",
                     is_input_fault=isinstance(error, RequestInputError))


def out_of_memory_row(request_id: str, node_name: str, error: BaseException) -> Optional[RowResult]:
    """The failed result of a row whose computation could not allocate its memory (Python's
    MemoryError, or torch's RuntimeError: its CPU allocator's "can't allocate memory", CUDA's
    OutOfMemoryError), else None. A stateless node computes each row alone, so such a row fails
    alone: one long clip failed every request of its encoder step."""
    if not is_out_of_memory(error):
        return None
    return RowResult(request_id, error=f"node {node_name}: out of memory for this request ({type(error).__name__}: "
                                       f"{error})")


def is_out_of_memory(error: BaseException) -> bool:
    """An allocation that could not be made: Python's MemoryError, CUDA's OutOfMemoryError, or
    torch's RuntimeError from its CPU allocator ("can't allocate memory") or from a size past what
    a tensor can hold ("Storage size calculation overflowed")."""
    if isinstance(error, (MemoryError, getattr(torch, "OutOfMemoryError", MemoryError))):
        return True
    text = str(error)
    return isinstance(error, RuntimeError) and ("can't allocate memory" in text
                                                or "Storage size calculation overflowed" in text)


ValueKind = Literal["tokens", "embeddings", "signal"]


@dataclass
class Classified:
    kind: ValueKind
    tensor: Optional[torch.Tensor] = None  # tokens: long [T]; embeddings: float [T, width]


def _flatten(value: Any) -> list[Any]:
    out: list[Any] = []
    for item in value:
        if isinstance(item, (list, tuple)):
            out.extend(_flatten(item))
        else:
            out.append(item)
    return out


def classify(name: str, value: Any) -> Classified:
    """Sort one input value (see the module docstring); raises InputError for anything else."""
    if value is None or isinstance(value, (bool, int, float)):
        return Classified("signal")
    if isinstance(value, torch.Tensor):
        return _classify_tensor(name, value)
    if isinstance(value, (list, tuple)):
        tokens = _flat_token_ids(value)
        if tokens is not None:
            return Classified("tokens", tokens)
        items = _flatten(value)
        if not items:
            return Classified("signal")
        if all(isinstance(i, int) and not isinstance(i, bool) for i in items):
            return Classified("tokens", torch.tensor(items, dtype=torch.long))
        if all(isinstance(i, torch.Tensor) for i in items):
            parts = [_classify_tensor(name, i) for i in items]
            kinds = {p.kind for p in parts} - {"signal"}
            if not kinds:
                return Classified("signal")
            if len(kinds) > 1:
                raise InputError(f"input {name}: a list mixing token and embedding tensors")
            kept = [p.tensor for p in parts if p.kind != "signal" and p.tensor is not None]  # all but signals
            if kinds == {"embeddings"} and len({t.shape[1] for t in kept}) > 1:
                raise InputError(f"input {name}: embedding tensors of different widths in one chunk")
            return Classified(kinds.pop(), torch.cat(kept))
    raise InputError(f"input {name}: cannot use a value of type {type(value).__name__}")


def _flat_token_ids(value: list | tuple) -> Optional[torch.Tensor]:
    """The common case of `classify` in C loops: a non-empty flat list of ints (bools excluded,
    as `classify` excludes them) as a long tensor, else None (the general path decides). An
    8192-token prompt: 0.3 ms against 2.1 ms for the per-item checks."""
    if not _is_int_list(value):
        return None
    try:
        return torch.from_numpy(np.fromiter(value, dtype=np.int64, count=len(value)))
    except OverflowError:  # ids past int64: the general path says what it says about them
        return None


def _is_int_list(items: list | tuple) -> bool:
    """Non-empty and every item a plain int (a bool is not one, as `classify` rules), in a C loop."""
    return bool(items) and set(map(type, items)) == {int}


def token_list_chunk(value: Any, row: StepRow, memo: dict[tuple[str, str], tuple[Any, Optional[Classified]]],
                     node: str, name: str) -> Optional[list[int]]:
    """The token ids `row` feeds from `value` when it is a flat list of ints (the common prompt),
    checked and copied for this step's positions only (`chunk_of`'s); None otherwise (`classify`
    decides). A cached request's 16-token tail of a 1,040-token prompt classified the whole prompt
    into a tensor and back to a list: about 40 us of host time before its step. A cut row leaves
    `(value, None)` in the request's memo (`classify_for_row`'s), where a chunk launched ahead
    finds its prompt."""
    if type(value) is not list:
        return None
    is_chunk = is_cut(row)
    part = value[row.chunk_start:row.chunk_start + row.num_tokens] if is_chunk else value
    if not _is_int_list(part):
        return None
    if is_chunk:
        memo[(node, name)] = (value, None)
    return part if part is not value else list(value)


def held_token_chunk(prompt: list, start: int, num: int) -> Optional[list[int]]:
    """Tokens [start, start + num) of a flat token-list prompt that `token_list_chunk` left in the
    memo, for a chunk launched ahead: checked as `token_list_chunk` checks a row's own chunk (only
    that earlier chunk was), None when short or not all plain ints (the real launch then decides)."""
    ids = prompt[start:start + num]
    return ids if len(ids) == num and _is_int_list(ids) else None


def classify_for_row(row: StepRow, memo: dict[tuple[str, str], tuple[Any, Optional[Classified]]], node: str, name: str,
                     value: Any) -> Classified:
    """`classify` for the input `name` that `row` feeds on `node`. A prompt the scheduler cut into
    chunks comes back whole at every chunk step (`chunk_of` keeps the chunk's positions), and
    classifying it (one type check per token) cost about 3 ms a step for an 8192-token prompt on
    the GPU's host, more than a chunk step's kernels; so a cut row's value is classified once per
    request and input. `memo` is the request's (`RequestState.cut_inputs`); it holds the value
    itself, so an entry is reused only for that very object."""
    if not is_cut(row):
        return classify(name, value)
    held = memo.get((node, name))
    if held is not None and held[0] is value and held[1] is not None:
        return held[1]
    classified = classify(name, value)
    memo[(node, name)] = (value, classified)
    return classified


def _classify_tensor(name: str, value: torch.Tensor) -> Classified:
    if value.dtype == torch.bool or value.numel() == 0:
        return Classified("signal")
    if not value.is_floating_point():
        return Classified("tokens", value.reshape(-1).long())
    if value.dim() == 1:
        return Classified("embeddings", value.float().unsqueeze(0))
    if value.dim() == 2:
        return Classified("embeddings", value.float())
    raise InputError(f"input {name}: a float tensor of shape {tuple(value.shape)} (need [tokens, width])")


def synthesise(seed: int, node_position: int, input_position: int, shape: tuple[int, ...]) -> torch.Tensor:
    """Deterministic N(0, 1) stand-in media of `shape` for (request seed, the node's position in the
    plan, the input's position on the node): positions, not names, so a renaming changes nothing."""
    generator = torch.Generator().manual_seed(zlib.crc32(f"{seed}/{node_position}/{input_position}".encode()))
    return torch.randn(shape, generator=generator)


def is_cut(row: StepRow) -> bool:
    """The row feeds a chunk of a prompt the scheduler cut (not its first and only part)."""
    return bool(row.chunk_start or row.is_partial)


def chunk_of(tensor: torch.Tensor, row: StepRow) -> torch.Tensor:
    """The positions of an input that the row feeds this step: all of them, or, for a prompt the
    scheduler cut, `[chunk_start, chunk_start + num_tokens)` (StepRow)."""
    if not is_cut(row):
        return tensor
    return tensor[row.chunk_start:row.chunk_start + row.num_tokens]
