"""The GPU fast path's logic on the CPU (fp32, torch attention over FlashInfer's CSR arrays):
packing, the flat forward, the device token table (loop-back), device sampling and the runner,
against the reference `DecoderRunner`. Graphs and FlashInfer run only in tests/gpu/."""
import dataclasses

import numpy as np
import pytest
import torch

from engine_plans import generate, llm_plan
from mstar.plan.dims import RopeScaling
from mstar.runtime.engine.gpu.device_model import build_decoder, unsupported_reason
from mstar.runtime.engine.gpu.packing import RowSpec, pack
from mstar.runtime.engine.gpu.runner import decode_family, fast_path_reason, packed_families
from mstar.runtime.engine.gpu.sampler import hashed_uniform, sample
from mstar.runtime.engine.models.kinds import call_table
from mstar.runtime.engine.torch_engine import TorchEngine
from fast_path_cpu import fast_path_engine, run_asks


def _fast_engine(plan, num_pages=64):
    """A CPU engine whose LLM runner is the fast path's, in fp32 with the reference's weights."""
    return fast_path_engine(plan, num_pages, max_seq_len=4096, with_decode_family=False)[0]


SHARED_PREFIX_PAGES, SHARED_PREFIX_POOL = 20, 40  # 8 rows x 21 pages a step over a pool of 40 pages


def shared_prefix_run(glue=None, is_planned=True) -> tuple[dict[str, tuple], dict[str, tuple], list[int], int]:
    """Eight requests on one 320-token prefix (20 pages of 16) with a prefix cache, through the
    run loop on the fast path's runner with the CPU stand-ins of its decode graphs and FlashInfer
    wrappers (graph_standins), numpy- or glue-packed: (its outcome, the reference's without the
    cache, each step's sum of page-table lengths, the decode graph steps). Each decode row holds
    the 20 shared pages and one of its own, so a step of 8 rows indexes 168 pages of a 40-page pool."""
    import graph_standins
    from mstar.plan.io import load_plan
    from mstar.runtime.conductor.request import Request
    from mstar.runtime.serve.driver import Driver, Workload
    from test_prefix_cache import ROOT, with_prefix_cache

    plan = load_plan(ROOT / "generated" / "llama_chunked.plan", verify=False)
    assert {pool.prefix_cache for pool in plan.deployment.kv_pools} == {"pages"}
    prefix = [(7 * i) % 500 for i in range(16 * SHARED_PREFIX_PAGES)]
    # The first request fills the cache; the others arrive once its prompt is in.
    requests = [Request(id=f"p{i}", prompt_tokens=prefix + [(11 * i + j) % 500 for j in range(3)], max_tokens=5,
                        arrival_s=0.0 if i == 0 else 0.05) for i in range(8)]
    engine, runner = fast_path_engine(plan, SHARED_PREFIX_POOL, max_seq_len=4096, prefix_cache=True,
                                      packed=packed_families(plan, "LLM"), glue=glue)
    graph_standins.install(runner.executor, is_planned)
    page_sums: list[int] = []
    launch = runner.executor.launch

    def counting_launch(rows, *args, **kwargs):
        page_sums.append(sum(len(row.page_table) for row in rows))
        return launch(rows, *args, **kwargs)

    runner.executor.launch = counting_launch

    def outcome(plan, engine) -> dict[str, tuple]:
        driver = Driver(plan, engine)
        driver.run(Workload(requests))
        return {rid: (r.finish_reason, list(r.output_tokens), r.num_cached_tokens)
                for rid, r in driver.conductor.records.items()}

    off = with_prefix_cache(plan, "off")
    expected = outcome(off, TorchEngine(off, num_pages=8 * (SHARED_PREFIX_PAGES + 1)))
    return outcome(plan, engine), expected, page_sums, runner.executor.num_graph_steps


@pytest.mark.parametrize("is_planned", [True, False], ids=["flashinfer", "triton"])
def test_decode_graph_steps_hold_rows_sharing_a_long_prefix(is_planned):
    """Rows sharing prefix pages index more pages in a step than the pool holds: the decode
    graph's page-index buffer is sized by rows x pages of the longest sequence, not by the pool.
    Unplanned (the Triton decode kernel's graphs): the staged arrays alone carry the step."""
    got, expected, page_sums, num_graph_steps = shared_prefix_run(is_planned=is_planned)
    assert {rid: (reason, tokens) for rid, (reason, tokens, _) in got.items()} == \
        {rid: (reason, tokens) for rid, (reason, tokens, _) in expected.items()}
    assert [got[f"p{i}"][2] for i in range(8)] == [0] + [16 * SHARED_PREFIX_PAGES] * 7  # the prefix was shared
    assert max(page_sums) > SHARED_PREFIX_POOL + 64 and num_graph_steps > 0  # past the old pool + batch bound


