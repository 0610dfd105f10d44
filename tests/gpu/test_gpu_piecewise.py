"""Piecewise CUDA graphs of packed families (prefill and mixed steps) on a CUDA GPU, against the
same steps run eagerly, and `mstar run` of the llama plan replaying them. Skipped without a GPU."""
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "engine"))
from engine_plans import LLM_DIMS, llm_plan  # noqa: E402

from mstar.plan.io import load_plan  # noqa: E402
from mstar.plan.dims import decoder_dims  # noqa: E402
from mstar.runtime.engine.gpu.device_model import build_decoder  # noqa: E402
from mstar.runtime.engine.gpu import packed_graphs  # noqa: E402
from mstar.runtime.engine.gpu.executor import PackedFamilies, StepExecutor, WholePacked  # noqa: E402
from mstar.runtime.engine.gpu.forward import DecoderForward, PagedKv  # noqa: E402
from mstar.runtime.engine.gpu.packing import RowSpec, pack  # noqa: E402

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]
GENERATED = Path(__file__).resolve().parents[2] / "generated"
FI_DIMS = dict(LLM_DIMS, head_dim=64, hidden=256, qo_heads=8, kv_heads=2, intermediate=512)
FAMILY = "LLM:mixed"


def _executor(num_pages=256, is_whole=False, keeps_hidden=False):
    """is_whole: the family captured whole (a graph per batch size 1, 4, 8, token bucket and
    attention route), not piecewise; keeps_hidden: the piecewise graphs keep every position's final
    hidden state (a node giving prompts' log-probabilities)."""
    plan = llm_plan(FI_DIMS)
    dims = decoder_dims(plan.nodes[0], "spec")
    device = torch.device("cuda")
    model = build_decoder(dims, device, torch.bfloat16, position=0, seed=0)
    kv = PagedKv(dims.num_full_layers, num_pages, 16, dims.num_kv_heads, dims.head_dim, torch.bfloat16, device)
    kv.data.normal_()
    packed = PackedFamilies(frozenset({FAMILY}), [32, 64, 128], max_rows=8, keeps_hidden=keeps_hidden)
    if is_whole:
        whole = WholePacked(FAMILY, (0, 1, 4, 4, 4, 8, 8, 8, 8), (1, 4, 8), (32, 64, 128),
                            frozenset({"packed", "split"}))
        packed = PackedFamilies(frozenset(), [], 0, (whole,))
    return StepExecutor(DecoderForward(model, dims, kv, 4097), kv, device, num_pages + 1, [0, 1, 2, 4, 4],
                        is_flashinfer=True, packed=packed)


def _steps():
    """Two steps: a mixed one (3 decode rows and a 20-token prompt: bucket 32) and one that decodes
    the prompt's next token beside a 40-token prompt (bucket 64), so the second reads KV the first
    wrote."""
    decode = [RowSpec([3 + i], 40 + 9 * i, list(range(4 * i, 4 * i + 4)), i) for i in range(3)]
    prompt = RowSpec(list(range(5, 25)), 0, [20, 21], 3)
    first = decode + [prompt]
    second = [RowSpec([7], 20, [20, 21], 3), RowSpec(list(range(9, 49)), 0, [30, 31, 32], 4)]
    return [(first, 32), (second, 64)]


@pytest.mark.parametrize("graphs", ["piecewise", "piecewise_keeping_hidden", "whole", "whole_flashinfer_packed"])
def test_packed_graph_steps_match_eager_steps_and_write_the_same_kv(graphs, monkeypatch):
    """whole: the whole graphs' packed keys on the Triton prefill kernel (the default), with no
    FlashInfer wrapper and no host plan; whole_flashinfer_packed: on FlashInfer's graph-mode prefill
    (`packed_graphs.set_triton_packed(False)`); piecewise_keeping_hidden: piecewise graphs that also
    write every position's final state (their logits were norm(x + 2 delta): the fused norm of every
    position moves x on in place)."""
    is_whole = not graphs.startswith("piecewise")
    monkeypatch.setattr(packed_graphs, "_triton_packed", graphs == "whole")
    executor = _executor(is_whole=is_whole, keeps_hidden=graphs == "piecewise_keeping_hidden")
    executor.capture()
    if is_whole:
        keys = executor.packed_graphs.graphs
        assert sorted(k for k in keys if k[2] == "packed") == [(t, b, "packed") for t in (32, 64, 128)
                                                               for b in (1, 4, 8)]
        assert sorted(k for k in keys if k[2] == "split") == [(t, b, "split") for t in (32, 64, 128) for b in (4, 8)]
        assert executor.capture_bytes["whole"] > 0
        on_triton = [k for k in keys if not executor.packed_graphs.needs_plan(k)]
        assert sorted(on_triton) == sorted(k for k in keys if k[2] == "split" or graphs == "whole")
    else:
        assert sorted(executor.piecewise.pieces) == [32, 64, 128]
        assert executor.capture_bytes["packed"] > 0
    start = executor.kv.data.clone()
    runs = {}
    for is_graph in (False, True):
        executor.kv.data.copy_(start)
        logits, tokens = [], []
        for rows, bucket in _steps():
            if is_graph:
                tokens.append(executor.collect(executor.launch(rows, None, FAMILY, bucket)).tolist())
                source = executor.packed_graphs if is_whole else executor.piecewise
                logits.append(source.logits[:len(rows)].clone())
            else:
                with torch.no_grad():
                    eager, greedy, _ = executor._run_eager(pack(rows, 16, executor.kv.dummy_page))
                tokens.append(greedy[:len(rows)].tolist())
                logits.append(eager[:len(rows)].clone())
        runs[is_graph] = (logits, tokens, executor.kv.data[:, :, :40].clone())
    assert (executor.num_whole_packed_steps if is_whole else executor.num_piecewise_steps) == 2
    (eager_logits, eager_tokens, eager_kv), (graph_logits, graph_tokens, graph_kv) = runs[False], runs[True]
    for eager, graphed in zip(eager_logits, graph_logits):
        assert ((graphed - eager).norm() / eager.norm()).item() < 2e-2
    assert graph_tokens == eager_tokens
    assert ((graph_kv.float() - eager_kv.float()).norm() / eager_kv.float().norm()).item() < 1e-2


