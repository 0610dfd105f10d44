"""The kv-node runner of the GPU fast path: a `DecoderRunner` whose step runs on the device.

In and out as `DecoderRunner` (rows of one step -> `RowResult`s and the rows that got no memory);
page admission, budgets and lengths are the parent's. What changes: the model is the bf16 one of
`device_model`, the KV cache is `PagedKv` (with its dummy page), and a step is packed, run
(graph replay for decode buckets, eager otherwise), sampled and copied back by `StepExecutor`.
A decode row whose token the engine kept (an on-device loop-back) is fed from the device token
table: its token never crosses to the device from the host.

`fast_path_reason(...)` says why a node cannot take this path (the engine then keeps the general
path); requests with a repetition penalty are refused here (it needs each request's history on the
device, not built yet).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch

from mstar.plan.schema import CaptureFamily, NodePlan, Plan
from mstar.runtime.engine.dims import DecoderDims
from mstar.runtime.engine.gpu.executor import SamplingRows, StepExecutor
from mstar.runtime.engine.gpu.forward import DecoderForward, PagedKv
from mstar.runtime.engine.gpu.packing import RowSpec
from mstar.runtime.engine.models.decoder import Decoder
from mstar.runtime.engine.models.kinds import CallInfo
from mstar.runtime.engine.placement import Placement
from mstar.runtime.engine.runners.decoder import DecoderRunner, _Prepared
from mstar.runtime.engine.runners.request_state import RequestState
from mstar.runtime.engine.runners.values import InputError, chunk_of, classify
from mstar.runtime.step import RowResult, StepRow


def fast_path_reason(node: NodePlan, calls: dict[tuple[str, str], CallInfo]) -> Optional[str]:
    """Why the node's calls need the general runner (the dims are checked by device_model)."""
    own = [call for (name, _), call in calls.items() if name == node.name]
    if len(node.inputs) != 1 or node.stream_inputs:
        return "the fast path feeds one token input"
    if node.bidirectional_walks or node.guidance:
        return "bidirectional walks and guidance sequences are not on the fast path"
    if node.cross_kv or any(set(a.writes).isdisjoint(node.kv_sequences) for a in node.kv_access):
        return "cross-attention pools and read-only KV walks are not on the fast path"
    for call in own:
        if call.is_image_flow:
            return "image-flow steps are not on the fast path"
        if any(call.output_roles.get(name, "tokens") not in ("tokens", "mask") for name in call.output_names):
            return "outputs other than sampled tokens are not on the fast path"
    return None


def decode_family(plan: Plan, node: str) -> Optional[CaptureFamily]:
    """The batched one-token capture family of the node's decode mixture, if the plan has one."""
    for worker in plan.workers:
        for key in worker.keys:
            if key.node != node:
                continue
            for entry in key.mixtures:
                family = next((f for f in key.captures if f.name == entry.capture), None)
                if entry.attention == "decode" and family and family.kind == "batched" and family.tokens_per_row == 1:
                    return family
    return None


def _no_embeds(num_tokens: int) -> torch.Tensor:
    """The fast path embeds on the device: the host item carries only its token count (`[T, 0]`)."""
    return torch.empty(num_tokens, 0)


@dataclass
class _Item(_Prepared):
    is_loop_back: bool = False


