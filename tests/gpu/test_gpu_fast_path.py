"""The GPU fast path on a CUDA GPU: bf16 weights on the device, CUDA graphs of the decode family
against eager steps, device sampling, and `mstar run` on the llama plan's graphs. Skipped without one."""
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "engine"))
from engine_plans import LLM_DIMS, llm_plan  # noqa: E402

from mstar.plan.io import load_plan  # noqa: E402
from mstar.plan.schema import CaptureFamily  # noqa: E402
from mstar.plan.dims import decoder_dims  # noqa: E402
from mstar.runtime.engine.gpu.device_model import build_decoder  # noqa: E402
from mstar.runtime.engine.gpu.executor import StepExecutor  # noqa: E402
from mstar.runtime.engine.gpu.forward import DecoderForward, PagedKv  # noqa: E402
from mstar.runtime.engine.gpu.packing import RowSpec, pack  # noqa: E402

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]
GENERATED = Path(__file__).resolve().parents[2] / "generated"
FI_DIMS = dict(LLM_DIMS, head_dim=64, hidden=256, qo_heads=8, kv_heads=2, intermediate=512)


def _executor(batch_sizes, num_pages=256):
    plan = llm_plan(FI_DIMS)
    dims = decoder_dims(plan.nodes[0], "spec")
    device = torch.device("cuda")
    model = build_decoder(dims, device, torch.bfloat16, position=0, seed=0)
    assert all(p.dtype == torch.bfloat16 and p.is_cuda for p in model.parameters())
    kv = PagedKv(dims.num_full_layers, num_pages, 16, dims.num_kv_heads, dims.head_dim, torch.bfloat16, device)
    torch.manual_seed(1)
    kv.data.normal_()
    pad = [0] + [min([b for b in batch_sizes if b >= n], default=0) for n in range(1, max(batch_sizes) + 1)]
    return StepExecutor(DecoderForward(model, dims, kv, 4097), kv, device, num_pages + 1, pad, is_flashinfer=True)


def _argmax_up_to_ties(tokens: list[int], logits: torch.Tensor, error: float) -> bool:
    """Each token is its row's argmax of `logits`, or within the comparison's error of it (the two
    paths round bf16 differently, so a near-tie may fall either way: seen once on the H200)."""
    rows = torch.arange(logits.shape[0], device=logits.device)
    chosen = logits[rows, torch.tensor(tokens, device=logits.device)].float()
    best = logits.float().max(-1).values
    scale = logits.float().norm(dim=-1) / logits.shape[-1] ** 0.5
    return bool(((best - chosen) <= 4 * error * scale).all())


def test_decode_graph_replay_matches_the_eager_step():
    executor = _executor([1, 2, 4, 8])
    executor.capture()
    rows = [RowSpec([3 + i], 40 + 9 * i, list(range(4 * i, 4 * i + 4)), i) for i in range(3)]  # pads to 4
    eager = executor._run_eager(pack(rows, 16, executor.kv.dummy_page))[0][:3].clone()
    pending = executor.launch(rows)
    tokens = executor.collect(pending)
    assert pending.is_graph
    graphed = executor.graphs.logits[4][:3]
    error = ((graphed - eager).norm() / eager.norm()).item()
    assert error < 2e-2, error
    assert _argmax_up_to_ties(tokens.tolist(), eager, error)


def test_unrolled_prompt_rows_match_the_eager_prompt_step():
    """Short prompt rows after cached tokens, unrolled into the decode graph (the plan's
    `unroll_prompts`: one row per query token, FlashInfer's graph-mode decode wrapper), against the
    same rows as one eager causal prefill call: the last tokens' logits and tokens, and the K/V."""
    executor = _executor([1, 2, 4, 8, 16])
    executor.capture()
    prefixes = [RowSpec(list(range(3, 40)), 0, list(range(0, 4)), 1), RowSpec(list(range(5, 25)), 0, [4, 5, 6], 2)]
    executor.collect(executor.launch(prefixes))
    tails = [RowSpec([50, 51, 52, 53, 54], 37, list(range(0, 4)), 1), RowSpec([60, 61, 62], 20, [4, 5, 6], 2)]
    start = executor.kv.data.clone()
    eager = executor._run_eager(pack(tails, 16, executor.kv.dummy_page))[0][:2].float().clone()
    eager_kv = executor.kv.data[:, :, :-1].float().clone()  # the dummy page (padding's writes) aside
    executor.kv.data.copy_(start)
    executor.unroll_prompts = 8
    pending = executor.launch(tails)
    tokens = executor.collect(pending)
    assert pending.is_graph and executor.num_unrolled_steps == 1
    unrolled = executor.graphs.logits[8][:2].float()  # 2 + 4 + 2 rows: the graph of 8
    error = ((unrolled - eager).norm() / eager.norm()).item()
    assert error < 2e-2, error
    assert _argmax_up_to_ties(tokens.tolist(), eager, error)
    kv_error = ((executor.kv.data[:, :, :-1].float() - eager_kv).norm() / eager_kv.norm()).item()
    assert kv_error < 1e-2, kv_error