def test_a_step_outside_the_buckets_runs_eagerly():
    executor = _executor()
    executor.capture()
    rows = [RowSpec(list(range(130)), 0, list(range(9)), 0)]  # 130 tokens: above the largest bucket
    assert executor.token_bucket(rows, FAMILY, 128) == 0
    assert executor.token_bucket(rows[:1], "another family", 32) == 0
    too_many = [RowSpec([1], 5, [i], i) for i in range(9)]  # more rows than the graphs' 8 row entries
    assert executor.token_bucket(too_many, FAMILY, 32) == 0
    executor.collect(executor.launch(rows, None, FAMILY, 128))
    assert executor.num_piecewise_steps == 0 and executor.num_eager_steps == 1


def test_llama_plan_prefills_on_its_piecewise_graphs():
    from mstar.runtime.conductor.request import Request
    from mstar.runtime.engine.torch_engine import TorchEngine
    from mstar.runtime.serve.driver import Driver, Workload

    plan = load_plan(str(GENERATED / "llama.plan"))
    engine = TorchEngine(plan, dims="spec", device="cuda", num_pages=1024)
    runner = engine.runners["LLM"]
    assert runner.executor.piecewise is not None
    requests = [Request(id=f"r{i}", prompt_tokens=list(range(1, 30 + 40 * i)), max_tokens=5) for i in range(6)]
    driver = Driver(plan, engine)
    driver.run(Workload(requests))
    records = driver.conductor.records.values()
    assert all(r.finish_reason in ("stop", "length") and r.num_output_tokens for r in records)
    assert runner.executor.num_piecewise_steps > 0


@pytest.mark.parametrize("graphs", ["eager", "piecewise", "whole"])
def test_split_route_matches_the_packed_route(graphs):
    """The plan's split route (decode rows on the decode kernel, launched first, prompt rows on the
    prefill kernel) against one prefill call: the same tokens in the caller's row order, the same
    KV writes. The decode rows sit before, between and after the prompt rows. Whole graphs: the
    split graph derives both wrappers' index arrays on the device and merges their outputs."""
    is_piecewise = graphs != "eager"
    executor = _executor(is_whole=graphs == "whole")
    executor.capture()
    decode = [RowSpec([3 + i], 40 + 9 * i, list(range(4 * i, 4 * i + 4)), i, is_decode=True) for i in range(3)]
    prompts = [RowSpec(list(range(5, 25)), 0, [20, 21], 3), RowSpec(list(range(2, 9)), 0, [30], 4)]
    rows = [decode[0], prompts[0], decode[1], prompts[1], decode[2]]
    start = executor.kv.data.clone()
    runs = {}
    for route in ("packed", "split"):
        executor.kv.data.copy_(start)
        family, bucket = (FAMILY, 32) if is_piecewise else (None, 0)
        pending = executor.launch(rows, None, family, bucket, route)
        assert (pending.order is not None) == (route == "split")
        runs[route] = (executor.collect(pending).tolist(), executor.kv.data[:, :, :40].clone())
    counted = executor.num_whole_packed_steps if graphs == "whole" else executor.num_piecewise_steps
    assert counted == (2 if is_piecewise else 0)
    (packed_tokens, packed_kv), (split_tokens, split_kv) = runs["packed"], runs["split"]
    assert split_tokens == packed_tokens
    assert ((split_kv.float() - packed_kv.float()).norm() / packed_kv.float().norm()).item() < 1e-2


def test_long_prompt_rows_run_on_fa3_and_agree_with_fa2(monkeypatch):
    """A prefill call whose rows all hold FA3_MIN_ROW_TOKENS query tokens or more is planned on the
    fa3 wrapper, and its output agrees with fa2's on the same step; a packed call with one-token
    decode rows stays on fa2."""
    from mstar.runtime.engine.gpu import attention as flashinfer_steps

    torch.manual_seed(0)
    executor = _executor()
    steps = executor.attention
    long_rows = [RowSpec(list(range(100)), 30, list(range(9)), 0), RowSpec(list(range(70)), 0, [20, 21, 22, 23, 24], 1)]
    packed = pack(long_rows, 16, executor.kv.dummy_page)
    q = torch.randn(170, FI_DIMS["qo_heads"], FI_DIMS["head_dim"], device="cuda", dtype=torch.bfloat16)
    pages = executor.kv.pages(0)
    on_fa3 = steps.plan_eager(packed)
    assert on_fa3.prefill is steps.prompts
    got = on_fa3.run(q, pages, torch.empty_like(q))
    monkeypatch.setattr(flashinfer_steps, "FA3_MIN_ROW_TOKENS", 1 << 30)
    on_fa2 = steps.plan_eager(packed)
    assert on_fa2.prefill is steps.eager
    expected = on_fa2.run(q, pages, torch.empty_like(q))
    torch.cuda.synchronize()
    assert ((got.float() - expected.float()).norm() / expected.float().norm()).item() < 1e-2
    monkeypatch.undo()
    mixed_rows, _ = _steps()[0]
    assert steps.plan_eager(pack(mixed_rows, 16, executor.kv.dummy_page)).prefill is steps.eager
