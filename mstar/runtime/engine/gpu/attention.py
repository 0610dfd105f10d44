"""FlashInfer for the device step: an eager packed-prefill wrapper, and one graph-mode decode
wrapper per captured batch size sharing one set of index buffers at fixed addresses.

In: the node's heads, head dim, page size, the most pages a step can index, the decode family's
batch sizes. Out: `plan_eager(packed) -> attend` for any step (decode rows as one-token segments
beside prompt chunks, causal, bottom-right aligned), and `plan_decode(batch, packed)` which plans
the bucket's wrapper on the host before its graph replays (its `attend` is what the graph captured).

Rules kept (shared/reference/flashinfer.md section 0): every plan() gets q/kv dtype bf16; decode
uses tensor cores (the prefill kernels) for grouped-query attention with backend fa2, so one
compiled module serves both wrappers; plan() always runs outside the graph.
"""
from __future__ import annotations

from typing import Optional

import torch

from mstar.runtime.engine.gpu.forward import Attend
from mstar.runtime.engine.gpu.packing import PackedStep

WORKSPACE_BYTES = 256 << 20  # split-KV partial outputs (the prefill planner's need grows with tokens)


class FlashInferSteps:
    def __init__(self, device: torch.device, num_qo_heads: int, num_kv_heads: int, head_dim: int,
                 page_size: int, max_pages: int, decode_batch_sizes: list[int], is_tensor_core: Optional[bool] = None):
        """is_tensor_core: the decode kernel; None picks tensor cores for grouped-query ratios >= 4."""
        import flashinfer

        self.heads = (num_qo_heads, num_kv_heads, head_dim)
        self.page_size = page_size
        self.sm_scale = head_dim ** -0.5
        self.workspace = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=device)
        self.eager = flashinfer.BatchPrefillWithPagedKVCacheWrapper(self.workspace, "NHD", backend="fa2")
        max_batch = max(decode_batch_sizes, default=0)
        self.indptr = torch.zeros(max_batch + 1, dtype=torch.int32, device=device)
        self.indices = torch.zeros(max_pages + max_batch, dtype=torch.int32, device=device)
        self.last_len = torch.zeros(max(max_batch, 1), dtype=torch.int32, device=device)
        self.is_tensor_core = num_qo_heads // num_kv_heads >= 4 if is_tensor_core is None else is_tensor_core
        extra = {"backend": "fa2"} if self.is_tensor_core else {}
        self.decode = {
            batch: flashinfer.BatchDecodeWithPagedKVCacheWrapper(
                self.workspace, "NHD", use_cuda_graph=True, use_tensor_cores=self.is_tensor_core,
                paged_kv_indptr_buffer=self.indptr[:batch + 1], paged_kv_indices_buffer=self.indices,
                paged_kv_last_page_len_buffer=self.last_len[:batch], **extra)
            for batch in decode_batch_sizes
        }

    def plan_eager(self, packed: PackedStep) -> Attend:
        hq, hkv, d = self.heads
        self.eager.plan(packed.qo_indptr, packed.kv_indptr, packed.kv_indices, packed.last_page_len,
                        hq, hkv, d, self.page_size, causal=True, sm_scale=self.sm_scale,
                        q_data_type=torch.bfloat16, kv_data_type=torch.bfloat16)
        return lambda _layer, q, k_pages, v_pages: self.eager.run(q, (k_pages, v_pages))

    def plan_decode(self, batch: int, packed: PackedStep) -> None:
        hq, hkv, d = self.heads
        self.decode[batch].plan(packed.kv_indptr, packed.kv_indices, packed.last_page_len, hq, hkv, d,
                                self.page_size, sm_scale=self.sm_scale, q_data_type=torch.bfloat16,
                                kv_data_type=torch.bfloat16)

    def decode_attend(self, batch: int) -> Attend:
        wrapper = self.decode[batch]
        return lambda _layer, q, k_pages, v_pages: wrapper.run(q, (k_pages, v_pages))