def test_llama_plan_runs_on_its_decode_graphs():
    from mstar.runtime.conductor.request import Request
    from mstar.runtime.engine.torch_engine import TorchEngine
    from mstar.runtime.serve.driver import Driver, Workload

    plan = load_plan(str(GENERATED / "llama.plan"))
    engine = TorchEngine(plan, dims="spec", device="cuda", num_pages=1024)
    runner = engine.runners["LLM"]
    assert engine.attention_backends() == {"LLM": "flashinfer+graphs"}
    assert isinstance(runner.family, CaptureFamily) and runner.capture_bytes > 0
    # 21-token prompts: past the decode family's unroll_prompts (16), so their step is a packed one
    requests = [Request(id=f"r{i}", prompt_tokens=[1 + i, 2, 3] * 7, max_tokens=6,
                        temperature=0.7 if i % 2 else None, seed=i) for i in range(5)]
    from mstar.runtime.engine.gpu.step_events import StepEvents

    runner.executor.step_events = events = StepEvents()  # what `mstar run --gpu-idle` attaches
    driver = Driver(plan, engine)
    driver.run(Workload(requests))
    reasons = {r.finish_reason for r in driver.conductor.records.values()}
    assert reasons <= {"stop", "length", "done"}, reasons
    assert runner.executor.num_graph_steps > 0
    idle = events.summary()
    assert idle["num_steps"] == len(events.pairs) >= runner.executor.num_graph_steps
    assert 0.0 <= idle["whole_run"]["idle_between_steps_pct"] <= 100.0 and idle["whole_run"]["span_ms"] > 0
    steps = events.steps()
    assert len(steps) == idle["num_steps"] and all(s["tokens"] >= s["rows"] >= 1 and s["span_ms"] > 0 for s in steps)
    assert any(s["tokens"] > s["rows"] for s in steps)  # the prompts' step


@pytest.mark.parametrize("penalty", [{"repetition_penalty": 1.2}, {"presence_penalty": 0.5},
                                     {"frequency_penalty": -1.0, "temperature": 0.8, "seed": 3}])
def test_penalised_requests_run_on_the_fast_path_beside_others(penalty):
    """The penalties on the device (gpu/penalties.py; such requests were refused): a penalised
    request runs to its length beside a plain and a top_k one, on the plan's decode graphs, and
    steps holding it are launched ahead (their penalties count the uncollected token from the
    device token table; before, none was)."""
    from mstar.runtime.conductor.request import Request
    from mstar.runtime.engine.torch_engine import TorchEngine
    from mstar.runtime.serve.driver import Driver, Workload

    plan = load_plan(str(GENERATED / "llama.plan"))
    engine = TorchEngine(plan, dims="spec", device="cuda", num_pages=256)
    driver = Driver(plan, engine)
    driver.run(Workload([Request(id="plain", prompt_tokens=[1, 2, 3], max_tokens=8),
                         Request(id="top_k", prompt_tokens=[1, 2, 3], max_tokens=8, temperature=1.0, top_k=2, seed=1),
                         Request(id="penalised", prompt_tokens=[1, 2, 3], max_tokens=8, **penalty)]))
    records = driver.conductor.records
    assert {r.finish_reason for r in records.values()} == {"length"}, records
    runner = engine.runners["LLM"]
    assert runner.executor.num_graph_steps > 0 and runner.num_ahead_rows > 0


