"""Messages between rank processes as plain data: a JSON header and a list of tensors.

No pickling: every value is written by an explicit rule, and anything else is a `WireError`
naming its type. A value tree is JSON with tagged objects:

    None, bool, int, float, str       as themselves
    list                              a JSON list
    tuple                             {"$tuple": [...]}
    dict (str keys)                   {"$dict": {...}}
    torch.Tensor                      {"$tensor": i}   (i: index into the message's tensors)
    numpy array                       {"$ndarray": i}  (sent as a tensor, read back as an array)

The dataclasses that cross ranks (`Step` and its rows without the conductor's row handle,
`StepResult`, `RowResult`, `Request`) are written field by field (`dataclasses.fields`, so a
field added later travels too), each field's value by the rules above; a `RowResult`'s
`logprobs` too where set (a class default, not a field: step.py).

    encode_value(value, tensors) -> json-able      decode_value(obj, tensors) -> value
    encode_step(step, tensors) / decode_step(obj, tensors)
    encode_result(result, tensors) / decode_result(obj, tensors)
    encode_request(request, tensors) / decode_request(obj, tensors)
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any

import numpy as np
import torch

from mstar.runtime.conductor.request import Request
from mstar.runtime.step import RowResult, Step, StepResult, StepRow


# RowResult.logprobs and .prompt_logprobs: class defaults, not fields (step.py), sent where set
ROW_EXTRAS = ("logprobs", "prompt_logprobs")


class WireError(ValueError):
    """A value that has no plain-data encoding (the message names its type)."""


def encode_value(value: Any, tensors: list[torch.Tensor]) -> Any:
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        if not math.isfinite(value):
            return {"$float": repr(value)}
        return value
    if isinstance(value, list):
        return [encode_value(item, tensors) for item in value]
    if isinstance(value, tuple):
        return {"$tuple": [encode_value(item, tensors) for item in value]}
    if isinstance(value, dict):
        bad = next((key for key in value if not isinstance(key, str)), None)
        if bad is not None:
            raise WireError(f"a dict key of type {type(bad).__name__} cannot cross ranks (keys must be str)")
        return {"$dict": {key: encode_value(item, tensors) for key, item in value.items()}}
    if isinstance(value, torch.Tensor):
        tensors.append(value)
        return {"$tensor": len(tensors) - 1}
    if isinstance(value, np.ndarray):
        tensors.append(torch.from_numpy(np.ascontiguousarray(value)))
        return {"$ndarray": len(tensors) - 1}
    raise WireError(f"a value of type {type(value).__name__} cannot cross ranks (no plain-data encoding)")


def decode_value(obj: Any, tensors: list[torch.Tensor]) -> Any:
    if isinstance(obj, list):
        return [decode_value(item, tensors) for item in obj]
    if not isinstance(obj, dict):
        return obj
    if "$tensor" in obj:
        return tensors[obj["$tensor"]]
    if "$ndarray" in obj:
        return tensors[obj["$ndarray"]].numpy()
    if "$tuple" in obj:
        return tuple(decode_value(item, tensors) for item in obj["$tuple"])
    if "$dict" in obj:
        return {key: decode_value(item, tensors) for key, item in obj["$dict"].items()}
    if "$float" in obj:
        return float(obj["$float"])
    raise WireError(f"an object {sorted(obj)} in a message has no known tag")


def _encode_fields(obj: Any, tensors: list[torch.Tensor], skip: tuple[str, ...] = ()) -> dict[str, Any]:
    """Every dataclass field of `obj` but `skip`, each by the value rules above."""
    return {f.name: encode_value(getattr(obj, f.name), tensors) for f in dataclasses.fields(obj) if f.name not in skip}


def _decode_fields(obj: dict[str, Any], tensors: list[torch.Tensor]) -> dict[str, Any]:
    return {name: decode_value(value, tensors) for name, value in obj.items()}


def encode_step(step: Step, tensors: list[torch.Tensor]) -> dict[str, Any]:
    """Every field of the step; each row without the conductor's `handle` (engines ignore it)."""
    obj = _encode_fields(step, tensors, skip=("rows",))
    obj["rows"] = [_encode_fields(row, tensors, skip=("handle",)) for row in step.rows]
    return obj


def decode_step(obj: dict[str, Any], tensors: list[torch.Tensor]) -> Step:
    fields = _decode_fields({k: v for k, v in obj.items() if k != "rows"}, tensors)
    return Step(rows=[StepRow(**_decode_fields(row, tensors)) for row in obj["rows"]], **fields)


def encode_result(result: StepResult, tensors: list[torch.Tensor]) -> dict[str, Any]:
    obj = _encode_fields(result, tensors, skip=("rows",))
    obj["rows"] = [_encode_row(row, tensors) for row in result.rows]
    return obj


def _encode_row(row: RowResult, tensors: list[torch.Tensor]) -> dict[str, Any]:
    """The row's fields, and its log-probabilities where it has them (not fields: step.py)."""
    obj = _encode_fields(row, tensors)
    for name in ROW_EXTRAS:
        value = getattr(row, name)
        if value is not None:
            obj[name] = encode_value(value, tensors)
    return obj


def decode_result(obj: dict[str, Any], tensors: list[torch.Tensor]) -> StepResult:
    fields = _decode_fields({k: v for k, v in obj.items() if k != "rows"}, tensors)
    return StepResult(rows=[_decode_row(row, tensors) for row in obj["rows"]], **fields)


def _decode_row(obj: dict[str, Any], tensors: list[torch.Tensor]) -> RowResult:
    row = RowResult(**_decode_fields({k: v for k, v in obj.items() if k not in ROW_EXTRAS}, tensors))
    for name in ROW_EXTRAS:
        if name in obj:
            setattr(row, name, decode_value(obj[name], tensors))
    return row


def encode_request(request: Request, tensors: list[torch.Tensor]) -> dict[str, Any]:
    return _encode_fields(request, tensors)


def decode_request(obj: dict[str, Any], tensors: list[torch.Tensor]) -> Request:
    return Request(**_decode_fields(obj, tensors))
