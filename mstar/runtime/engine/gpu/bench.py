"""`mstar bench engine`: the GPU engine's step times against the floor and HF transformers.

For a plan's first kv node at its spec dims with random bf16 weights, in one run on one GPU:
decode steps of 1, 8 and 64 rows at context 1024, a mixed step (63 decode rows beside one
512-token prompt), a 16 x 1024-token prefill, and a chunked prefill's step (40 decode rows beside
a 216-token chunk after 0, 4096 and 7936 tokens of its prompt, with its kernels' device time and
the attention kernels' share), and a cached request's first step (16 tokens after a 1024-token
cached prefix: what the prefix scenario's TTFT waits for); beside each, its floor: the larger of (bytes the step
must read, at the device-to-device copy bandwidth measured in this run) and (its FLOPs, at the bf16
matmul rate measured in this run; a hybrid decoder's bytes include each row's recurrent state, read
and written back); HF transformers' LlamaForCausalLM on the same shapes (eager
with a DynamicCache; with `--hf-compiled` also a static cache under torch.compile
mode="reduce-overhead"); and the decode family's capture memory, measured against the plan's
estimate. A step's time is the engine's whole step (pack, plan, replay or run, sample, copy back),
wall time per step, median of `--iters`. Steps are packed by the plan's generated glue (the GPU
runner's path: `glue_packing.py`); each step is also timed with the numpy packing
(`packing.pack`) on a second executor over the same model and KV pages (`numpy_pack_ms`, and
`glue_over_numpy`, the ratio), unless `--no-numpy`.

Usage: mstar bench engine [--plan P] [--node N] [--json] [--iters N] [--hf-compiled] [--no-numpy] [--host-pack]
                          [--no-rule-graphs] [--decode-graphs-only] (and the what-ifs `--help` lists)
Needs a CUDA GPU with FlashInfer; elsewhere it says so and exits 1.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from typing import Any, Callable, Optional, Sequence

import torch

from mstar.arg_types import ITERS, int_range, path_arg, shown_path
from mstar.plan.dims import DecoderDims, decoder_dims
from mstar.runtime.engine.glue_reference import KeyGlue
from mstar.runtime.engine.gpu import decode_attention, graph_what_ifs, launch_probe
from mstar.runtime.engine.gpu.attention import DECODE_KERNELS
from mstar.runtime.engine.gpu.executor import StepExecutor

CONTEXT = 1024
DECODE_ROWS = (1, 8, 64)
# A chunked prefill's step (`mstar bench kv` at budget 256): 40 decode rows beside a 216-token
# chunk of a long prompt, at the start, the middle and the end of an 8192-token prompt.
CHUNK_DECODE_ROWS, CHUNK_TOKENS, CHUNK_CONTEXTS = 40, 216, (0, 4096, 7936)
# A cached request's first step (`mstar bench kv --scenario prefix`): its own 16 tokens after a
# 1024-token prefix the cache served, the step its TTFT waits for.
PREFIX_TAIL = (16, 1024)


def _median_ms(fn: Callable[[], object], iters: int, warmup: int = 3) -> float:
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def _copy_ms() -> float:
    """Median ms of one 1 GiB device-to-device copy; both buffers are freed on return."""
    src = torch.randn(1 << 28, device="cuda")  # 1 GiB
    dst = torch.empty_like(src)
    return _median_ms(lambda: dst.copy_(src), 20)


def _shapes(dims, model) -> "Shapes":
    """The step shapes of the bench's model: its weights' bytes (the embedding aside: a step reads
    its rows alone) and its products' parameters, the LM head apart (each row's last token only)."""
    params = {name: p for name, p in model.named_parameters() if not name.startswith("flow.")}
    weight_bytes = sum(p.numel() * p.element_size() for name, p in params.items() if "embed_tokens" not in name)
    matmul_params = sum(p.numel() for name, p in params.items()
                        if p.dim() == 2 and "embed_tokens" not in name and name != "lm_head.weight")
    return Shapes(dims, weight_bytes, matmul_params, model.lm_head.weight.numel())


def copy_bandwidth() -> float:
    """The device-to-device copy bandwidth in bytes/s (read + write counted), measured now."""
    return 2 * (1 << 30) / (_copy_ms() / 1e3)


def ceilings() -> tuple[float, float]:
    """(copy bandwidth in bytes/s counting read + write, bf16 matmul FLOP/s), measured now."""
    bandwidth = copy_bandwidth()
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    matmul_ms = _median_ms(lambda: a @ b, 20)
    return bandwidth, 2 * 8192 ** 3 / (matmul_ms / 1e3)


class Shapes:
    """Bytes and FLOPs of a step of `rows` (new tokens, cached tokens) for these dims: every token
    passes through the layers' matrices (`matmul_params`), and each row's last token alone through
    the LM head (`head_params`: the forward gathers those rows before it)."""

    def __init__(self, dims, weight_bytes: int, matmul_params: int, head_params: int = 0):
        self.dims, self.weight_bytes, self.matmul_params = dims, weight_bytes, matmul_params
        self.head_params = head_params

    def model_flops(self, rows: list[tuple[int, int]]) -> float:
        """The matrix products' FLOPs: every new token through the layers, one a row through the head."""
        return 2 * sum(new for new, _ in rows) * self.matmul_params + 2 * len(rows) * self.head_params

    def state_bytes(self) -> int:
        """A row's recurrent state over every gated delta-net layer (fp32 conv window and state)."""
        d = self.dims
        conv_dim = 2 * d.num_linear_heads * d.linear_key_dim + d.num_linear_value_heads * d.linear_value_dim
        per_layer = conv_dim * (d.conv_kernel - 1) + d.num_linear_value_heads * d.linear_key_dim * d.linear_value_dim
        return d.num_linear_layers * per_layer * 4

    def floor_ms(self, rows: list[tuple[int, int]], bandwidth: float, rate: float) -> float:
        d = self.dims
        per_token_kv = d.num_full_layers * 2 * d.num_kv_heads * d.head_dim * 2
        kv_bytes = sum((new + cached) * per_token_kv for new, cached in rows)
        # Each row's recurrent state is read and written back once (the bandwidth counts both).
        state_bytes = 2 * len(rows) * self.state_bytes()
        attention = sum(4 * d.num_full_layers * d.num_qo_heads * d.head_dim * new * (cached + (new + 1) / 2)
                        for new, cached in rows)
        # The gated delta rule per token and value head: decay, k^T S, the rank-1 update, q^T S.
        state_size = d.num_linear_value_heads * d.linear_key_dim * d.linear_value_dim
        recurrence = 8 * sum(new for new, _ in rows) * d.num_linear_layers * state_size
        flops = self.model_flops(rows) + attention + recurrence
        return max((self.weight_bytes + kv_bytes + state_bytes) / bandwidth, flops / rate) * 1e3