def test_logprobs_come_back_from_the_device_with_their_tokens():
    """Log-probabilities on the device (StepExecutor.collect_logprobs): each token of a request that asks
    has its own and N alternatives', most likely first, the greedy token's the largest; a request
    beside it gets none; steps holding one are launched ahead and their rows claimed (the CPU fast
    path's tests compare the numbers with the reference runner's)."""
    import math

    from mstar.runtime.conductor.request import Request
    from mstar.runtime.engine.torch_engine import TorchEngine
    from mstar.runtime.serve.driver import Driver, Workload

    plan = load_plan(str(GENERATED / "llama.plan"))
    engine = TorchEngine(plan, dims="spec", device="cuda", num_pages=256)
    driver = Driver(plan, engine)
    driver.run(Workload([Request(id="plain", prompt_tokens=[1, 2, 3], max_tokens=8),
                         Request(id="greedy", prompt_tokens=[1, 2, 3], max_tokens=8, logprobs=5),
                         Request(id="sampled", prompt_tokens=[4, 5], max_tokens=8, temperature=1.0, seed=2,
                                 logprobs=1)]))
    records = driver.conductor.records
    assert {r.finish_reason for r in records.values()} == {"length"}, records
    assert not records["plain"].emission_logprobs
    for rid, count in (("greedy", 5), ("sampled", 1)):
        found = records[rid].emission_logprobs
        assert len(found) == 8, rid
        for own, top in found.values():
            values = [value for _, value in top]
            assert len(top) == count and values == sorted(values, reverse=True)
            assert math.isfinite(own) and own <= 0 and own <= values[0] + 1e-6
            assert math.log(sum(math.exp(v) for v in values)) <= 1e-4
            if rid == "greedy":
                assert own == pytest.approx(values[0], abs=1e-6)
    runner = engine.runners["LLM"]
    assert runner.executor.num_graph_steps > 0 and runner.num_claimed_rows > 0


def test_logit_bias_applies_on_the_device():
    """logit_bias on the device (executor: `sampling.bias_rule` after the penalties): +100 forces a
    token, and -100 on the tokens a greedy request picked keeps a second one, biased so, off them,
    beside a request without a bias; no step holding one is launched ahead (the CPU fast path's
    tests compare the tokens with the reference runner's)."""
    from mstar.runtime.conductor.request import Request
    from mstar.runtime.engine.torch_engine import TorchEngine
    from mstar.runtime.serve.driver import Driver, Workload

    plan = load_plan(str(GENERATED / "llama.plan"))
    engine = TorchEngine(plan, dims="spec", device="cuda", num_pages=256)

    def run(requests):
        driver = Driver(plan, engine)
        driver.run(Workload(requests))
        records = driver.conductor.records
        assert {r.finish_reason for r in records.values()} == {"length"}, records
        return {rid: r.output_tokens for rid, r in records.items()}

    first = run([Request(id="plain", prompt_tokens=[1, 2, 3], max_tokens=8),
                 Request(id="forced", prompt_tokens=[1, 2, 3], max_tokens=8, logit_bias=[(4242, 100.0)])])
    assert first["forced"] == [4242] * 8
    banned = sorted(set(first["plain"]))
    second = run([Request(id="plain", prompt_tokens=[1, 2, 3], max_tokens=8),
                  Request(id="banned", prompt_tokens=[1, 2, 3], max_tokens=8,
                          logit_bias=[(token, -100.0) for token in banned])])
    assert second["plain"] == first["plain"] and not set(second["banned"]) & set(banned)
    runner = engine.runners["LLM"]
    assert runner.executor.num_graph_steps > 0


