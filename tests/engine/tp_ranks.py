"""Helpers for the tensor-parallel tests: run a function on N ranks in spawned processes (gloo over
a file store), and a model-level greedy run that returns the logits of every step.

`spawn_ranks(fn, size, args, timeout_s, backend)` starts `size` processes, each running
`fn(rank, size, *args)` after `init_process_group` (gloo by default; with nccl, rank r on GPU r;
60 s collective timeout), and returns {rank: result}. A rank that
raises sends its traceback and the call fails with it; processes still alive at the end (a hang, a
failure elsewhere) are terminated, then killed, in `finally`: no test leaves a process behind.
"""
from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import queue as queue_module
import tempfile
import time
import traceback
from datetime import timedelta
from typing import Any, Callable

import torch

from mstar.runtime.engine.attention.torch_paged import Segment
from mstar.runtime.engine.kv.cache import KvCache
from mstar.runtime.engine.kv.pages import PagePool
from mstar.runtime.engine.models.decoder import DecoderBatch
from mstar.runtime.engine.models.gdn import LinearStates

CPU = torch.device("cpu")


def _child(fn: Callable, rank: int, size: int, store: str, args: tuple, results: Any, backend: str) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    try:
        if backend == "nccl":
            torch.cuda.set_device(rank)  # one GPU a rank
        dist.init_process_group(backend, init_method=f"file://{store}", rank=rank, world_size=size,
                                timeout=timedelta(seconds=60))
        # Pickled here: a tensor put on the queue as such travels as a shared-memory handle that
        # dies with this process.
        results.put((rank, True, pickle.dumps(fn(rank, size, *args))))
    except BaseException:  # noqa: B036 - the parent must hear of every failure, then the child exits
        results.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def spawn_ranks(fn: Callable, size: int, args: tuple = (), timeout_s: float = 120.0,
                backend: str = "gloo") -> dict[int, Any]:
    context = mp.get_context("spawn")
    results = context.Queue()
    store = os.path.join(tempfile.mkdtemp(prefix="mstar-tp-"), "store")
    processes = [context.Process(target=_child, args=(fn, rank, size, store, args, results, backend),
                                 daemon=True)
                 for rank in range(size)]
    try:
        for process in processes:
            process.start()
        return _collect(processes, results, timeout_s)
    finally:
        for process in processes:
            if process.pid is None:
                continue  # never started
            process.join(timeout=10)
            if process.is_alive():
                process.terminate()
                process.join(timeout=5)
            if process.is_alive():
                process.kill()
                process.join()


def _collect(processes: list, results: Any, timeout_s: float) -> dict[int, Any]:
    """Every rank's result; fails at once when a rank reports a failure or exits without a result."""
    found: dict[int, Any] = {}
    deadline = time.monotonic() + timeout_s
    while len(found) < len(processes):
        try:
            rank, is_ok, value = results.get(timeout=1.0)
        except queue_module.Empty:
            silent = [rank for rank, p in enumerate(processes) if rank not in found and p.exitcode is not None]
            if silent:
                exitcode = processes[silent[0]].exitcode
                raise AssertionError(f"rank {silent[0]} exited ({exitcode}) with no result") from None
            if time.monotonic() > deadline:
                raise AssertionError(f"ranks {sorted(set(range(len(processes))) - set(found))} sent nothing "
                                     f"in {timeout_s} s") from None
            continue
        if not is_ok:
            raise AssertionError(f"rank {rank} failed:\n{value}")
        found[rank] = pickle.loads(value)
    return found


