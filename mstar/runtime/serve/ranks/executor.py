"""One rank's engine behind the commands the controller (rank 0) sends it.

In: the rank's `TorchEngine` (built for the nodes its worker runs), a `Channel` and the plan's keys.
Out: `RankExecutor`, called directly on rank 0 and from the worker loop (worker.py) elsewhere:

    add_request(id, request) -> reason or None     end_request(id)     end_node(id, node)
    run_step(step) -> (StepResult, ids whose KV was imported since the last step)
    kv_send(id, node, dst)     export the request's KV on `node` and send it to rank `dst`
    kv_recv(id, node, src)     receive it from `src` and import it (a failed import holds the row:
                               it is reported in `allocation_failed` of the next step; an export
                               error fails the row with that error)
    kv_drop(id, node)          the receiver has it: free this rank's copy

Rows left out of a step (held or failed) may remove a walk from it: the step then takes the
mixture of the walks left and runs eagerly, as the run loop does for stale rows (steps.recompose).
"""
from __future__ import annotations

import dataclasses
import os
from typing import Any, Optional

import torch

from mstar.plan.schema import KeyPlan, Plan
from mstar.runtime.engine.kv.transfer import TransferError, drop_kv, export_kv, import_kv
from mstar.runtime.engine.runners.decoder import DecoderRunner
from mstar.runtime.engine.torch_engine import TorchEngine
from mstar.runtime.serve.ranks.channel import Channel
from mstar.runtime.serve.steps import recompose
from mstar.runtime.step import RowResult, Step, StepResult

KV_TIMEOUT_S = 60.0  # a KV payload announced by the controller arrives within this


class RankExecutor:
    def __init__(self, plan: Plan, engine: TorchEngine, channel: Channel, timeout_s: float = KV_TIMEOUT_S):
        self.engine = engine
        self.channel = channel
        self.timeout_s = timeout_s
        self.keys: dict[tuple[int, str], KeyPlan] = {(w.rank, key.name): key for w in plan.workers for key in w.keys}
        self.held: set[str] = set()  # requests whose KV import found no room: held in the next step
        self.failed: dict[str, str] = {}  # request -> why its KV could not move: fails in the next step
        self.imported: list[str] = []

    def memory(self) -> dict[str, int]:
        """Measured at start-up: the parameter bytes of this rank's models (a TP node: its shard),
        the process's resident memory, and on a GPU the bytes torch has allocated there."""
        models = [getattr(runner.model, "_module", runner.model) for runner in self.engine.runners.values()]
        weight_bytes = sum(p.numel() * p.element_size() for model in models for p in model.parameters())
        with open("/proc/self/statm", encoding="ascii") as statm:
            rss_bytes = int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
        device = self.engine.placement.device
        device_bytes = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
        return {"weight_bytes": weight_bytes, "rss_bytes": rss_bytes, "device_bytes": device_bytes}

    def add_request(self, request_id: str, request: Any) -> Optional[str]:
        return self.engine.add_request(request_id, request)

    def claim_prefix(self, request_id: str, node: str, tokens: list[int]) -> int:
        return self.engine.claim_prefix(request_id, node, tokens)

    def end_request(self, request_id: str) -> None:
        self.engine.end_request(request_id)
        self.held.discard(request_id)
        self.failed.pop(request_id, None)

    def end_node(self, request_id: str, node: str) -> None:
        self.engine.end_node(request_id, node)

    def run_step(self, step: Step) -> tuple[StepResult, list[str]]:
        left_out = self.held | set(self.failed)
        held = [row.request_id for row in step.rows if row.request_id in self.held]
        errors = [RowResult(row.request_id, error=self.failed[row.request_id])
                  for row in step.rows if row.request_id in self.failed]
        if left_out:
            kept = [row for row in step.rows if row.request_id not in left_out]
            step = dataclasses.replace(step, rows=kept)
            if kept:
                recompose(self.keys[(step.worker, step.key)], step, self.engine.requires_guidance)
        result = self.engine.run_step(step) if step.rows else StepResult(rows=[])
        result.rows.extend(errors)
        result.allocation_failed.extend(held)
        self.held.clear()
        self.failed.clear()
        imported, self.imported = self.imported, []
        return result, imported

    def _runner(self, node: str) -> DecoderRunner:
        runner = self.engine.runners.get(node)
        if not isinstance(runner, DecoderRunner):
            raise TransferError(f"node {node} has no KV cache on this rank")
        return runner

    def kv_send(self, request_id: str, node: str, dst: int) -> None:
        try:
            runner = self._runner(node)
            header, tensors = export_kv(runner, self.engine.requests[request_id])
        except TransferError as error:
            header, tensors = {"error": str(error)}, []
        else:
            if runner.offload is not None:  # it runs on the receiver from now on; kept here until kv_drop
                runner.offload.park(request_id)
        self.channel.send(dst, "kv", header, tensors, timeout_s=self.timeout_s)

    def kv_recv(self, request_id: str, node: str, src: int) -> None:
        message = self.channel.recv(src, timeout_s=self.timeout_s, what="sending KV pages")
        if "error" in message.body:
            self.failed[request_id] = f"error: moving its KV to another rank: {message.body['error']}"
            return
        try:
            reason = import_kv(self._runner(node), self.engine.requests[request_id], message.body, message.tensors)
        except TransferError as error:
            self.failed[request_id] = f"error: moving its KV to another rank: {error}"
            return
        if reason is None:
            self.imported.append(request_id)
        else:
            self.held.add(request_id)

    def kv_drop(self, request_id: str, node: str) -> None:
        drop_kv(self._runner(node), request_id)
