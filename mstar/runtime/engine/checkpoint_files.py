"""A checkpoint's tensors: which *.safetensors files are read, and what in them is refused.

In: a checkpoint directory. Out: `tensor_index(dir)` -> {decoder parameter name: (file, tensor name
in it)}, from the files' headers only (a VLM's `model.language_model.` prefix dropped), or a
`WeightsError` naming the file.

Which files:
- with `model.safetensors.index.json`: exactly the files its `weight_map` names, each tensor taken
  from the file the index gives it. A *.safetensors file the index does not list is refused (a
  stale file left from another download would otherwise be read, and win), and so are a listed
  file that is missing and a tensor the index names but its file lacks;
- without an index: every *.safetensors file; a tensor found in two of them is refused (which
  copy won would depend on the file names).
Only regular files are read (a FIFO named `x.safetensors` is refused, not waited on). Within
`headers_read_once()` (an engine's start-up: the layer-count check before a model is built, then
its loader; Whisper's encoder and decoder from one directory) each file's header is read once
(`read_header_keys`) and its tensor names kept for the next `tensor_index` of the same file; it was
read once per `tensor_index`, twice per checkpoint at start-up.

`check_finite(dir, file, name, tensor)`: a tensor holding NaN or infinite values is refused with
its file and name (one NaN in one weight turns every token to garbage while the run reports
success). `layer_indices(names)`: the K of every `model.layers.K.` name, to compare the
checkpoint's layer count with config.json's.
"""
from __future__ import annotations

import re
import stat
from contextlib import contextmanager
from contextvars import ContextVar
from pathlib import Path
from typing import Iterable, Iterator, Optional

import torch

from mstar.arg_types import shown_path
from mstar.runtime.engine.checkpoint_config import WeightsError, read_json_object

INDEX_NAME = "model.safetensors.index.json"
_LAYER = re.compile(r"model\.layers\.(\d+)\.")
# Within `headers_read_once`: the tensor names of each file read so far, by the file's path and
# identity (device, inode, size, modification time); None outside it: every header is read.
_HEADER_KEYS: ContextVar[Optional[dict[tuple, list[str]]]] = ContextVar("checkpoint_header_keys", default=None)


@contextmanager
def headers_read_once() -> Iterator[None]:
    """Within it each file's header is read once (module docstring); nested, the outer one keeps
    them. On leaving, what was read is dropped: a later load reads the files again."""
    if _HEADER_KEYS.get() is not None:
        yield
        return
    token = _HEADER_KEYS.set({})
    try:
        yield
    finally:
        _HEADER_KEYS.reset(token)


def decoder_name(name: str) -> str:
    """A VLM checkpoint keeps its text model under `model.language_model.`."""
    prefix = "model.language_model."
    return "model." + name[len(prefix):] if name.startswith(prefix) else name


def layer_indices(names: Iterable[str]) -> set[int]:
    return {int(match.group(1)) for match in map(_LAYER.match, names) if match}


def _files(weights_dir: Path) -> tuple[list[Path], Optional[dict[str, str]]]:
    """The files to read and, with an index, its weight_map (tensor name -> file name)."""
    present = sorted(weights_dir.glob("*.safetensors"))
    index_path = weights_dir / INDEX_NAME
    if not index_path.exists():
        if not present:
            raise WeightsError(f"--weights {shown_path(weights_dir)}: no *.safetensors files")
        return present, None
    index = read_json_object(index_path, "safetensors index")
    weight_map = index.get("weight_map")
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise WeightsError(f"{index_path}: no weight_map object of tensor name -> file name")
    listed = sorted(set(weight_map.values()))
    for name in listed:
        if Path(name).name != name or not (weights_dir / name).exists():
            raise WeightsError(f"{index_path}: lists {name!r}, which is not a file in {shown_path(weights_dir)}")
    unlisted = [p.name for p in present if p.name not in set(listed)]
    if unlisted:
        raise WeightsError(f"--weights {shown_path(weights_dir)}: {', '.join(unlisted)} not listed in {INDEX_NAME} "
                           "(a stale file? remove it, or fix the index)")
    return [weights_dir / name for name in listed], weight_map


def read_header_keys(file: Path) -> list[str]:
    """The tensor names in one file's header, read from the file (safetensors' errors raised)."""
    from safetensors import safe_open

    with safe_open(str(file), framework="pt") as shard:
        return list(shard.keys())