class GpuDecoderRunner(DecoderRunner):
    # The fast path lays the KV pages out its own way (`_new_cache`) and overrides every base
    # method that touches them; the base's single-KvCache typing cannot say so.
    cache: PagedKv  # type: ignore[assignment]

    def __init__(self, node: NodePlan, dims: DecoderDims, model: Decoder, page_size: int, num_pages: int,
                 max_seq_len: int, seed: int, placement: Placement, family: Optional[CaptureFamily],
                 is_flashinfer: bool, position: int = 0, prefix_cache: bool = False):
        super().__init__(node, dims, model, page_size, num_pages, max_seq_len, None, seed, position=position,
                         placement=placement, prefix_cache=prefix_cache)
        forward = DecoderForward(model, dims, self.cache, max_seq_len + 1)
        self.executor = StepExecutor(forward, self.cache, placement.device, num_pages + 1,
                                     family.batch_pad if family else None, is_flashinfer)
        self.family = family
        self.capture_bytes = self.executor.capture() if family and is_flashinfer else 0
        self._row_slots: dict[str, int] = {}
        self._free_slots = list(range(num_pages, -1, -1))

    def _new_cache(self, dims: DecoderDims, placement: Placement) -> PagedKv:  # type: ignore[override]
        return PagedKv(dims.num_full_layers, self.pool.num_pages, self.pool.page_size, dims.num_kv_heads,
                       dims.head_dim, placement.kv_dtype, placement.device)

    def attention_backend(self) -> str:
        return "flashinfer+graphs" if self.executor.graphs is not None else "device"

    def refusal(self, request: RequestState) -> Optional[str]:
        if request.params.repetition_penalty != 1.0:
            return f"node {self.node.name}: repetition_penalty is not supported on the GPU fast path yet"
        return super().refusal(request)

    def end_request(self, request_id: str) -> None:
        super().end_request(request_id)
        slot = self._row_slots.pop(request_id, None)
        if slot is not None:
            self._free_slots.append(slot)

    def _prepare(self, row: StepRow, call: CallInfo, request: RequestState) -> _Item:
        if call.is_image_flow:
            raise InputError("image-flow steps are not on the GPU fast path")
        node = self.node.name
        writes = (self.guidance.first,)  # the fast path has no guidance sequences (fast_path_reason)
        for name in call.inputs:
            raw = row.inputs.get(name)
            if raw is None and name in self._device_loop_backs(call) and node in request.last_token:
                return _Item(row, call, request, _no_embeds(1), list(request.last_token[node]), writes=writes,
                             is_loop_back=True)
            if call.input_roles.get(name) in ("mask", "signal"):
                continue  # read by no model here
            value = classify(name, raw)
            if value.kind == "tokens" and value.tensor is not None:
                tokens = chunk_of(value.tensor, row)  # a chunk after the KV earlier chunks wrote
                return _Item(row, call, request, _no_embeds(tokens.numel()), tokens.tolist(), writes=writes)
            if value.kind == "embeddings":
                raise InputError(f"input {name}: embeddings are not on the GPU fast path")
        raise InputError("a row with no token to feed is not on the GPU fast path")

    def _num_new(self, item: _Prepared) -> int:
        return len(item.tokens_fed)

    def _row_slot(self, request_id: str) -> int:
        if request_id not in self._row_slots:
            self._row_slots[request_id] = self._free_slots.pop()
        return self._row_slots[request_id]

    def _sampling(self, ready: list[_Item]) -> Optional[SamplingRows]:
        params = [item.request.params for item in ready]
        if all(p.is_greedy for p in params):
            return None
        node = self.node.name
        return SamplingRows(np.array([p.temperature or 0.0 for p in params], dtype=np.float32),
                            np.array([p.top_p for p in params], dtype=np.float32),
                            np.array([p.seed for p in params], dtype=np.int64),
                            np.array([item.request.num_sampled.get(node, 0) for item in ready], dtype=np.int64))

    # The base passes back only what this class's `_prepare` built (all `_Item`s).
    def _forward(self, ready: list[_Item]) -> list[RowResult]:  # type: ignore[override]
        specs = []
        for item in ready:
            key = (item.row.request_id, self.guidance.first)
            specs.append(RowSpec(None if item.is_loop_back else item.tokens_fed, self.pool.num_tokens(key),
                                 self.pool.page_table(key), self._row_slot(item.row.request_id)))
        tokens = self.executor.collect(self.executor.launch(specs, self._sampling(ready)))
        results = []
        for item, token in zip(ready, tokens.tolist()):
            self.pool.commit((item.row.request_id, self.guidance.first), len(item.tokens_fed),
                             None if item.is_loop_back else item.tokens_fed)
            if item.row.is_partial:  # a chunk before the last: its KV is written, its token unused
                item.request.history.setdefault(self.node.name, []).extend(item.tokens_fed)
                results.append(RowResult(item.row.request_id))
            else:
                results.append(self._token_outputs(item, token))
        return results

    def _token_outputs(self, item: _Item, token: int) -> RowResult:
        node, request = self.node.name, item.request
        request.history.setdefault(node, []).extend(item.tokens_fed)
        request.num_sampled[node] = request.num_sampled.get(node, 0) + 1
        request.last_token[node] = [token]
        max_tokens = request.params.max_tokens
        result = RowResult(item.row.request_id)
        result.is_stop = (token in request.params.stop_tokens or token in self.stop_tokens
                          or (max_tokens is not None and request.num_sampled[node] >= max_tokens))
        for name in item.call.output_names:
            if item.call.output_roles.get(name, "tokens") == "tokens":
                result.outputs[name] = [token]
            else:
                result.outputs[name] = torch.ones(len(item.tokens_fed), dtype=torch.bool)
        return result
