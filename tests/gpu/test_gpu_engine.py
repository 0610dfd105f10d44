"""The torch engine on a CUDA GPU: FlashInfer attention against the torch path, every spec end to
end with `device="cuda"`, and the FlashInfer backend in use. Skipped without a GPU (CI has none)."""
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "engine"))
from engine_plans import LLM_DIMS, generate, llm_plan  # noqa: E402

from mstar.plan.io import load_plan  # noqa: E402
from mstar.runtime.engine.attention.torch_paged import paged_attention  # noqa: E402
from mstar.runtime.serve.driver import Driver, Workload  # noqa: E402
from mstar.runtime.engine.torch_engine import TorchEngine  # noqa: E402
from mstar.runtime.conductor.request import Request  # noqa: E402

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]
GENERATED = Path(__file__).resolve().parents[2] / "generated"
# head_dim 64: a size FlashInfer compiles (tiny dims use 16, which takes the torch path)
FI_DIMS = dict(LLM_DIMS, head_dim=64, hidden=256, qo_heads=8, kv_heads=2, intermediate=512)


def test_flashinfer_mixed_step_matches_the_torch_path():
    """Decode rows (one token after a context) beside prompt chunks (with and without a cached
    prefix), one packed call, against paged_attention on the same bf16 cache."""
    from mstar.runtime.serve.bench_attention import paged_step
    from mstar.runtime.engine.attention.flashinfer_paged import FlashInferAttention

    torch.manual_seed(0)
    device, page_size, hq, hkv, d = torch.device("cuda"), 16, 8, 2, 64
    num_pages = 64
    rows = [(1, 40), (1, 3), (37, 0), (20, 17), (1, 16)]  # (new tokens, cached tokens)
    segments, tables, n = paged_step(rows, page_size, num_pages, device, torch.Generator().manual_seed(0))
    q, k, v = (torch.randn(n, h, d, device=device, dtype=torch.bfloat16) for h in (hq, hkv, hkv))
    cache = [torch.randn(num_pages * page_size, hkv, d, device=device, dtype=torch.bfloat16) for _ in range(2)]
    caches_torch = [c.clone() for c in cache]
    with torch.device(device):
        expected = paged_attention(q, k, v, *caches_torch, segments, d ** -0.5)
    backend = FlashInferAttention(device, hq, hkv, d, page_size)
    new_index = torch.cat([s.flat_index[s.num_cached:] for s in segments]).cpu()
    attend = backend.plan_step([(s.num_tokens, s.num_cached, t) for s, t in zip(segments, tables)], new_index,
                               d ** -0.5)
    got = attend(q, k, v, *cache, d ** -0.5)
    torch.cuda.synchronize()
    assert torch.equal(cache[0], caches_torch[0]) and torch.equal(cache[1], caches_torch[1])  # same K/V writes
    error = ((got.float() - expected.float()).norm() / expected.float().norm()).item()
    assert error < 2e-2, error


def test_flashinfer_engine_follows_the_cpu_reference():
    """Greedy tokens of a small Llama on the GPU (bf16, FlashInfer) against the CPU fp32 path:
    the first tokens agree (later ones may drift with bf16 rounding), and FlashInfer planned steps."""
    prompts = {"a": [5, 6, 7, 8, 9, 10, 11], "b": [3, 1], "c": list(range(20, 60))}
    cpu = generate(TorchEngine(llm_plan(FI_DIMS), dims="spec"), prompts, 4, start_every=1)
    engine = TorchEngine(llm_plan(FI_DIMS), dims="spec", device="cuda", attention="flashinfer")
    gpu = generate(engine, prompts, 4, start_every=1)
    # A plain Llama takes the device fast path (bf16 weights on the device, engine/gpu/); a
    # hand-built plan lists no captures, so its steps run eagerly through FlashInfer.
    assert engine.attention_backends() == {"LLM": "device"}
    assert engine.runners["LLM"].executor.num_eager_steps > 0
    assert sum(cpu[r][0] == gpu[r][0] for r in prompts) >= 2, (cpu, gpu)


@pytest.mark.parametrize("name", ["llama", "qwen3_5", "orpheus", "bagel", "qwen3_omni", "pi05"])
def test_every_spec_runs_on_the_gpu(name):
    plan = load_plan(str(GENERATED / f"{name}.plan"))
    route = {"LLM": ["prefill_vit", "prefill_text", "image_gen"]} if name == "bagel" else {}
    requests = [Request(id=f"r{i}", prompt_tokens=[1 + i, 2, 3], max_tokens=6, route=route if i == 0 else {})
                for i in range(3)]
    driver = Driver(plan, TorchEngine(plan, device="cuda"))
    driver.run(Workload(requests))
    reasons = {r.finish_reason for r in driver.conductor.records.values()}
    assert reasons <= {"stop", "length", "done"}, reasons