def _keys(weights_dir: Path, file: Path) -> list[str]:
    """The tensor names in one file's header (read once within `headers_read_once`)."""
    from safetensors import SafetensorError

    try:
        status = file.stat()
        if not stat.S_ISREG(status.st_mode):
            raise WeightsError(f"--weights {shown_path(weights_dir)}: {file.name} is not a regular file")
        known = _HEADER_KEYS.get()
        identity = (str(file), status.st_dev, status.st_ino, status.st_size, status.st_mtime_ns)
        if known is not None and identity in known:
            return list(known[identity])
        keys = read_header_keys(file)
        if known is not None:
            known[identity] = keys
        return list(keys)
    except (SafetensorError, OSError) as error:  # a truncated, corrupt or unreadable file
        raise WeightsError(f"--weights {shown_path(weights_dir)}: cannot read {file.name}: {error}") from None


def tensor_index(weights_dir: str) -> dict[str, tuple[Path, str]]:
    """{decoder parameter name: (file, tensor name in it)} (rules in the module docstring)."""
    directory = Path(weights_dir)
    files, weight_map = _files(directory)
    index: dict[str, tuple[Path, str]] = {}
    for file in files:
        for key in _keys(directory, file):
            if weight_map is not None and weight_map.get(key) != file.name:
                continue  # the index gives this tensor to another file (or to none)
            name = decoder_name(key)
            if name in index:
                raise WeightsError(f"--weights {shown_path(weights_dir)}: tensor {key} is in both "
                                   f"{index[name][0].name} and {file.name}; remove the stale file (or add "
                                   f"{INDEX_NAME})")
            index[name] = (file, key)
    if weight_map is not None:
        missing = sorted(set(weight_map) - {key for _, key in index.values()})
        if missing:
            raise WeightsError(f"--weights {shown_path(weights_dir)}: {INDEX_NAME} puts {missing[0]} in "
                               f"{weight_map[missing[0]]}, which does not hold it"
                               + (f" ({len(missing) - 1} more missing)" if len(missing) > 1 else ""))
    return index


def check_layer_count(weights_dir: str, tensor_names: Iterable[str], num_layers: int) -> None:
    """config.json's layer count against the checkpoint's `model.layers.K.` tensors (from the files'
    headers: the engine asks before it builds a model, whose layers a wrong count multiplies)."""
    found = layer_indices(tensor_names)
    if found and len(found) != num_layers:
        raise WeightsError(f"--weights {shown_path(weights_dir)}: config.json's num_hidden_layers is {num_layers} "
                           f"but the checkpoint holds {len(found)} layers (model.layers.{min(found)} to "
                           f"model.layers.{max(found)}); fix num_hidden_layers")


def wanted_by_file(weights_dir: str, index: dict[str, tuple[Path, str]], wanted: Iterable[str]
                   ) -> dict[Path, list[str]]:
    """The parameters `wanted` grouped by the file that holds each (`tensor_index`'s), each loader
    reading a file once; refused first: a layer count other than the checkpoint's, a parameter no
    file holds."""
    names = sorted(wanted)
    check_layer_count(weights_dir, index, len(layer_indices(names)))
    missing = [name for name in names if name not in index]
    if missing:
        raise WeightsError(f"--weights {shown_path(weights_dir)}: missing tensors {', '.join(missing[:4])}"
                           + (f" and {len(missing) - 4} more" if len(missing) > 4 else ""))
    by_file: dict[Path, list[str]] = {}
    for name in names:
        by_file.setdefault(index[name][0], []).append(name)
    return by_file


def check_finite(weights_dir: str, file: Path, key: str, tensor: torch.Tensor) -> None:
    """Refuse a tensor holding NaN or infinite values (checked after the copy into the model's
    dtype, so a value that overflows that dtype is caught too)."""
    if not tensor.is_floating_point():
        return
    # A NaN or infinity anywhere makes the sum non-finite, so a finite sum clears the tensor in one
    # vectorised pass (0.5 s for 1.2 B fp32 values here, against 11 s for isfinite().all()); a
    # non-finite sum (a bad value, or finite values that overflow when added) gets the exact count.
    if bool(torch.isfinite(tensor.sum())):
        return
    is_finite = torch.isfinite(tensor)
    if not bool(is_finite.all()):
        num_bad = int((~is_finite).sum())
        raise WeightsError(f"--weights {shown_path(weights_dir)}: {file.name}: tensor {key} holds {num_bad} NaN or "
                           f"infinite value(s) of {tensor.numel()}; the checkpoint is damaged")
