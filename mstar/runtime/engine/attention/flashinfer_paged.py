"""Paged attention on a GPU with FlashInfer 0.6 (`pip install -e '.[gpu]'`): one packed call per layer.

A step's rows are packed along one token axis exactly as on the CPU path
(mstar/runtime/engine/attention/torch_paged.py): a prompt chunk is a segment of many tokens, a
decode row a segment of one token. Once per step, `plan_step` turns the segments into FlashInfer's
CSR layout and plans one `BatchPrefillWithPagedKVCacheWrapper` (causal, bottom-right aligned:
query j of a row that holds `q` new tokens after `c` cached ones sees keys 0..c+j, the CPU path's
rule). Every full-attention layer then writes the step's K/V into its cache and runs the planned
kernel. The cache is the CPU layout `[num_pages * page_size, kv_heads, head_dim]` viewed, without
a copy, as FlashInfer's NHD `[num_pages, page_size, kv_heads, head_dim]`.

Not here yet: CUDA graphs (the plan's captures), the decode-only wrapper, and the generated glue
kernels. Steps FlashInfer cannot express fall back to the torch path: a row that only reads the
cache (an image-flow step) or attends bidirectionally (`bidirectional` walks), and head dims
FlashInfer does not compile (it takes 64, 128 and 256).
"""
from __future__ import annotations

from typing import Callable, Optional

import torch

SUPPORTED_HEAD_DIMS = (64, 128, 256)
WORKSPACE_BYTES = 128 << 20  # FlashInfer's suggested float workspace (split-KV partial outputs)


def unavailable_reason(device: torch.device, head_dim: int) -> Optional[str]:
    """Why FlashInfer cannot run this node's attention here, or None when it can."""
    if device.type != "cuda":
        return "FlashInfer needs a CUDA device"
    if head_dim not in SUPPORTED_HEAD_DIMS:
        return f"head_dim {head_dim} is not one FlashInfer compiles ({', '.join(map(str, SUPPORTED_HEAD_DIMS))})"
    try:
        import flashinfer  # noqa: F401
    except ImportError as error:
        return f"flashinfer is not installed ({error}); pip install -e '.[gpu]'"
    return None


class FlashInferAttention:
    """One node's FlashInfer wrapper, planned once per step (see the module docstring)."""

    def __init__(self, device: torch.device, num_qo_heads: int, num_kv_heads: int, head_dim: int,
                 page_size: int):
        import flashinfer

        self.device = device
        self.num_qo_heads, self.num_kv_heads, self.head_dim = num_qo_heads, num_kv_heads, head_dim
        self.page_size = page_size
        self.workspace = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=device)
        self.wrapper = flashinfer.BatchPrefillWithPagedKVCacheWrapper(self.workspace, "NHD")
        self.num_steps = 0  # steps planned here (the rest of the node's steps took the torch path)
        self._warm_up()
        self.num_steps = 0

    def _warm_up(self) -> None:
        """Plan and run one token on a scratch page at start-up, so that FlashInfer's JIT compile
        (about a minute on a fresh machine) happens before the first request, not inside its TTFT."""
        cache = torch.zeros(self.page_size, self.num_kv_heads, self.head_dim, dtype=torch.bfloat16,
                            device=self.device)
        q = torch.zeros(1, self.num_qo_heads, self.head_dim, dtype=torch.bfloat16, device=self.device)
        k = torch.zeros(1, self.num_kv_heads, self.head_dim, dtype=torch.bfloat16, device=self.device)
        attend = self.plan_step([(1, 0, [0])], torch.zeros(1, dtype=torch.long), self.head_dim ** -0.5)
        attend(q, k, k, cache, cache.clone(), 1.0)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def plan_step(self, rows: list[tuple[int, int, list[int]]], new_flat_index: torch.Tensor,
                  scale: float) -> Callable[..., torch.Tensor]:
        """rows: per segment in step order (num_tokens, num_cached, page_table); new_flat_index:
        the cache index of every token of the step, in step order. Returns the per-layer `attend`."""
        qo_indptr, kv_indptr, kv_indices, last_page_len = [0], [0], [], []
        for num_tokens, num_cached, page_table in rows:
            kv_len = num_cached + num_tokens
            num_pages = -(-kv_len // self.page_size)
            qo_indptr.append(qo_indptr[-1] + num_tokens)
            kv_indptr.append(kv_indptr[-1] + num_pages)
            kv_indices.extend(page_table[:num_pages])
            last_page_len.append(kv_len - (num_pages - 1) * self.page_size)
        as_int32 = lambda values: torch.tensor(values, dtype=torch.int32)  # noqa: E731
        self.wrapper.plan(
            as_int32(qo_indptr), as_int32(kv_indptr), as_int32(kv_indices).to(self.device),
            as_int32(last_page_len), self.num_qo_heads, self.num_kv_heads, self.head_dim, self.page_size,
            causal=True, sm_scale=scale, q_data_type=torch.bfloat16, kv_data_type=torch.bfloat16,
        )
        self.num_steps += 1
        new_index = new_flat_index.to(self.device)
        shape = (-1, self.page_size, self.num_kv_heads, self.head_dim)

        def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache_k: torch.Tensor,
                   cache_v: torch.Tensor, _scale: float) -> torch.Tensor:
            cache_k[new_index] = k
            cache_v[new_index] = v
            return self.wrapper.run(q, (cache_k.view(shape), cache_v.view(shape)))

        return attend