def greedy_logits(model, dims, prompt: list[int], num_decode: int, page_size: int = 4,
                  device: torch.device = CPU, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Prefill `prompt`, then `num_decode` greedy decode steps, straight on the model (its KV cache
    and recurrent states sized by `dims`, a rank's local dims under TP, in `dtype` on `device`): the
    last-token logits of every step, `[1 + num_decode, vocab]`, fp32 on the host."""
    pool = PagePool(64, page_size)
    cache = KvCache(pool, dims.num_full_layers, dims.num_kv_heads, dims.head_dim, dtype=dtype, device=device)
    conv_dim = 2 * dims.num_linear_heads * dims.linear_key_dim + dims.num_linear_value_heads * dims.linear_value_dim
    states = LinearStates.zeros(dims.num_linear_layers, 2, conv_dim, dims.conv_kernel, dims.num_linear_value_heads,
                                dims.linear_key_dim, dims.linear_value_dim, device=device)
    key, fed, logits = ("r", "main"), list(prompt), []
    with torch.no_grad(), torch.device(device):  # the torch attention path makes its masks on the default device
        for _ in range(1 + num_decode):
            num_cached = pool.num_tokens(key)
            assert pool.reserve(key, len(fed))
            flat = cache.flat_positions(pool.page_table(key), num_cached + len(fed))
            batch = DecoderBatch(torch.arange(num_cached, num_cached + len(fed)), [(0, len(fed))],
                                 [Segment(0, len(fed), num_cached, flat)], [1]).to_device(device)
            hidden = model(model.embed_tokens(torch.tensor(fed, device=device)), batch, cache, states)
            pool.commit(key, len(fed))
            logits.append(model.logits(hidden[-1:])[0].float().cpu())
            fed = [int(logits[-1].argmax())]
    return torch.stack(logits)


PROMPTS = {"a": [3, 14, 15, 92, 65, 35, 89, 79], "b": [2, 71, 82], "c": [7, 250, 1, 41, 42, 13, 56]}
NUM_NEW = 5


def param_bytes(model) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


class ReadSpy:
    """Stands in for safetensors.safe_open (`ReadSpy.real`, the real one): records, per tensor, how
    many elements were read through slices and which tensors were read whole (`get_tensor`)."""

    real: Any = None
    read: dict[str, int] = {}
    whole: list[str] = []

    def __init__(self, *args, **kwargs):
        self._inner = ReadSpy.real(*args, **kwargs)

    def __enter__(self):
        self._handle = self._inner.__enter__()
        return self

    def __exit__(self, *exc):
        return self._inner.__exit__(*exc)

    def keys(self):
        return self._handle.keys()

    def get_tensor(self, key):
        ReadSpy.whole.append(key)
        return self._handle.get_tensor(key)

    def get_slice(self, key):
        return _SliceSpy(key, self._handle.get_slice(key))


class _SliceSpy:
    def __init__(self, key, inner):
        self.key, self.inner = key, inner

    def get_shape(self):
        return self.inner.get_shape()

    def __getitem__(self, index):
        part = self.inner[index]
        ReadSpy.read[self.key] = ReadSpy.read.get(self.key, 0) + part.numel()
        return part


def _fast_runner(plan, runner):
    """The fast path's runner over a rank's sharded model (fp32, torch attention: no FlashInfer)."""
    from mstar.runtime.engine.gpu.runner import GpuDecoderRunner
    from mstar.runtime.engine.kv.slots import SlotPool
    from mstar.runtime.engine.placement import CPU

    slots = SlotPool("LLM", runner.slots.num_slots) if runner.slots else None  # a hybrid's recurrent slots
    return GpuDecoderRunner(plan.nodes[0], runner.dims, runner.model, runner.pool.page_size, runner.pool.num_pages,
                            runner.max_seq_len, 0, CPU, None, is_flashinfer=False, slots=slots)


def engine_checks(rank: int, size: int, plans: dict, checkpoints: dict) -> dict:
    """On each rank: greedy tokens of every plan (random weights) and of every checkpoint, each
    model's parameter bytes, the logits of a model-level greedy run, and for checkpoints the
    loaded shard and what was read from the files."""
    import safetensors
    import torch.distributed as dist

    from engine_plans import generate
    from mstar.runtime.engine.torch_engine import TorchEngine
    from mstar.runtime.engine.tp.comm import TpComm

    comm = {"LLM": TpComm.of(dist.group.WORLD)}
    out: dict = {}
    for name, plan in plans.items():
        engine = TorchEngine(plan, tp_comms=comm)
        out[name] = generate(engine, PROMPTS, NUM_NEW, start_every=2)
        runner = engine.runners["LLM"]
        out[name + "/bytes"] = param_bytes(runner.model)
        out[name + "/logits"] = greedy_logits(runner.model, runner.dims, PROMPTS["a"], 3)
        engine.runners["LLM"] = _fast_runner(plan, runner)  # the GPU fast path's runner and flat forward
        out[name + "/fast"] = generate(engine, PROMPTS, NUM_NEW, start_every=2)
    for name, (plan, path) in checkpoints.items():
        ReadSpy.real, ReadSpy.read, ReadSpy.whole = safetensors.safe_open, {}, []
        safetensors.safe_open = ReadSpy
        try:
            engine = TorchEngine(plan, weights_dir=str(path), tp_comms=comm)
        finally:
            safetensors.safe_open = ReadSpy.real
        out[name] = generate(engine, PROMPTS, NUM_NEW, start_every=2)
        out[name + "/state"] = {k: v.clone() for k, v in engine.runners["LLM"].model.state_dict().items()}
        out[name + "/read"], out[name + "/whole"] = dict(ReadSpy.read), list(ReadSpy.whole)
    return out


def gpu_checks(rank: int, size: int, plan_path: str, prompts: dict) -> dict:
    """On GPU `rank` (NCCL): the plan's LLM at spec dims as this rank's shard on the device fast path
    (bf16, its decode graphs captured), its greedy tokens and prefill/decode logits; rank 0 then
    builds the whole model on its GPU and gives the same figures for it."""
    import torch.distributed as dist

    from engine_plans import generate
    from mstar.plan.io import load_plan
    from mstar.runtime.engine.torch_engine import TorchEngine
    from mstar.runtime.engine.tp.comm import TpComm

    plan = load_plan(plan_path)

    def run(tp_comms: dict) -> dict:
        engine = TorchEngine(plan, dims="spec", device=f"cuda:{rank}", tp_comms=tp_comms)
        runner = engine.runners["LLM"]
        found = {"tokens": generate(engine, prompts, 8), "attention": runner.attention_backend(),
                 "param_bytes": param_bytes(runner.model)}
        found["logits"] = greedy_logits(runner.model, runner.dims, next(iter(prompts.values())), 2,
                                        page_size=16, device=torch.device(f"cuda:{rank}"), dtype=torch.bfloat16)
        return found

    out = run({"LLM": TpComm.of(dist.group.WORLD)})
    dist.barrier()
    if rank == 0:
        out["one_gpu"] = run({})
    return out