def _rows(executor, rows: list[tuple[int, int]], page_size: int):
    """RowSpecs over distinct pages: prompts feed token ids, decode rows loop back on the device
    (walk indices from the executor's glue key, `BenchExecutor.glue`: a walk that loops back on the
    device for those, one that does not for prompts)."""
    from mstar.runtime.engine.gpu.packing import RowSpec

    glue = executor.glue if isinstance(executor, BenchExecutor) else None
    loop_walk = prompt_walk = 0
    if glue is not None:
        mask, num_walks = glue.constants.device_loop_mask, len(glue.constants.walks)
        loop_walk = next((w for w in range(num_walks) if mask >> w & 1), 0)
        prompt_walk = next((w for w in range(num_walks) if not mask >> w & 1), 0)
    specs, next_page = [], 0
    for index, (new, cached) in enumerate(rows):
        num_pages = -(-(new + cached) // page_size)
        table = list(range(next_page, next_page + num_pages))
        next_page += num_pages
        tokens = None if new == 1 and cached else [(7 * index + t) % 1000 for t in range(new)]
        # Row slots from 1: a hybrid decoder's row slot is its state slot, and slot 0 is the sink.
        specs.append(RowSpec(tokens, cached, table, index + 1, is_decode=tokens is None,
                             walk_index=loop_walk if tokens is None else prompt_walk))
    return specs


def _capture_decode_only(*executors) -> None:
    """`--decode-graphs-only`: the executors capture their decode family alone (their packed steps run
    eagerly); None stands for an executor not built."""
    for executor in executors:
        if executor is not None:
            executor.packed, executor.whole = None, {}


def _rule_graphs_report(rule) -> dict:
    """The prompt rule graphs' captures and replays over the run, the calls that ran fla as it is, and
    why they were off if they were."""
    report = {"captured": rule.num_captured, "replayed": rule.num_replayed, "as_is": rule.num_as_is}
    if rule.why_off is not None:
        report["off"] = rule.why_off
    return report


def _events_ms(replay: Callable[[], object], iters: int) -> float:
    """Device ms a call of `replay` (a graph's replay), between two CUDA events around `iters` calls."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / iters


def _replay_ms(executor, batch: int, iters: int) -> float:
    executor.graphs.replay(batch)
    return _events_ms(lambda: executor.graphs.replay(batch), iters)


def _profile(executor, batch: int) -> list[dict]:
    """Device time per kernel name over 10 replays of the decode graph of `batch` rows, every kernel,
    longest first (the text report prints the first 12)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(10):
            executor.graphs.replay(batch)
        torch.cuda.synchronize()
    events = sorted(prof.key_averages(), key=lambda e: -e.device_time_total)
    return [{"kernel": e.key[:90], "us_per_replay": round(e.device_time_total / 10, 1),
             "calls_per_replay": e.count // 10}
            for e in events]


def _launcher(executor, rows, page_size: int, bucket: tuple = (None, 0, "packed")) -> Callable[[], Any]:
    """Launch one engine step of `rows` (returns its pending step); bucket: (capture family, token
    bucket, attention route) the plan gives the step."""
    specs = _rows(executor, rows, page_size)
    family, tokens, route = bucket
    glue = executor.glue if isinstance(executor, BenchExecutor) else None
    return lambda: executor.launch(specs, None, family, tokens, route, glue)


def _engine_step(executor, rows, page_size: int, bucket: tuple = (None, 0, "packed")) -> Callable[[], object]:
    """One whole engine step of `rows` (launch and collect), on the plan's `bucket` (`_launcher`)."""
    launch = _launcher(executor, rows, page_size, bucket)
    return lambda: executor.collect(launch())


def _chain_ms(executor, rows, page_size: int, iters: int, num_steps: int = 16) -> float:
    """Wall ms a step of a decode chain run ahead, as the runner's launch-ahead runs one (docs/engine.md,
    "Running ahead"): step N+1 is launched before step N is collected, its decode rows reading N's
    tokens on the device, so the host's packing, planning and launches overlap the device's step.
    Median over `iters` chains of `num_steps` steps of (chain wall time / num_steps)."""
    launch = _launcher(executor, rows, page_size)

    def chain() -> None:
        pending = launch()
        for _ in range(num_steps - 1):
            launched = launch()
            executor.collect(pending)
            pending = launched
        executor.collect(pending)

    return _median_ms(chain, max(3, iters // 4)) / num_steps


def _engine_step_ms(executor, rows, page_size: int, iters: int, bucket: tuple = (None, 0, "packed")) -> float:
    return _median_ms(_engine_step(executor, rows, page_size, bucket), iters)


def packed_bucket(plan, node, rows: list[tuple[int, int]], is_mixed: bool) -> tuple:
    """(capture family, token bucket, attention route) the plan gives a step of these rows: a
    mixture of several walks when `is_mixed`, else of one walk, whose families (`capture`,
    `also_captures`) hold the step in a packed family's token bucket, picked as the scheduler picks
    (`plan.buckets.pick_smallest`). (None, 0, "packed") when no such family holds it (eager)."""
    from mstar.plan.buckets import pick_smallest

    num_tokens = [new for new, _ in rows]
    for worker in plan.workers:
        for key in worker.keys:
            families = {f.name: f for f in key.captures} if key.node == node.name else {}
            for entry in key.mixtures:
                names = ([entry.capture] if entry.capture else []) + list(entry.also_captures)
                if not families or (bin(entry.mask).count("1") > 1) != is_mixed or not names:
                    continue
                pick = pick_smallest(tuple(families[name] for name in names), len(rows), num_tokens)
                if pick.token_bucket:  # a packed family's bucket (a batched one has none)
                    return pick.capture, pick.token_bucket, entry.attention
    return None, 0, "packed"


class BenchExecutor(StepExecutor):
    """A `StepExecutor` that carries the one key's glue the bench packs every step with."""

    glue: Optional[KeyGlue] = None


def bench_glue(glue_module, node):
    """The node's first key's generated glue on worker 0 holding a walk that loops back on the device
    (the bench's decode rows), else its first key's; None without any."""
    from mstar.runtime.engine.gpu.runner import node_glue

    keys = list(dict.fromkeys(node_glue(glue_module.GLUE_BY_WORKER, node.name).get(0, {}).values()))
    return next((k for k in keys if k.constants.device_loop_mask), keys[0] if keys else None)


def build(plan, node, decode_kernel="auto", glue=None, shared=None) -> tuple:
    """glue: a KeyGlue to pack with (the executor's `bench_glue`), None for the numpy packing.
    shared: (dims, model, kv) of an executor built before: a second executor over the same model
    and pages (the numpy variant)."""
    from mstar.runtime.engine.gpu.device_model import build_decoder
    from mstar.runtime.engine.gpu.forward import DecoderForward, PagedKv
    from mstar.runtime.engine.gpu.runner import decode_family, packed_families
    from mstar.runtime.engine.gpu.setup import keeps_hidden
    from mstar.runtime.engine.models.kinds import call_table

    device = torch.device("cuda")
    page_size = glue.constants.page_size if glue is not None else 16
    num_pages = 64 * (CONTEXT // page_size + 1) + 1024 + 64
    if shared is not None:
        dims, model, kv = shared
    else:
        dims = decoder_dims(node, "spec")
        model = build_decoder(dims, device, torch.bfloat16, position=plan.nodes.index(node), seed=0,
                              is_fast_random=True)
        kv = PagedKv(dims.num_full_layers, num_pages, page_size, dims.num_kv_heads, dims.head_dim, torch.bfloat16,
                     device)
        kv.data.normal_()
    family = decode_family(plan, node.name)
    states = None
    if dims.has_linear_layers:  # a slot for each of the bench's rows (64) beside the sink
        from mstar.runtime.engine.models.gdn import LinearStates

        num_slots = max(node.recurrent.num_slots if node.recurrent else 0, max(DECODE_ROWS) + 1)
        # two copies of each slot, as the runner that runs ahead keeps them (`mstar run`'s default):
        # a step reads one and writes the other
        states = LinearStates.for_dims(dims, num_slots, device, versions=2)
    # (the pieces keep every position's hidden state where the engine's would: `keeps_hidden`)
    packed = packed_families(plan, node.name, keeps_hidden=keeps_hidden(plan, node, call_table(plan)))
    # The bench's rows reach 8192 tokens; a graph's first plan holds one row of its largest token
    # bucket (qwen3_omni's vision prefill: 16384), whose pages the row's page table must hold.
    max_positions = max([8192] + [t for f in (packed.whole if packed else ()) for t in f.token_buckets])
    if glue is not None and dims.has_linear_layers:
        glue = None  # a hybrid decoder keeps the numpy packing (its linear layers read that layout)
    executor = BenchExecutor(DecoderForward(model, dims, kv, max_positions + 1, states), kv, device, num_pages + 1,
                             family.batch_pad if family else None, is_flashinfer=True, decode_kernel=decode_kernel,
                             packed=packed,
                             glue_pages_per_seq=max_positions // page_size if glue is not None else None,
                             unroll_prompts=family.unroll_prompts if family else 0)
    executor.glue = glue
    return dims, model, kv, family, executor


def run_engine(plan, node, iters: int, profile_rows: int = 0, decode_kernel="auto", glue_module=None,
               is_numpy_too: bool = True, is_capture_only: bool = False,
               is_packed_captured: bool = True) -> tuple[dict, DecoderDims]:
    """glue_module: the plan's generated glue (the steps are packed by it); None: numpy packing.
    is_numpy_too: also time each step with the numpy packing on a second executor.
    is_capture_only: capture the node's graphs and report their memory, time no step.
    is_packed_captured: false captures the decode family alone (`--decode-graphs-only`)."""
    glue = bench_glue(glue_module, node) if glue_module is not None else None
    dims, model, kv, family, executor = build(plan, node, decode_kernel, glue)
    if is_capture_only:
        return _capture_only(plan, node, family, executor), dims
    numpy_executor = None
    if executor.packer is not None and is_numpy_too:
        numpy_executor = build(plan, node, decode_kernel, None, (dims, model, kv))[4]
    if not is_packed_captured:
        _capture_decode_only(executor, numpy_executor)
    shapes = _shapes(dims, model)
    bandwidth, rate = ceilings()
    torch.cuda.synchronize()
    start = time.perf_counter()
    if family or executor.packed:
        executor.capture()
    capture_s = time.perf_counter() - start
    if numpy_executor is not None and (family or numpy_executor.packed):
        numpy_executor.capture()
    cases = {str(r): [(1, CONTEXT)] * r for r in DECODE_ROWS}
    out: dict[str, Any] = {"decode": {}, "device": torch.cuda.get_device_name(),
                           "copy_bandwidth_tb_s": round(bandwidth / 1e12, 3),
                           "matmul_tflop_s": round(rate / 1e12, 1), "capture_s": round(capture_s, 2),
                           "dims": {"layers": dims.num_layers, "hidden": dims.hidden, "vocab": dims.vocab,
                                    "linear_layers": dims.num_linear_layers},
                           "state_mb_per_row": round(shapes.state_bytes() / 2 ** 20, 2),
                           "packer": "glue" if executor.packer is not None else "numpy"}
    for name, rows in cases.items():
        ms = _engine_step_ms(executor, rows, kv.page_size, iters)
        out["decode"][name] = {"ms": round(ms, 3), "floor_ms": round(shapes.floor_ms(rows, bandwidth, rate), 3)}
        if numpy_executor is not None:
            _numpy_variant(out["decode"][name], numpy_executor, rows, kv.page_size, iters)
        batch = executor.bucket(_rows(executor, rows, kv.page_size))
        if batch:  # the device's share: the graph replay alone, timed with events
            out["decode"][name]["replay_ms"] = round(_replay_ms(executor, batch, iters), 3)
        out["decode"][name]["chain_ms"] = round(_chain_ms(executor, rows, kv.page_size, iters), 3)
    out["decode_graph_steps"] = executor.num_graph_steps
    out["folded_norms"] = executor.forward.folds_norms  # `--fold-norms`, where the decoder allows it
    out["decode_merge_in_kernel"] = decode_attention.merges_in_kernel()  # `--decode-merge-in-kernel`
    out["extra_launches_a_layer"] = launch_probe.extra_launches()  # `--extra-launches`
    _packed_steps(out, plan, node, executor, kv.page_size, iters, shapes, bandwidth, rate, numpy_executor)
    _chunk_steps(out, plan, node, executor, kv.page_size, iters, shapes, bandwidth, rate)
    _prefix_tail_step(out, plan, node, executor, kv.page_size, iters, shapes, bandwidth, rate)
    if profile_rows and executor.bucket(_rows(executor, [(1, CONTEXT)] * profile_rows, kv.page_size)):
        out["profile"] = _profile(executor, executor.bucket(_rows(executor, [(1, CONTEXT)] * profile_rows,
                                                                   kv.page_size)))
    out["capture"] = _capture_report(plan, node, family, executor)
    if executor.forward.gdn is not None:  # the prompt rule's graphs over the run's eager and piecewise steps
        out["rule_graphs"] = _rule_graphs_report(executor.forward.gdn.rule_graphs)
    del executor, numpy_executor, model, kv
    torch.cuda.empty_cache()
    return out, dims


def _capture_only(plan, node, family, executor) -> dict:
    """Every graph the executor captures for the node, its capture time and memory beside the plan's
    estimates (`--capture-only`: the capture table of docs/engine.md, one node at a time)."""
    torch.cuda.synchronize()
    start = time.perf_counter()
    if family or executor.packed:
        executor.capture()
    out = {"device": torch.cuda.get_device_name(), "node": node.name,
           "capture_s": round(time.perf_counter() - start, 2),
           "capture": _capture_report(plan, node, family, executor)}
    del executor
    torch.cuda.empty_cache()
    return out


def _numpy_variant(case: dict, numpy_executor, rows, page_size: int, iters: int, bucket: tuple = (None, 0, "packed")
                   ) -> None:
    """The same step packed by `packing.pack` (numpy), and the glue's time over it."""
    numpy_ms = _engine_step_ms(numpy_executor, rows, page_size, iters, bucket)
    case["numpy_pack_ms"] = round(numpy_ms, 3)
    case["glue_over_numpy"] = round(case["ms"] / numpy_ms, 3)


def _packed_steps(out: dict, plan, node, executor, page_size: int, iters: int, shapes: Shapes, bandwidth: float,
                  rate: float, numpy_executor=None) -> None:
    """The mixed and prefill steps, on the plan's bucket (piecewise or whole graphs where the plan
    captures them) and, where they replayed graphs, the same step eagerly in the same run."""
    for key, rows, is_mixed in (("mixed_63_1", [(1, CONTEXT)] * 63 + [(512, 0)], True),
                                ("prefill_1x512", [(512, 0)], False),
                                ("prefill_16x1024", [(1024, 0)] * 16, False)):
        bucket = packed_bucket(plan, node, rows, is_mixed)
        before = executor.num_piecewise_steps, executor.num_whole_packed_steps
        ms = _engine_step_ms(executor, rows, page_size, max(iters // 4, 3), bucket)
        flops = shapes.model_flops(rows)
        graphs = ("piecewise" if executor.num_piecewise_steps > before[0]
                  else "whole" if executor.num_whole_packed_steps > before[1] else "eager")
        out[key] = {"ms": round(ms, 3), "floor_ms": round(shapes.floor_ms(rows, bandwidth, rate), 3),
                    "model_tflop_s": round(flops / (ms / 1e3) / 1e12, 1), "graphs": graphs}
        if numpy_executor is not None:
            _numpy_variant(out[key], numpy_executor, rows, page_size, max(iters // 4, 3), bucket)
        if bucket[0] is not None and graphs != "eager":
            out[key]["token_bucket"], out[key]["attention"] = bucket[1], bucket[2]
            # the same step eager, for the ratio
            captured = executor.piecewise, executor.packed_graphs
            executor.piecewise = executor.packed_graphs = None
            out[key]["eager_ms"] = round(_engine_step_ms(executor, rows, page_size, max(iters // 4, 3),
                                                         (None, 0, bucket[2])), 3)
            executor.piecewise, executor.packed_graphs = captured
            if bucket[2] == "split":  # and on the packed route (one prefill call), for that ratio
                out[key]["packed_route_ms"] = round(_engine_step_ms(executor, rows, page_size, max(iters // 4, 3),
                                                                    bucket[:2] + ("packed",)), 3)


def is_attention_kernel(name: str) -> bool:
    """Whether a profiled kernel is attention: FlashInfer's prefill, decode and merge-states
    kernels, and the Triton ones that run by default (`_decode_split_kernel`, `_prefill_kernel`
    and their splits' `_merge_kernel`, which the words "prefill" and "decode" missed), not the
    gated delta-net's recurrence (`_decode_step_kernel`, which "decode" counted)."""
    lowered = name.lower()
    return lowered != "_decode_step_kernel" and any(word in lowered for word in ("prefill", "decode", "merge"))


def _kernel_ms(step: Callable[[], object], num_steps: int = 5) -> tuple[float, float]:
    """(all kernels, attention kernels) in device ms per step, summed over each step's kernels
    under the torch profiler (so not wall time: gaps between kernels are not in it). Attention
    kernels are told by their names (`is_attention_kernel`)."""
    from torch.profiler import ProfilerActivity, profile

    step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(num_steps):
            step()
        torch.cuda.synchronize()
    events = prof.key_averages()
    total = sum(e.self_device_time_total for e in events)
    attention = sum(e.self_device_time_total for e in events if is_attention_kernel(e.key))
    return total / num_steps / 1e3, attention / num_steps / 1e3


def _chunk_steps(out: dict, plan, node, executor, page_size: int, iters: int, shapes: Shapes, bandwidth: float,
                 rate: float) -> None:
    """The steps of a chunked prefill beside decode rows (CHUNK_*), on the plan's bucket: wall time
    as for the other steps, and where the device time goes (`_kernel_ms`), by the chunk's context."""
    out["chunk"] = {}
    for context in CHUNK_CONTEXTS:
        rows = [(1, CONTEXT)] * CHUNK_DECODE_ROWS + [(CHUNK_TOKENS, context)]
        out["chunk"][str(context)] = _step_with_kernels(plan, node, executor, rows, True, page_size, iters, shapes,
                                                        bandwidth, rate)


def _step_with_kernels(plan, node, executor, rows, is_mixed: bool, page_size: int, iters: int, shapes: Shapes,
                       bandwidth: float, rate: float) -> dict:
    """A step of `rows` on the bucket the plan gives it (`packed_bucket`): wall time, floor, its
    kernels' device time and the attention kernels' share (`_kernel_ms`), bucket and route."""
    bucket = packed_bucket(plan, node, rows, is_mixed)
    step = _engine_step(executor, rows, page_size, bucket)
    ms = _median_ms(step, max(iters // 4, 3))
    kernels, attention = _kernel_ms(step)
    figures = {"ms": round(ms, 3), "floor_ms": round(shapes.floor_ms(rows, bandwidth, rate), 3),
               "kernels_ms": round(kernels, 3), "attention_kernels_ms": round(attention, 3),
               "token_bucket": bucket[1], "attention": bucket[2]}
    replay = _whole_replay_ms(executor, rows, page_size, bucket, max(iters // 4, 3))
    if replay is not None:
        figures["replay_ms"] = round(replay, 3)
    return figures


def _whole_replay_ms(executor, rows, page_size: int, bucket: tuple, iters: int) -> Optional[float]:
    """The device's share of a step the plan gives a whole packed graph: the graph's replay alone,
    timed with CUDA events after one engine step staged and planned it (the key the executor picks:
    its `_split` of the rows, its `whole_key`). None when the step runs on another path."""
    graphs = executor.packed_graphs
    if graphs is None:
        return None
    family, tokens, route = bucket
    specs = _rows(executor, rows, page_size)
    key = executor.whole_key(specs, family, tokens, executor._split(specs, route)[1])
    if key is None:
        return None
    executor.collect(_launcher(executor, rows, page_size, bucket)())
    return _events_ms(lambda: graphs.replay(key), iters)


def _prefix_tail_step(out: dict, plan, node, executor, page_size: int, iters: int, shapes: Shapes, bandwidth: float,
                      rate: float) -> None:
    """A cached request's first step (PREFIX_TAIL) as the plan runs it: wall time, floor, kernels,
    so the prefix scenario's TTFT splits into this step and the run loop around it. Where the plan
    unrolls it into the decode graph (`unroll_prompts`), `unrolled` is true and `not_unrolled` is the
    same step on the prefill family's bucket (piecewise graphs), for the ratio."""
    before = executor.num_unrolled_steps
    case = out["prefix_tail"] = _step_with_kernels(plan, node, executor, [PREFIX_TAIL], False, page_size, iters,
                                                   shapes, bandwidth, rate)
    case["unrolled"] = executor.num_unrolled_steps > before
    if case["unrolled"]:
        unroll, executor.unroll_prompts = executor.unroll_prompts, 0
        case["not_unrolled"] = _step_with_kernels(plan, node, executor, [PREFIX_TAIL], False, page_size, iters,
                                                  shapes, bandwidth, rate)
        executor.unroll_prompts = unroll


def _capture_report(plan, node, family, executor) -> dict:
    """Measured capture memory beside the plan's estimate: the decode family, the piecewise pool and
    the whole packed graphs' pool."""
    report = {}
    if family:
        report[family.name] = {"measured_mb": round(executor.capture_bytes["decode"] / 2 ** 20, 1),
                               "estimate_mb": round(family.memory_bytes / 2 ** 20, 1)}
    pools = [("piecewise", "packed", executor.packed.names if executor.piecewise is not None else ()),
             ("whole", "whole", executor.whole.keys() if executor.packed_graphs is not None else ())]
    for kind, measured, names in pools:
        estimates = {f.name: f.memory_bytes for w in plan.workers for k in w.keys if k.node == node.name
                     for f in k.captures if f.name in names}
        if not estimates:
            continue
        # The node's families of a kind share one pool (the union of their graphs), which holds
        # about one step of the largest: their estimates' largest is the one to compare.
        report[" + ".join(sorted(estimates)) + f" ({kind}, one pool)"] = {
            "measured_mb": round(executor.capture_bytes[measured] / 2 ** 20, 1),
            "estimate_mb": round(max(estimates.values()) / 2 ** 20, 1),
            "estimate_mb_by_family": {name: round(b / 2 ** 20, 1) for name, b in sorted(estimates.items())}}
    return report


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="mstar bench engine", description=__doc__.split("\n")[0])
    parser.add_argument("--plan", type=path_arg, default="generated/llama.plan")
    parser.add_argument("--node", help="the kv node to bench (default: the plan's first)")
    parser.add_argument("--json", action="store_true", help="print one JSON object and nothing else")
    parser.add_argument("--iters", type=ITERS, default=50)
    parser.add_argument("--hf-compiled", action="store_true",
                        help="also time HF with a static cache under torch.compile (minutes of compiling)")
    parser.add_argument("--no-hf", action="store_true", help="skip HF transformers")
    parser.add_argument("--profile", type=int_range(0, 4096), default=0, metavar="ROWS",
                        help="also list the top kernels of the decode graph of ROWS rows (torch profiler)")
    parser.add_argument("--no-numpy", action="store_true",
                        help="skip timing each step with the numpy packing (a second executor and capture)")
    parser.add_argument("--decode-kernel", choices=DECODE_KERNELS, default="auto",
                        help="the decode graphs' attention: auto (the Triton decode kernel where it serves the "
                             "heads, else as flashinfer), flashinfer (FlashInfer's tensor cores for grouped-query "
                             "ratios >= 4, its CUDA cores for graphs of at most 4 rows), or FlashInfer's tensor "
                             "or cuda kernel everywhere")
    parser.add_argument("--capture-only", action="store_true",
                        help="only capture the node's graphs and report their memory against the plan's estimate")
    parser.add_argument("--no-pdl", action="store_true",
                        help="launch the fused Triton kernels without programmatic dependent launch (a what-if)")
    parser.add_argument("--module-layout", action="store_true",
                        help="hold the matrix products' weights [out, in] as the modules do, not [in, out] "
                             "(a what-if; docs/engine.md, \"Weights stored for the product\")")
    parser.add_argument("--no-rule-graphs", action="store_true",
                        help="call fla's chunked rule in every gated delta-net layer of a hybrid's eager and "
                             "piecewise steps, not as a CUDA graph a step (a what-if; docs/engine.md)")
    parser.add_argument("--decode-graphs-only", action="store_true",
                        help="capture the decode family alone: the packed families' steps run eagerly (a "
                             "what-if for what their capture costs the decode graphs; docs/engine.md)")
    parser.add_argument("--skinny-products", action="store_true",
                        help="run the products of steps of at most 64 rows (the LM head's aside) on the split-K "
                             "Triton kernel, not cuBLAS (a what-if; docs/engine.md)")
    graph_what_ifs.add_arguments(parser)
    parser.add_argument("--extra-launches", type=int_range(0, 64), default=0, metavar="N",
                        help="launch N small kernels more after each layer (a probe: the step's time against a run "
                             "without, over N x layers, is what one small kernel costs in the graphs; docs/engine.md)")
    parser.add_argument("--host-pack", action="store_true",
                        help="only the host's share of packing each step, numpy against the glue (no GPU needed)")
    return parser


def _flag(parser: argparse.ArgumentParser, dest: str) -> str:
    """The option string of the parser's argument stored under `dest`."""
    return next(action.option_strings[0] for action in parser._actions if action.dest == dest)


def _set_what_ifs(args: argparse.Namespace):
    """The what-if switches, set before the engine is built; returns `blas_edges` (its count of
    edges made programmatic is read after the run)."""
    from mstar.runtime.engine.gpu import blas_edges, kernels, products, rule_graphs, skinny_products

    kernels.set_pdl(not args.no_pdl)
    products.set_transposed(not args.module_layout)
    rule_graphs.set_enabled(not args.no_rule_graphs)
    skinny_products.set_enabled(args.skinny_products)
    launch_probe.set_extra_launches(args.extra_launches)
    graph_what_ifs.apply(args)  # those `mstar bench kv` takes too
    return blas_edges


# What `--host-pack` reads; every other option times the device and is a usage error beside it.
HOST_PACK_OPTIONS = ("plan", "node", "json", "iters", "host_pack")


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if args.host_pack:
        given = [name for name, value in vars(args).items()
                 if name not in HOST_PACK_OPTIONS and value != parser.get_default(name)]
        if given:  # (each was ignored: the host-pack table, exit 0)
            flags = ", ".join(_flag(parser, name) for name in given)
            parser.error(f"--host-pack times the host's packing alone; {flags} time the device: give them without "
                         "--host-pack")
        return _host_pack(args)
    reason = _unavailable()
    if reason is not None:
        print(f"mstar bench engine: {reason}", file=sys.stderr)
        return 1
    from mstar.plan.io import PlanError, load_plan

    try:
        plan = load_plan(args.plan)
    except PlanError as error:
        print(f"mstar bench engine: {error}", file=sys.stderr)
        return 1
    node = kv_node(plan, args)
    if node is None:
        return 1
    if args.decode_kernel == "cuda" and _lacks_cuda_core_kernel(node):
        return 1
    blas_edges = _set_what_ifs(args)
    from mstar.runtime.engine.glue_loader import GlueLoadError, load_plan_glue

    try:
        glue_module = load_plan_glue(args.plan, plan)
    except GlueLoadError as error:
        print(f"mstar bench engine: {error}", file=sys.stderr)
        return 1
    result, dims = run_engine(plan, node, args.iters, args.profile, args.decode_kernel, glue_module, not args.no_numpy,
                              args.capture_only, not args.decode_graphs_only)
    result["programmatic_blas_edges"] = blas_edges.made_total  # 0 with --no-blas-pdl or without cuda-bindings
    off = blas_edges.why_off()
    if off is not None:
        result["blas_edges_off"] = off
    if args.capture_only:
        print(json.dumps(result, sort_keys=True) if args.json else "\n".join(_capture_lines(result)))
        return 0
    if not args.no_hf and dims.has_linear_layers:
        result["hf"] = "not measured: the HF baseline is LlamaForCausalLM, not a gated delta-net hybrid"
    elif not args.no_hf:
        from mstar.runtime.engine.gpu import bench_hf

        bench_hf.add_hf(result, dims, args.iters, args.hf_compiled)
    print(json.dumps(result, sort_keys=True) if args.json else _table(result))
    return 0


def kv_node(plan, args: argparse.Namespace, prog: str = "mstar bench engine") -> Any:
    """The kv node `--node` names (default: the plan's first), or None after saying why (as `prog`)."""
    kv_nodes = [n for n in plan.nodes if n.engine == "kv"]
    node = next((n for n in kv_nodes if n.name == args.node), None) if args.node else next(iter(kv_nodes), None)
    if node is None:
        wanted = f"no kv node {args.node!r} (its kv nodes: {', '.join(n.name for n in kv_nodes) or 'none'})" \
            if args.node else "no kv node"
        print(f"{prog}: {shown_path(args.plan)} has {wanted}", file=sys.stderr)
    return node


def _lacks_cuda_core_kernel(node) -> bool:
    """Whether `--decode-kernel cuda` cannot run the node's heads (after saying why)."""
    from mstar.plan.dims import decoder_dims
    from mstar.runtime.engine.gpu.attention import cuda_core_refusal

    dims = decoder_dims(node, "spec")
    refusal = cuda_core_refusal(dims.num_qo_heads, dims.num_kv_heads)
    if refusal:
        print(f"mstar bench engine: --decode-kernel cuda: {refusal}", file=sys.stderr)
    return refusal is not None


def _host_pack(args: argparse.Namespace) -> int:
    from mstar.plan.io import PlanError, load_plan
    from mstar.runtime.engine.glue_loader import GlueLoadError, load_plan_glue
    from mstar.runtime.engine.glue_reference import GlueLaunchError
    from mstar.runtime.engine.gpu import bench_pack

    try:
        plan = load_plan(args.plan)
        glue_module = load_plan_glue(args.plan, plan)
    except (PlanError, GlueLoadError) as error:
        print(f"mstar bench engine: {error}", file=sys.stderr)
        return 1
    node = kv_node(plan, args)
    if node is None:
        return 1
    glue = bench_glue(glue_module, node)
    if glue is None:
        print(f"mstar bench engine: {shown_path(args.plan)} has no kv node with generated glue", file=sys.stderr)
        return 1
    if decoder_dims(node, "spec").has_linear_layers:  # (the figures were of a path that never runs)
        print(f"mstar bench engine: --host-pack: node {node.name} is a hybrid decoder, whose steps the engine packs "
              "with numpy only (its linear layers read that layout: build's rule), so there is no glue packing "
              "to compare", file=sys.stderr)
        return 1
    try:
        result = bench_pack.host_pack(glue, args.iters)
    except GlueLaunchError as error:  # the bench's decode cases feed rows from the device token table
        print(f"mstar bench engine: {shown_path(args.plan)}: node {node.name}'s steps are not the decode and prompt "
              f"steps this bench packs ({error})", file=sys.stderr)
        return 1
    print(json.dumps(result, sort_keys=True) if args.json else bench_pack.table(result))
    return 0


NO_GPU = "needs a CUDA GPU (torch sees none here); nothing was measured"


def says_no_gpu(prog: str) -> bool:
    """Whether torch sees no CUDA GPU, after saying so on stderr as `prog` (the GPU benches' refusal)."""
    if torch.cuda.is_available():
        return False
    print(f"{prog}: {NO_GPU}", file=sys.stderr)
    return True


def _unavailable() -> Optional[str]:
    if not torch.cuda.is_available():
        return NO_GPU
    try:
        import flashinfer  # noqa: F401
    except ImportError as error:
        return f"needs FlashInfer ({error}); pip install -e '.[gpu]'"
    return None


def _cell(value: Optional[float], width: int, spec: str = ".3f") -> str:
    """A right-aligned table cell, blank for a figure not measured."""
    return " " * width if value is None else f"{value:>{width}{spec}}"


def _table(result: dict) -> str:
    lines = [f"{result['device']}: copy {result['copy_bandwidth_tb_s']} TB/s, bf16 matmul "
             f"{result['matmul_tflop_s']} TFLOP/s",
             f"packed by {result.get('packer', 'numpy')}"
             + ("; norms folded into the products (--fold-norms)" if result.get("folded_norms") else "")
             + ("; decode attention's splits merged in the kernel" if result.get("decode_merge_in_kernel") else "")
             + (f"; {result['extra_launches_a_layer']} probe kernels a layer (--extra-launches)"
                if result.get("extra_launches_a_layer") else ""),
             f"{'step':<18}{'ms':>10}{'floor ms':>10}{'x floor':>9}{'numpy ms':>10}{'ratio':>7}{'HF compiled':>13}"
             f"{'chained ms':>12}{'x floor':>9}"]
    cases = [(f"decode {k}", v) for k, v in result["decode"].items()]
    cases += [(k, result[k]) for k in ("mixed_63_1", "prefill_1x512", "prefill_16x1024")]
    for name, value in cases:
        hf, numpy_ms = value.get("hf_compiled_ms"), value.get("numpy_pack_ms")
        numpy_cells = f"{'':>17}" if numpy_ms is None else f"{numpy_ms:>10.3f}{value['glue_over_numpy']:>7.2f}"
        lines.append(f"{name:<18}{value['ms']:>10.3f}{value['floor_ms']:>10.3f}{value['ms'] / value['floor_ms']:>9.2f}"
                     f"{numpy_cells}{_cell(hf, 13)}{_cell(value.get('chain_ms'), 12)}"
                     f"{_cell(value['chain_ms'] / value['floor_ms'] if 'chain_ms' in value else None, 9, '.2f')}")
    for context, value in result.get("chunk", {}).items():
        replay = f"replay {value['replay_ms']:.3f} ms; " if "replay_ms" in value else ""
        lines.append(f"{CHUNK_DECODE_ROWS} decode rows + a {CHUNK_TOKENS}-token chunk after {context} tokens: "
                     f"{value['ms']:.3f} ms (floor {value['floor_ms']:.3f}; {replay}kernels {value['kernels_ms']:.3f} "
                     f"ms, attention {value['attention_kernels_ms']:.3f})")
    if "prefix_tail" in result:
        value = result["prefix_tail"]
        lines.append(f"a cached request's first step ({PREFIX_TAIL[0]} tokens after {PREFIX_TAIL[1]} cached): "
                     f"{value['ms']:.3f} ms (floor {value['floor_ms']:.3f}; kernels {value['kernels_ms']:.3f} ms)"
                     + (" unrolled into the decode graph" if value.get("unrolled") else ""))
        if "not_unrolled" in value:
            lines.append(f"  the same step not unrolled (bucket {value['not_unrolled']['token_bucket']}): "
                         f"{value['not_unrolled']['ms']:.3f} ms (kernels {value['not_unrolled']['kernels_ms']:.3f} ms)")
    if "hf_eager_decode_64_ms" in result:
        lines.append(f"HF eager decode 64 rows: {result['hf_eager_decode_64_ms']} ms")
    if "rule_graphs" in result:
        rule = result["rule_graphs"]
        lines.append(f"prompt rule graphs: {rule['captured']} captured, {rule['replayed']} replays"
                     + (f", {rule['as_is']} calls of fla as it is" if "as_is" in rule else "")
                     + (f" (off: {rule['off']})" if "off" in rule else ""))
    if "programmatic_blas_edges" in result:
        off = f" (off: {result['blas_edges_off']})" if "blas_edges_off" in result else ""
        lines.append(f"edges into cuBLAS's products made programmatic: {result['programmatic_blas_edges']}{off}")
    for kernel in result.get("profile", [])[:12]:
        lines.append(f"  {kernel['us_per_replay']:>9.1f} us  x{kernel['calls_per_replay']:<4} {kernel['kernel']}")
    return "\n".join(lines + _capture_lines(result))


def _capture_lines(result: dict) -> list[str]:
    lines = []
    for family, value in result.get("capture", {}).items():
        measured, estimate = value["measured_mb"], value["estimate_mb"]
        off = f" ({(estimate / measured - 1) * 100:+.1f}%)" if measured else ""
        lines.append(f"capture {family}: measured {measured} MiB, estimate {estimate} MiB{off}")
    return lines
