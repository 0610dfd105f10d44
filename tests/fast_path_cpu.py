"""The device fast path's runner (`engine/gpu/runner.py`) on the CPU, inside an engine the tests drive.

`fast_path_engine(plan, num_pages, ...)` builds the plan's `TorchEngine` and puts a
`GpuDecoderRunner` in place of one kv node's reference runner: fp32 on the CPU, the reference's
dims and page size, the weights `build_decoder` makes from seed 0 (the reference runner's), torch
attention (no FlashInfer), the plan's decode family unless told otherwise; the engine's caps say
whether steps may be launched ahead, as the runner does. Returns (engine, runner).
`run_asks(plan, engine, asks, prompt_len, max_tokens)` runs one request a settings dict through the
run loop and returns the conductor's records by id (r0, r1, ...).
"""
from __future__ import annotations

from typing import Any, Optional

import torch

from mstar.runtime.conductor.request import Request
from mstar.runtime.engine.gpu.runner import GpuDecoderRunner, decode_family
from mstar.runtime.engine.gpu.device_model import build_decoder
from mstar.runtime.engine.placement import CPU
from mstar.runtime.engine.torch_engine import TorchEngine
from mstar.runtime.serve.driver import Driver, Workload


def fast_path_engine(plan, num_pages: int, *, node: Optional[str] = None, max_seq_len: Optional[int] = None,
                     with_decode_family: bool = True, can_run_ahead: bool = False, **runner_options: Any
                     ) -> tuple[TorchEngine, GpuDecoderRunner]:
    """node: the kv node (the plan's first node when None); max_seq_len: the runner's (the
    reference's when None); with_decode_family: the decode graphs' CPU stand-ins (the plan's decode
    family) or none; runner_options: `GpuDecoderRunner`'s keywords (prefix_cache, slots, glue,
    packed, host_pages)."""
    engine = TorchEngine(plan, num_pages=num_pages)
    name = node or plan.nodes[0].name
    reference = engine.runners[name]
    model = build_decoder(reference.dims, torch.device("cpu"), torch.float32, position=0, seed=0)
    family = decode_family(plan, name) if with_decode_family else None
    node_plan = next(n for n in plan.nodes if n.name == name)
    runner = GpuDecoderRunner(node_plan, reference.dims, model, reference.pool.page_size, num_pages,
                              max_seq_len or reference.max_seq_len, 0, CPU, family, is_flashinfer=False,
                              can_run_ahead=can_run_ahead, **runner_options)
    engine.replace_runner(name, runner)  # its caps follow: can_launch_ahead, rerun_nodes (this runner rewinds nothing)
    return engine, runner


def run_asks(plan, engine, asks: list[dict], prompt_len: int, max_tokens: int) -> dict:
    """Request r{i} with the settings asks[i] and a prompt of `prompt_len` ids of its own, all
    through the run loop on `engine`; the conductor's records by request id."""
    requests = [Request(id=f"r{i}", prompt_tokens=[(5 * i + 3 * j) % 60 + 1 for j in range(prompt_len)],
                        max_tokens=max_tokens, **ask) for i, ask in enumerate(asks)]
    driver = Driver(plan, engine)
    driver.run(Workload(requests))
    return driver.conductor.records
