"""`mstar bench load`: how long a checkpoint takes to load into the engine's decoder on this machine.

Writes a random checkpoint in the published Llama layout (config.json + bf16 safetensors shards of
at most 1 GB, the way `save_pretrained` shards), shaped like Llama-3.2-1B unless told otherwise,
then times what `mstar run --weights` does with it: read config.json, build the decoder on the
meta device, and load shard by shard (memory-mapped, tensor by tensor, straight into the target
dtype and device; `mstar.runtime.engine.weights`). Prints the load time, the parameters per second
and the growth of the process's peak resident memory (the model itself plus the pages of the shard
being read, which count as resident while it is mapped: at most one shard, 1 GB; a second full copy
of the model would show as another model's worth).

The checkpoint is written once per run into a temporary folder (or `--dir`, kept and reused when it
already holds one; a new or empty folder, never one holding other files), by a child process:
writing it is not timed, and its memory is not this process's (the peak resident memory is the
process's lifetime peak, so a checkpoint written here first hid up to a shard of the load's growth:
1.92 GiB printed against 2.87 reusing the same files).

Usage: mstar bench load [--json] [--dir DIR] [--layers N] [--hidden N] [--vocab N] [--device D]
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional, Sequence

import torch

from mstar.arg_types import int_range, os_error_text, path_arg, shown_path

SHARD_BYTES = 1 << 30


def llama_config(num_layers: int, hidden: int, vocab: int) -> dict:
    """Llama-3.2-1B's shape (16 layers, hidden 2048, 32 heads of 64, 8 kv heads, MLP 8192, vocab
    128256, tied embeddings, llama3 RoPE) with the sizes given."""
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": hidden,
            "num_hidden_layers": num_layers, "num_attention_heads": hidden // 64, "num_key_value_heads": hidden // 256,
            "head_dim": 64, "intermediate_size": 4 * hidden, "vocab_size": vocab, "rms_norm_eps": 1e-5,
            "max_position_embeddings": 131072, "tie_word_embeddings": True, "torch_dtype": "bfloat16",
            "rope_scaling": {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                             "original_max_position_embeddings": 8192}, "rope_theta": 500000.0}


def write_checkpoint(directory: Path, config: dict) -> int:
    """Random bf16 tensors named as transformers names them; returns the parameter count."""
    from safetensors.torch import save_file

    from mstar.runtime.engine.checkpoint_config import read_checkpoint_config
    from mstar.runtime.engine.models.decoder import Decoder

    directory.mkdir(exist_ok=True)
    (directory / "config.json").write_text(json.dumps(config))
    dims = read_checkpoint_config(str(directory))
    with torch.device("meta"):
        shapes = {name: tuple(p.shape) for name, p in Decoder(dims).named_parameters()
                  if not name.startswith("flow.") and name != "lm_head.weight"}
    generator = torch.Generator().manual_seed(0)
    shard: dict[str, torch.Tensor] = {}
    num_params, num_shards, size = 0, 0, 0
    for name, shape in shapes.items():
        tensor = torch.empty(shape, dtype=torch.bfloat16).normal_(0, 0.02, generator=generator)
        shard[name], size, num_params = tensor, size + tensor.numel() * 2, num_params + tensor.numel()
        if size >= SHARD_BYTES:
            num_shards += 1
            save_file(shard, str(directory / f"model-{num_shards:05d}.safetensors"), metadata={"format": "pt"})
            shard, size = {}, 0
    if shard:
        save_file(shard, str(directory / f"model-{num_shards + 1:05d}.safetensors"), metadata={"format": "pt"})
    return num_params


def _write_apart(directory: Path, config: dict) -> None:
    """`write_checkpoint` in a child process (module docstring); OSError when it fails."""
    import multiprocessing

    child = multiprocessing.get_context("spawn").Process(target=write_checkpoint, args=(directory, config))
    child.start()
    child.join()
    if child.exitcode != 0:
        raise OSError(f"writing the checkpoint to {shown_path(directory)} failed (the writer exited "
                      f"{child.exitcode}; its error is above)")


def _peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _warm_up(directory: Path, device: str) -> None:
    """What a process does once, before the timed load: the loader's lazy imports (safetensors) and
    torch's own on a model's first build on the meta device and move to storage (its symbolic
    shapes: sympy and mpmath, 485 modules), done on a one-layer model of the checkpoint's config and
    its first file's header; they were inside the timed load. A first load in a process is still
    slower than a second (its fresh memory's page faults), as a server's one load is."""
    from dataclasses import replace

    from safetensors import safe_open

    from mstar.runtime.engine.checkpoint_config import read_checkpoint_config
    from mstar.runtime.engine.models.decoder import Decoder

    dims = read_checkpoint_config(str(directory))
    with torch.device("meta"):
        model = Decoder(replace(dims, num_layers=1, layer_is_full=dims.layer_is_full[:1]))
    model.to_empty(device=torch.device(device))
    for path in sorted(directory.glob("*.safetensors"))[:1]:
        with safe_open(str(path), framework="pt") as opened:
            opened.keys()


def measure(directory: Path, device: str) -> dict:
    from mstar.runtime.engine.checkpoint_config import read_checkpoint_config
    from mstar.runtime.engine.models.decoder import Decoder
    from mstar.runtime.engine.weights import load_decoder

    _warm_up(directory, device)
    before = _peak_rss_bytes()
    started = time.perf_counter()
    dims = read_checkpoint_config(str(directory))
    model = load_decoder(lambda: Decoder(dims), str(directory), dims.is_tied_embeddings, torch.device(device))
    elapsed = time.perf_counter() - started
    num_params = sum(p.numel() for p in model.parameters())
    num_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    return {"load_s": round(elapsed, 3), "params": num_params, "params_per_s": round(num_params / elapsed),
            "model_gib": round(num_bytes / 2**30, 2),
            "peak_rss_growth_gib": round((_peak_rss_bytes() - before) / 2**30, 2),
            "checkpoint_gib": round(sum(f.stat().st_size for f in directory.glob("*.safetensors")) / 2**30, 2),
            "device": device, "threads": torch.get_num_threads()}


def _problem(args: argparse.Namespace) -> Optional[str]:
    """Why the sizes or the device cannot be measured here, before anything is written: a model
    past the machine's memory left a partial checkpoint and a traceback."""
    from mstar.runtime.engine.placement import DeviceError, resolve_device

    if args.hidden % 256:
        return f"--hidden must be a multiple of 256, got {args.hidden}"
    try:
        resolve_device(args.device)
    except DeviceError as error:
        return str(error)
    # bf16 weights: each layer's attention (q, o: hidden^2; k, v: hidden^2 / 4 each) and MLP (3 x 4 hidden^2),
    # and the tied embedding
    num_bytes = 2 * (args.layers * 14.5 * args.hidden ** 2 + args.vocab * args.hidden)
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    if 3 * num_bytes > memory:  # written in bf16, then loaded beside it (in fp32 on the CPU)
        return (f"a model of {num_bytes / 2**30:.1f} GiB in bf16 (--layers {args.layers} --hidden {args.hidden} "
                f"--vocab {args.vocab}) is more than this machine's {memory / 2**30:.1f} GiB can write and load")
    return None


def _dir_problem(directory: str) -> Optional[str]:
    """Why the checkpoint may not be written to or read from --dir, or None: it is written only into
    a new folder (in one that exists) or an empty one, and one holding config.json is read as a
    checkpoint written before; any other folder's files would be replaced (config.json and
    model-0000N.safetensors written into whatever folder was named, its missing parents made)."""
    path, named = Path(directory), shown_path(directory)
    if path.exists() and not path.is_dir():
        return f"--dir {named} exists and is not a directory"
    if not path.exists():
        return None if path.absolute().parent.is_dir() else f"--dir {named}: its parent folder does not exist"
    if (path / "config.json").is_file() or not any(path.iterdir()):
        return None
    return (f"--dir {named} holds other files and no checkpoint (config.json); give a new or empty folder, "
            "or one this bench wrote")


SIZE_KEYS = {"num_hidden_layers": "--layers", "hidden_size": "--hidden", "vocab_size": "--vocab"}


def _check_sizes(directory: Path, config: dict) -> None:
    """A reused --dir must hold a checkpoint of the sizes asked for (it was measured whatever they
    were). WeightsError when it does not, or when its config.json cannot be read."""
    from mstar.runtime.engine.checkpoint_config import WeightsError, read_json_object

    held = read_json_object(directory / "config.json", "a checkpoint config")
    wrong = [f"{flag} {config[key]} (it holds {held.get(key)!r})" for key, flag in SIZE_KEYS.items()
             if held.get(key) != config[key]]
    if wrong:
        raise WeightsError(f"{shown_path(directory)} holds a checkpoint of other sizes than asked for: "
                           f"{', '.join(wrong)}; give another --dir, or its sizes")


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="mstar bench load", description=__doc__.split("\n")[0])
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--dir", type=path_arg,
                        help="where to write (and keep) the checkpoint; reused when it holds one")
    parser.add_argument("--layers", type=int_range(1, 4096), default=16)
    parser.add_argument("--hidden", type=int_range(256, 65536), default=2048, help="a multiple of 256")
    parser.add_argument("--vocab", type=int_range(1, 1 << 22), default=128256)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args(argv)
    problem = _problem(args) or (_dir_problem(args.dir) if args.dir else None)
    if problem:
        print(f"mstar bench load: {problem}", file=sys.stderr)
        return 1
    from mstar.runtime.engine.checkpoint_config import WeightsError

    config = llama_config(args.layers, args.hidden, args.vocab)
    try:
        with tempfile.TemporaryDirectory(prefix="mstar-bench-load-") as scratch:
            directory = Path(args.dir) if args.dir else Path(scratch)
            if not (directory / "config.json").is_file():
                print(f"writing a random checkpoint to {shown_path(directory)} ...", file=sys.stderr)
                _write_apart(directory, config)
            _check_sizes(directory, config)
            result = measure(directory, args.device)
    except (OSError, WeightsError) as error:  # a --dir that is a file, or holds a broken checkpoint
        # an OSError's str() held "[Errno N]" and the whole file name
        print(f"mstar bench load: error: {os_error_text(error) if isinstance(error, OSError) else error}",
              file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(result))
    else:
        print(f"loaded {result['params'] / 1e9:.2f} B parameters ({result['checkpoint_gib']} GiB of bf16 "
              f"safetensors -> {result['model_gib']} GiB on {result['device']}) in {result['load_s']:.2f} s "
              f"({result['params_per_s'] / 1e9:.2f} B params/s); peak resident memory grew by "
              f"{result['peak_rss_growth_gib']} GiB")
    return 0