def test_device_penalties_are_the_cpus():
    """`penalise` on the GPU gives what it gives on the CPU (the CPU fast path's tests compare that
    with the reference sampler) bit for bit, bf16 logits taken as fp32, from each device's own
    `PenaltyTable`, before and with a step launched ahead."""
    from types import SimpleNamespace

    from mstar.runtime.engine.gpu.penalties import PenaltyTable, penalise
    from mstar.runtime.engine.sampling import SamplingParams

    logits = (torch.randn(5, 1000, generator=torch.Generator().manual_seed(0)) * 3).to(torch.bfloat16).float()
    requests = [(1, SimpleNamespace(request_id="a", params=SamplingParams(repetition_penalty=1.3, presence_penalty=0.5),
                                    history={"LLM": [3, 9, 9]}, sampled={"LLM": [9, 4, 4]}), [7]),
                (3, SimpleNamespace(request_id="b", params=SamplingParams(frequency_penalty=-0.7),
                                    history={"LLM": [5]}, sampled={"LLM": [1, 1, 1, 999]}), [])]
    penalised = []
    for device in ("cuda", "cpu"):  # the Triton kernels (penalty_kernels.py) against the torch ops
        table = PenaltyTable(torch.device(device))
        loop_tokens = torch.tensor([4, 999], dtype=torch.int32, device=device)
        is_fused = device == "cuda"
        first = penalise(logits.to(device), table.rows(requests, "LLM"), table, loop_tokens, is_fused=is_fused)
        for _, request, _ in requests:  # a later step, launched ahead: its rows' last samples on the device
            request.sampled["LLM"].append(7)
        ahead = penalise(logits.to(device), table.rows(requests, "LLM", [0, 1]), table, loop_tokens,
                         is_fused=is_fused)
        penalised.append(torch.stack([first, ahead]).cpu())
        for _, request, _ in requests:
            request.sampled["LLM"].pop()
    assert torch.equal(penalised[0], penalised[1])
    assert not torch.equal(penalised[0][0], penalised[0][1])


def test_fused_kernels_match_the_torch_ops():
    """The step with the fused Triton kernels against the same step in torch ops (bf16, eager)."""
    executor = _executor([1, 2, 4, 8])
    assert executor.forward.is_fused
    rows = [RowSpec([3 + i, 5, 8 + i], 9 * i, list(range(4 * i, 4 * i + 4)), i) for i in range(3)]
    results = []
    for is_fused in (True, False):
        executor.forward.is_fused = is_fused
        logits = executor._run_eager(pack(rows, 16, executor.kv.dummy_page))[0]
        results.append((logits.clone(), executor.kv.data[:, :, :12].clone()))
    (fused, fused_cache), (plain, plain_cache) = results
    assert ((fused - plain).norm() / plain.norm()).item() < 2e-2
    assert ((fused_cache.float() - plain_cache.float()).norm() / plain_cache.float().norm()).item() < 1e-2
    assert fused.argmax(-1).tolist() == plain.argmax(-1).tolist()


def test_running_ahead_on_the_gpu_keeps_every_request_and_claims_rows():
    """The device runs the speculated step N+1 behind N (`launch_ahead`); every request ends as in a
    run without it, with as many tokens, and most decode rows take the result launched ahead.
    Tokens may differ where a row ran beside other rows (bf16 is not batch-invariant), so each
    request's first tokens, decided before any speculation, are compared."""
    from mstar.runtime.conductor.request import Request
    from mstar.runtime.engine.torch_engine import TorchEngine
    from mstar.runtime.serve.driver import Driver, Workload

    plan = load_plan(str(GENERATED / "llama.plan"))
    runs = {}
    for run_ahead in (False, True):
        engine = TorchEngine(plan, dims="spec", device="cuda", num_pages=1024, run_ahead=run_ahead)
        assert engine.caps.can_launch_ahead == run_ahead
        requests = [Request(id=f"r{i}", prompt_tokens=[1 + i, 2, 3], max_tokens=4 + 3 * i) for i in range(6)]
        driver = Driver(plan, engine)
        driver.run(Workload(requests))
        runs[run_ahead] = {rid: (r.finish_reason, r.num_output_tokens, list(r.output_tokens)[:1])
                           for rid, r in driver.conductor.records.items()}
        runner = engine.runners["LLM"]
        if run_ahead:
            assert runner.num_claimed_rows > runner.num_ahead_rows // 2 > 0
    assert runs[True] == runs[False]


@pytest.mark.parametrize("rows", [1, 64])
def test_fused_argmax_matches_torch_on_bf16_logits(rows):
    """`kernels.argmax_rows` (what the graphs' greedy tokens come from) against torch.argmax on
    Llama-3.2-1B's vocabulary, from bf16 logits (many ties: the first index wins in both)."""
    from mstar.runtime.engine.gpu import kernels

    torch.manual_seed(3)
    logits = torch.randn(rows, 128_256, device="cuda").to(torch.bfloat16).float()
    logits[0, [5, 70_000]] = 30.0  # a tie across chunks
    assert torch.equal(kernels.argmax_rows(logits), logits.argmax(-1))