def test_device_model_has_the_reference_weights():
    engine = TorchEngine(llm_plan())
    reference = engine.runners["LLM"].model
    model = build_decoder(engine.runners["LLM"].dims, torch.device("cpu"), torch.float32, position=0, seed=0)
    for (name, expected), (other, got) in zip(reference.named_parameters(), model.named_parameters()):
        assert name == other and torch.equal(expected, got), name


def test_random_on_device_switch_chooses_the_generator_of_decoders_built_after_it(monkeypatch):
    """`mstar bench kv` on a GPU draws its engines' weights with the device's generator (seconds of
    host draws saved an engine); everything else keeps the CPU reference's host draws. (On the CPU
    the two give the same values, so what is checked is which draw ran.)"""
    from mstar.runtime.engine.gpu import device_model

    host_drawn: list[int] = []
    real_draw = device_model._draw_on_host
    monkeypatch.setattr(device_model, "_draw_on_host",
                        lambda draws, seed, position: (host_drawn.append(len(draws)), real_draw(draws, seed, position)))
    engine = TorchEngine(llm_plan())
    reference, dims = engine.runners["LLM"].model, engine.runners["LLM"].dims
    device_model.set_random_on_device(True)
    try:
        drawn = build_decoder(dims, torch.device("cpu"), torch.float32, position=0, seed=0)
        on_device = host_drawn[-1]
        again = build_decoder(dims, torch.device("cpu"), torch.float32, position=0, seed=0)
        build_decoder(dims, torch.device("cpu"), torch.float32, position=0, seed=0, is_fast_random=False)
        forced = host_drawn[-1]
    finally:
        device_model.set_random_on_device(False)
    after = build_decoder(dims, torch.device("cpu"), torch.float32, position=0, seed=0)
    num_matrices = sum(1 for value in reference.parameters() if value.dim() >= 2)
    assert (on_device, forced, host_drawn[-1]) == (0, num_matrices, num_matrices)
    assert all(torch.equal(a, b) for a, b in zip(drawn.parameters(), again.parameters()))  # still seeded
    assert all(torch.equal(a, b) for a, b in zip(reference.parameters(), after.parameters()))


def test_packing_lays_out_rows_and_padding():
    rows = [RowSpec([5, 6, 7], 0, [3], 0), RowSpec(None, 17, [1, 4], 2)]
    packed = pack(rows, 16, 9, padded_rows=4, padded_tokens=8)
    ids, pos, slots, src, last, row_slot = np.split(packed.host, np.cumsum(packed.field_sizes())[:-1])
    assert ids.tolist() == [5, 6, 7, 0, 0, 0, 0, 0]
    assert pos.tolist() == [0, 1, 2, 17, 0, 0, 0, 0]
    assert slots.tolist() == [48, 49, 50, 4 * 16 + 1] + [9 * 16] * 4  # padding writes the dummy page
    assert src.tolist() == [-1, -1, -1, 2, -1, -1, -1, -1]
    assert last.tolist() == [2, 3, 4, 5] and row_slot.tolist() == [0, 2, 0, 0]
    assert packed.qo_indptr.tolist() == [0, 3, 4, 5, 6]
    assert packed.kv_indptr.tolist() == [0, 1, 3, 4, 5]
    assert packed.kv_indices.tolist() == [3, 1, 4, 9, 9]
    assert packed.last_page_len.tolist() == [3, 2, 1, 1]


def test_fast_runner_follows_the_reference_greedy_tokens():
    plan = llm_plan()
    prompts = {f"r{i}": [1 + i, 7, 3 + 2 * i, 11][: 2 + i % 3] for i in range(5)}
    expected = generate(TorchEngine(plan), prompts, 8, start_every=1)
    got = generate(_fast_engine(plan), prompts, 8, start_every=1)
    assert got == expected


def test_loop_back_tokens_stay_on_the_device():
    """A decode row the conductor sends without its token is fed from the device token table."""
    from mstar.runtime.conductor.request import Request
    from engine_plans import step
    from mstar.runtime.step import StepRow

    plan = llm_plan()
    runs = []
    for is_device in (False, True):
        engine = _fast_engine(plan)
        engine.add_request("a", Request(id="a", prompt_tokens=[4, 5, 6], max_tokens=5))
        tokens = [engine.run_step(step(engine.plan, "LLM", [StepRow("a", "prefill", 3, 0, {"text_inputs": [4, 5, 6]})]))
                  .rows[0].outputs["new_token"][0]]
        for _ in range(3):
            inputs = {} if is_device else {"text_inputs": [tokens[-1]]}
            result = engine.run_step(step(engine.plan, "LLM", [StepRow("a", "decode", 1, 0, inputs)]))
            tokens.append(result.rows[0].outputs["new_token"][0])
        runs.append(tokens)
    assert runs[0] == runs[1]


