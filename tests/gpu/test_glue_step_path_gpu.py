"""The generated glue in the GPU step path, compiled, on a CUDA GPU (skipped without one): steps
packed by the llama plan's glue (`gpu/glue_packing.py`) against the same steps packed by numpy
(`packing.pack`) on a second executor over the same model and KV pages: decode graphs (padded
batches, zero-length padding rows in FlashInfer's graph-mode decode wrapper), piecewise packed
steps, eager steps and the split route, with loop-back tokens read from the device token table;
then the llama plan end to end with the glue against without it."""
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "engine"))
from engine_plans import LLM_DIMS, llm_plan  # noqa: E402

from mstar.plan.io import load_plan  # noqa: E402
from mstar.plan.dims import decoder_dims  # noqa: E402
from mstar.runtime.engine.glue_loader import load_plan_glue  # noqa: E402
from mstar.runtime.engine.gpu.device_model import build_decoder  # noqa: E402
from mstar.runtime.engine.gpu.executor import PackedFamilies, StepExecutor, WholePacked  # noqa: E402
from mstar.runtime.engine.gpu.forward import DecoderForward, PagedKv  # noqa: E402
from mstar.runtime.engine.gpu.packing import RowSpec  # noqa: E402

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]
GENERATED = Path(__file__).resolve().parents[2] / "generated"
FI_DIMS = dict(LLM_DIMS, head_dim=64, hidden=256, qo_heads=8, kv_heads=2, intermediate=512)
FAMILY = "LLM:mixed"
PREFILL, DECODE = 0, 1  # the llama glue key's walk order (prefill, decode)


def _glue():
    module = load_plan_glue(GENERATED / "llama.plan", load_plan(str(GENERATED / "llama.plan")))
    key_glue = module.GLUE_BY_WORKER[0]["LLM:mixed"]
    assert key_glue.constants.walks == ("prefill", "decode") and key_glue.constants.page_size == 16
    return key_glue


