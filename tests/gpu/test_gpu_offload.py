"""KV offload on the GPU fast path (kv/offload.py through `GpuDecoderRunner._page_tensors`: a layer's
keys and values copied to pinned host pages and back, in stream order with the steps around them),
llama_chunked at spec dims (bf16), skipped without a GPU. The CPU tests (tests/engine/test_offload.py)
run the same runner on the CPU; here the copies are the device's.

- `PagedKv`'s pages (bf16, every layer, keys and values) through the pinned host pool and back to
  other pages, bit for bit.
- The plan's own caps and graphs (decode graphs of up to 64 rows) with 100 requests, every third
  long, on fewer pages than they end on: every request ends `length`, pages move both ways and all
  come home. The tokens are not compared: bf16 products differ with the rows a step holds, which
  differ between two pools. (Steps of one row each, whose tokens a roomy pool gives bit for bit,
  never move pages since a move must start more requests than it moves out, kv/offload.py.)"""
from pathlib import Path

import pytest
import torch

from mstar.plan.io import load_plan
from mstar.runtime.conductor.request import Request
from mstar.runtime.engine.torch_engine import TorchEngine
from mstar.runtime.serve.driver import Driver, Workload

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]
PLAN = Path(__file__).resolve().parents[2] / "generated" / "llama_chunked.plan"
NODE = "LLM"  # llama_chunked's kv node


def _requests(num: int, prompt_len: int, max_tokens: int, long_max_tokens: int) -> list[Request]:
    """Every third request `long_max_tokens`: a long one started reserves pages that, moved out,
    start two others (a move of as many requests as it starts is refused, kv/offload.py)."""
    return [Request(id=f"q{i}", prompt_tokens=[(13 * i + j) % 500 + 100 for j in range(prompt_len)],
                    max_tokens=long_max_tokens if i % 3 == 0 else max_tokens) for i in range(num)]


def _run(plan, num_pages: int, requests: list[Request], clients: int, run_ahead: bool = True):
    """The records by id and the node's runner; clients 0: every request arrives at once."""
    engine = TorchEngine(plan, dims="spec", device="cuda", num_pages=num_pages, run_ahead=run_ahead)
    driver = Driver(plan, engine)
    driver.run(Workload(requests, closed_concurrency=clients or None))
    return {r: (x.finish_reason, list(x.output_tokens)) for r, x in driver.conductor.records.items()}, \
        engine.runners[NODE]


def test_offloaded_pages_come_back_bit_identical_on_the_gpu():
    from mstar.runtime.engine.gpu.forward import PagedKv
    from mstar.runtime.engine.kv.host_cache import HostKv

    kv = PagedKv(4, 12, 16, 8, 64, torch.bfloat16, torch.device("cuda"))
    kv.data.copy_(torch.randn(kv.data.shape, generator=torch.Generator().manual_seed(2)).to(kv.data))
    host = HostKv(6, [kv.data[layer, part] for part in (0, 1) for layer in range(4)])
    before = kv.data[:, :, [9, 2, 5, 11]].clone()
    host.copy_out([9, 2, 5, 11], [5, 0, 3, 1])
    kv.data[:, :, [9, 2, 5, 11]] = 0
    host.copy_in([5, 0, 3, 1], [1, 8, 3, 4])
    torch.cuda.synchronize()
    assert torch.equal(kv.data[:, :, [1, 8, 3, 4]], before)


def test_offload_on_the_gpu_under_the_plans_graphs():
    plan = load_plan(PLAN, verify=False)
    pools = [pool.model_copy(update={"num_pages": 200, "host_pages": 4096, "prefix_cache": "off"})
             for pool in plan.deployment.kv_pools]
    plan = plan.model_copy(update={"deployment": plan.deployment.model_copy(update={"kv_pools": pools})})
    got, runner = _run(plan, 200, _requests(100, 20, 40, 120), 0)  # 4 pages at their end, the long ones 9
    assert len(got) == 100 and all(reason == "length" and len(tokens) == (120 if int(r[1:]) % 3 == 0 else 40)
                                   for r, (reason, tokens) in got.items())
    offload = runner.offload
    assert offload.num_offloaded_pages > 0 and offload.num_restored_pages == offload.num_offloaded_pages
    assert not offload.offloaded and offload.num_free_host_pages == 4096
    assert runner.executor.num_graph_steps > 0  # the decode graphs ran beside the moves
