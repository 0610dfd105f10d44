"""KV offload on the GPU fast path (kv/offload.py through `GpuDecoderRunner._page_tensors`: a layer's
keys and values copied to pinned host pages and back, in stream order with the steps around them),
llama_chunked at spec dims (bf16), skipped without a GPU. The CPU tests (tests/engine/test_offload.py)
run the same runner on the CPU; here the copies are the device's.

- Steps of one row each (every key's cap 1, no capture family: eager steps), so a row's arithmetic
  does not depend on which other rows share its step: a pool too small for the started requests
  gives the tokens of a pool that holds them all, bit for bit, serial and with steps launched ahead.
- The plan's own caps and graphs (decode graphs of up to 64 rows) with 100 requests on half the
  pages they end on: every request ends `length`, pages move both ways and all come home. The tokens
  are not compared there: bf16 products differ with the rows a step holds, which differ between the
  two pools."""
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "engine"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from test_offload import small_pool_plan  # noqa: E402

from mstar.plan.io import load_plan  # noqa: E402
from mstar.runtime.conductor.request import Request  # noqa: E402
from mstar.runtime.engine.torch_engine import TorchEngine  # noqa: E402
from mstar.runtime.serve.driver import Driver, Workload  # noqa: E402

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]
PLAN = Path(__file__).resolve().parents[2] / "generated" / "llama_chunked.plan"
NODE = "LLM"  # llama_chunked's kv node


def _requests(num: int, prompt_len: int, max_tokens: int) -> list[Request]:
    return [Request(id=f"q{i}", prompt_tokens=[(13 * i + j) % 500 + 100 for j in range(prompt_len)],
                    max_tokens=max_tokens) for i in range(num)]


def _run(plan, num_pages: int, requests: list[Request], clients: int, run_ahead: bool = True):
    """The records by id and the node's runner; clients 0: every request arrives at once."""
    engine = TorchEngine(plan, dims="spec", device="cuda", num_pages=num_pages, run_ahead=run_ahead)
    driver = Driver(plan, engine)
    driver.run(Workload(requests, closed_concurrency=clients or None))
    return {r: (x.finish_reason, list(x.output_tokens)) for r, x in driver.conductor.records.items()}, \
        engine.runners[NODE]


@pytest.mark.parametrize("run_ahead", [False, True], ids=["serial", "run_ahead"])
def test_offload_on_the_gpu_keeps_one_row_steps_tokens(run_ahead):
    roomy, tight = small_pool_plan(64, 0, cap=1), small_pool_plan(6, 64, cap=1)  # 3 requests' pages, 5 clients
    requests = _requests(9, 20, 12)
    want, _ = _run(roomy, 64, requests, 5, run_ahead)
    got, runner = _run(tight, 6, requests, 5, run_ahead)
    assert got == want and all(reason == "length" for reason, _ in got.values())
    offload = runner.offload
    assert offload.num_offloaded_pages > 0 and offload.num_restored_pages > 0
    assert not offload.offloaded and offload.num_free_host_pages == 64


def test_offload_on_the_gpu_under_the_plans_graphs():
    plan = load_plan(PLAN, verify=False)
    pools = [pool.model_copy(update={"num_pages": 200, "host_pages": 4096, "prefix_cache": "off"})
             for pool in plan.deployment.kv_pools]
    plan = plan.model_copy(update={"deployment": plan.deployment.model_copy(update={"kv_pools": pools})})
    got, runner = _run(plan, 200, _requests(100, 20, 40), 0)  # 100 x 4 pages at their end
    assert len(got) == 100 and all(reason == "length" and len(tokens) == 40 for reason, tokens in got.values())
    offload = runner.offload
    assert offload.num_offloaded_pages > 0 and offload.num_restored_pages == offload.num_offloaded_pages
    assert not offload.offloaded and offload.num_free_host_pages == 4096
    assert runner.executor.num_graph_steps > 0  # the decode graphs ran beside the moves