def test_device_sampling_is_seeded_per_row_and_follows_top_p():
    torch.manual_seed(0)
    logits = torch.randn(3, 50)
    temperature = torch.tensor([0.0, 1.0, 1.0])
    top_p = torch.tensor([1.0, 1.0, 1e-6])
    seeds, counters = torch.tensor([1, 2, 3]), torch.tensor([0, 0, 0])
    first = sample(logits, temperature, top_p, seeds, counters)
    assert first[0] == logits[0].argmax() and first[2] == logits[2].argmax()  # greedy; top_p keeps the top
    assert torch.equal(first, sample(logits, temperature, top_p, seeds, counters))
    draws = [int(sample(logits[1:2], temperature[1:2], top_p[1:2], seeds[1:2], torch.tensor([c])))
             for c in range(400)]
    assert len(set(draws)) > 10  # fresh draws per counter
    probs = torch.softmax(logits[1], -1)
    top = int(probs.argmax())
    assert abs(draws.count(top) / 400 - float(probs[top])) < 0.08
    u = hashed_uniform(seeds, counters, 1000)
    assert float(u.min()) > 0 and float(u.max()) < 1 and abs(float(u.mean()) - 0.5) < 0.02


def test_device_sampling_keeps_the_cpu_samplers_tokens_under_top_k_and_top_p():
    """The device sampler ignored top_k (a GPU request with top_k=2 drew from the whole nucleus).
    Now every row draws only tokens the CPU sampler keeps for the same top_k and top_p, top_k 1 is
    the argmax, and top_k 0 is no limit."""
    from mstar.runtime.engine.sampling import SamplingParams, sample_tokens

    logits = torch.randn(4, 40, generator=torch.Generator().manual_seed(5)) * 2
    temperature = torch.ones(4)
    top_k, top_p = torch.tensor([1, 3, 0, 5]), torch.tensor([1.0, 1.0, 0.6, 0.5])
    seeds = torch.tensor([1, 2, 3, 4])
    device = [set() for _ in range(4)]
    cpu = [set() for _ in range(4)]
    params = [SamplingParams(temperature=1.0, top_k=int(k), top_p=float(p)) for k, p in zip(top_k, top_p)]
    for counter in range(300):
        for row, token in enumerate(sample(logits, temperature, top_p, seeds, torch.full((4,), counter), top_k)):
            device[row].add(int(token))
        for row, token in enumerate(sample_tokens(logits, params, [torch.tensor([], dtype=torch.long)] * 4,
                                                  [row + 1 for row in range(4)], [counter] * 4)):
            cpu[row].add(token)
    assert device[0] == {int(logits[0].argmax())}
    assert device == cpu and len(device[1]) == 3 and len(device[2]) > 3  # every kept token drawn, no other
    without = {int(sample(logits[2:3], temperature[:1], top_p[2:3], seeds[2:3], torch.tensor([c]))) for c in range(300)}
    assert without == device[2]  # top_k 0: the same as no top_k


def test_device_sampling_over_the_whole_vocabulary_needs_no_sort():
    """Rows that limit nothing (top_p 1, no top_k) draw by Gumbel-max over every token
    (`is_whole`, no sort of the vocabulary): the tokens the sorted path draws, counter for counter,
    greedy rows their argmax."""
    logits = torch.randn(5, 60, generator=torch.Generator().manual_seed(7)) * 2
    temperature, top_p = torch.tensor([0.0, 0.5, 1.0, 1.5, 3.0]), torch.ones(5)
    seeds = torch.tensor([1, 2, 3, 4, 5])
    drawn = set()
    for counter in range(200):
        counters = torch.full((5,), counter)
        whole = sample(logits, temperature, top_p, seeds, counters, is_whole=True)
        assert torch.equal(whole, sample(logits, temperature, top_p, seeds, counters))
        drawn.add(int(whole[4]))
    assert len(drawn) > 10  # (a hot row draws widely: the test compares real draws)