def _executors(num_pages=256, device_name="cuda", is_flashinfer=True, is_whole=False):
    """(glue executor, numpy executor) over one model and one KV cache, both captured (FlashInfer);
    on the CPU (is_flashinfer False) every step runs eagerly with torch attention. is_whole: the
    mixed family captured whole (a graph per batch size and token bucket), not piecewise."""
    device = torch.device(device_name)
    plan = llm_plan(FI_DIMS)
    dims = decoder_dims(plan.nodes[0], "spec")
    dtype = torch.bfloat16 if is_flashinfer else torch.float32
    model = build_decoder(dims, device, dtype, position=0, seed=0)
    kv = PagedKv(dims.num_full_layers, num_pages, 16, dims.num_kv_heads, dims.head_dim, dtype, device)
    kv.data.normal_()
    batch_pad = [0, 1, 2, 4, 4, 8, 8, 8, 8]
    packed = PackedFamilies(frozenset({FAMILY}), [32, 64, 128], max_rows=8)
    if is_whole:
        whole = WholePacked(FAMILY, tuple(batch_pad), (1, 2, 4, 8), (32, 64, 128), frozenset({"packed", "split"}))
        packed = PackedFamilies(frozenset(), [], 0, (whole,))
    executors = [StepExecutor(DecoderForward(model, dims, kv, 4097), kv, device, num_pages + 1, batch_pad,
                              is_flashinfer=is_flashinfer, packed=packed, glue_pages_per_seq=pages)
                 for pages in (4096 // 16, None)]
    if is_flashinfer:
        for executor in executors:
            executor.capture()
    return executors


def _steps():
    """(rows, capture family, token bucket, route) of a run, and the final sequence lengths: a
    prefill of four prompts (eager), decode graph steps of 4 rows (fed from the host, then from the
    device token table), a mixed step on the piecewise bucket 64 with a new prompt, a mixed step on
    the split route, an eager step past the buckets, decode rows crossing page boundaries."""
    prompts = [list(range(3 + i, 3 + i + 10 + 3 * i)) for i in range(4)]
    tables = [list(range(20 * i, 20 * i + 20)) for i in range(6)]
    lengths = [len(p) for p in prompts] + [0, 0, 0]
    steps = [([RowSpec(p, 0, tables[i], i, False, PREFILL) for i, p in enumerate(prompts)], None, 0, "packed")]

    def decode(slots, fed):
        rows = [RowSpec(None if slot in fed else [5 + slot], lengths[slot], tables[slot], slot, True, DECODE)
                for slot in slots]
        for slot in slots:
            lengths[slot] += 1
        return rows

    # A row's first decode step takes its token from the host (the prefill's token is the conductor's,
    # as the plan routes it); later ones read the token their last decode step left on the device.
    steps.append((decode([0, 1, 2, 3], fed=set()), None, 0, "packed"))
    steps.append((decode([0, 1, 2, 3], fed={0, 1, 2, 3}), None, 0, "packed"))
    prompt = RowSpec(list(range(40, 80)), 0, tables[4], 4, False, PREFILL)
    steps.append((decode([0, 1, 2], fed={0, 1, 2}) + [prompt], FAMILY, 64, "packed"))
    lengths[4] = 40
    steps.append((decode([0, 4, 1], fed={0, 1}) + [RowSpec(list(range(7, 30)), 0, tables[5], 5, False, PREFILL)],
                  FAMILY, 64, "split"))
    steps.append(([RowSpec(list(range(200)), 0, list(range(120, 133)), 6, False, PREFILL)], None, 0, "packed"))
    for _ in range(20):  # rows 0..3 cross into their second and third pages (16 tokens a page)
        steps.append((decode([0, 1, 2, 3], fed={0, 1, 2, 3}), None, 0, "packed"))
    return steps, lengths


def _run(executor, glue):
    steps, lengths = _steps()
    tokens = [executor.collect(executor.launch(rows, None, family, bucket, route, glue)).tolist()
              for rows, family, bucket, route in steps]
    return tokens, lengths


def compare_glue_and_numpy(glue_executor, numpy_executor):
    """Run the steps on both executors from the same KV pages; returns the final sequence lengths."""
    start = glue_executor.kv.data.clone()
    glue_tokens, lengths = _run(glue_executor, _glue())
    glue_kv = glue_executor.kv.data.clone()
    glue_executor.kv.data.copy_(start)
    numpy_tokens, _ = _run(numpy_executor, None)
    assert glue_tokens == numpy_tokens
    # The same K/V written to the same slots (the dummy page, written by padding, aside).
    real = glue_kv[:, :, :-1].float()
    assert ((real - numpy_executor.kv.data[:, :, :-1].float()).norm() / real.norm()).item() < 1e-3
    packer = glue_executor.packer
    assert packer is not None
    assert packer.num_mirrored[:7].tolist() == [-(-n // 16) for n in lengths[:4]] + [3, 2, 13]
    return lengths


def test_glue_steps_equal_numpy_steps_on_the_gpu():
    glue_executor, numpy_executor = _executors()
    compare_glue_and_numpy(glue_executor, numpy_executor)
    for executor in (glue_executor, numpy_executor):
        assert (executor.num_graph_steps, executor.num_piecewise_steps, executor.num_eager_steps) == (22, 2, 2)


def test_glue_steps_equal_numpy_steps_on_whole_packed_graphs():
    """The mixed family captured whole: its packed step replays the graph of (bucket 64, 4 rows)
    with FlashInfer's graph-mode prefill wrapper inside, its padding rows zero-length, and its split
    step the split graph of the same bucket (the decode rows on a graph-mode decode wrapper)."""
    glue_executor, numpy_executor = _executors(is_whole=True)
    compare_glue_and_numpy(glue_executor, numpy_executor)
    for executor in (glue_executor, numpy_executor):
        assert executor.packed_graphs is not None and executor.piecewise is None
        assert sorted(executor.packed_graphs.graphs)[0] == (32, 1, "packed") and executor.capture_bytes["whole"] > 0
        assert (executor.num_graph_steps, executor.num_whole_packed_steps, executor.num_eager_steps) == (22, 2, 2)


def test_llama_plan_end_to_end_with_the_glue():
    """`mstar run`'s engine on the llama plan at spec dims, packed by the glue and by numpy: every
    request ends the same way with as many tokens and the same first token (later tokens may differ
    where rows ran beside others: bf16 is not batch-invariant)."""
    from mstar.runtime.conductor.request import Request
    from mstar.runtime.engine.torch_engine import TorchEngine
    from mstar.runtime.serve.driver import Driver, Workload

    plan = load_plan(str(GENERATED / "llama.plan"))
    runs = {}
    for is_glue in (True, False):
        glue = load_plan_glue(GENERATED / "llama.plan", load_plan(str(GENERATED / "llama.plan"))) if is_glue else None
        engine = TorchEngine(plan, dims="spec", device="cuda", num_pages=1024, glue=glue)
        runner = engine.runners["LLM"]
        assert (runner.executor.packer is not None) == is_glue
        requests = [Request(id=f"r{i}", prompt_tokens=list(range(1 + i, 20 + 7 * i)), max_tokens=4 + 5 * i,
                            temperature=0.7 if i % 3 == 1 else None, seed=i) for i in range(8)]
        driver = Driver(plan, engine)
        driver.run(Workload(requests))
        runs[is_glue] = {rid: (r.finish_reason, r.num_output_tokens, list(r.output_tokens)[:1])
                         for rid, r in driver.conductor.records.items()}
        assert runner.executor.num_graph_steps > 0
    assert runs[True] == runs[False]