def test_device_sampling_of_bf16_logits_is_that_of_their_fp32_copy():
    """A GPU step's logits come in bf16 (forward.py): the sampler computes in fp32 from them, so
    bf16 logits sample exactly what their fp32 copy does (greedy and drawn rows, every counter)."""
    logits = (torch.randn(4, 300, generator=torch.Generator().manual_seed(3)) * 4).to(torch.bfloat16)
    temperature, top_p = torch.tensor([0.0, 0.7, 1.0, 1.3]), torch.tensor([1.0, 0.9, 0.5, 1.0])
    seeds = torch.tensor([5, 6, 7, 8])
    for counter in range(20):
        counters = torch.full((4,), counter)
        assert torch.equal(sample(logits, temperature, top_p, seeds, counters),
                           sample(logits.float(), temperature, top_p, seeds, counters))


def test_fast_path_reasons():
    plan = llm_plan()
    calls = call_table(plan)
    assert fast_path_reason(plan.nodes[0], calls) is None
    assert decode_family(plan, "LLM") is None  # a hand-built plan lists no captures
    dims = TorchEngine(plan).runners["LLM"].dims
    assert unsupported_reason(dims) is None
    dynamic = dataclasses.replace(dims, rope=RopeScaling(kind="dynamic", factor=2.0, max_position=64))
    assert "dynamic NTK" in unsupported_reason(dynamic)


PENALTIES = [dict(repetition_penalty=1.3), dict(presence_penalty=1.5), dict(frequency_penalty=0.7),
             dict(presence_penalty=-2.0, frequency_penalty=0.4, repetition_penalty=0.8),
             dict(presence_penalty=1.0, temperature=0.9, top_k=20, seed=5), {}]


@pytest.mark.parametrize("plan_name, can_run_ahead", [("llm", False), ("llm", True), ("llama_chunked", True)])
def test_fast_runner_samples_with_the_references_penalties(plan_name, can_run_ahead):
    """The repetition, presence and frequency penalties on the fast path (gpu/penalties.py; it
    refused the repetition penalty and the others) give the reference runner's tokens: greedy rows
    and a sampled one beside rows without a penalty, run ahead or not, prompts whole or in chunks
    (llama_chunked cuts the 40-token prompts). Steps holding penalised rows run ahead too: their
    penalties count the token not yet collected from the device token table (`PenaltyRows.pending`;
    before, no such step was launched ahead)."""
    from mstar.plan.io import load_plan
    from test_prefix_cache import ROOT

    plan = llm_plan() if plan_name == "llm" else load_plan(ROOT / "generated" / "llama_chunked.plan", verify=False)
    prompt_len = 4 if plan_name == "llm" else 40

    def run(engine):
        return {rid: (r.output_tokens, r.finish_reason)
                for rid, r in run_asks(plan, engine, PENALTIES, prompt_len, 24).items()}

    runners = []

    def fast():
        engine, runner = fast_path_engine(plan, 64, max_seq_len=4096, with_decode_family=False,
                                          can_run_ahead=can_run_ahead)
        runners.append(runner)
        return run(engine)

    got, expected = fast(), run(TorchEngine(plan, num_pages=64))
    if plan_name == "llama_chunked":  # (the llm plan's run loop launches nothing ahead, penalised or not)
        assert runners[0].num_ahead_rows > 0  # and every step held a penalised row
    sampled = "r4"  # the device sampler draws from its own hash, not the CPU's: the same again, not the same
    assert got.pop(sampled) == fast()[sampled] and expected.pop(sampled)[1] == "length"
    assert got == expected
    assert {reason for _, reason in got.values()} == {"length"}
    assert len({tuple(tokens) for tokens, _ in got.values()}) > 1


@pytest.mark.parametrize("temperature", [0.8])
def test_fast_runner_samples_with_a_temperature(temperature):
    from mstar.runtime.conductor.request import Request
    from engine_plans import step
    from mstar.runtime.step import StepRow

    outs = []
    for _ in range(2):
        engine = _fast_engine(llm_plan())
        engine.add_request("a", Request(id="a", prompt_tokens=[1, 2], max_tokens=3, temperature=temperature, seed=7))
        result = engine.run_step(step(engine.plan, "LLM", [StepRow("a", "prefill", 2, 0, {"text_inputs": [1, 2]})]))
        outs.append(result.rows[0].outputs["new_token"])
    assert outs[0] == outs[1]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without a GPU")
def test_bench_engine_refuses_cleanly_without_a_gpu(capsys):
    from mstar.cli.mstar import main

    assert main(["bench", "engine", "--json"]) == 1
    captured = capsys.readouterr()
    assert "needs a CUDA GPU" in captured.err and captured.out == ""
