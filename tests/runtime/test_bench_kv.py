"""`mstar bench kv` runs its scenarios and prints figures that hold together (the sim engine, small
sizes); a device or dims for the simulator is refused with a message, not ignored."""
import json

import pytest

from mstar.runtime.serve import bench_kv


def test_bench_kv_on_the_sim_gives_both_variants_and_the_prefix_figures(capsys):
    assert bench_kv.main(["--decode-rows", "4", "--prompt-len", "512", "--prefix-requests", "3",
                          "--prefix-len", "256", "--json"]) == 0
    results = json.loads(capsys.readouterr().out)
    assert results["engine"] == "sim" and results["device"] == "cpu"
    chunked, whole = results["chunked"], results["whole"]
    assert chunked["token_budget"] and whole["token_budget"] is None
    assert chunked["ttft_ratio"] > 0 and whole["ttft_ratio"] > 0
    # The cache serves the whole shared prefix to every request after the first.
    assert results["prefix"]["cached_tokens"][1:] == [256, 256]
    assert results["prefix"]["ttft_ratio"] > 1
    # Two rounds by default, each a cached and an uncached run (their order alternating), each ratio > 1.
    assert results["prefix_rounds"] == 2 and len(results["prefix"]["round_ratios"]) == 2
    assert all(ratio > 1 for ratio in results["prefix"]["round_ratios"])
    for state in ("cached", "uncached"):  # min <= median <= max, the mean between min and max
        low, median, high = results["prefix"][f"ttft_{state}_range_ms"]
        assert low <= median <= high and low - 1e-3 <= results["prefix"][f"ttft_{state}_ms"] <= high + 1e-3


def test_the_slowest_steps_of_the_prefill_window_explain_its_largest_gap(capsys):
    """The slowest steps are sorted by their gap, the first is the largest inter-token gap the decode
    rows saw (every decode row gets a token each step), and the prompt's chunks show in them."""
    assert bench_kv.main(["--decode-rows", "4", "--prompt-len", "512", "--scenario", "chunk", "--no-whole",
                          "--json"]) == 0
    chunked = json.loads(capsys.readouterr().out)["chunked"]
    steps = chunked["slowest_steps_during"]
    assert 0 < len(steps) <= 5
    gaps = [step["gap_ms"] for step in steps]
    assert gaps == sorted(gaps, reverse=True)
    assert gaps[0] == pytest.approx(chunked["itl_max_during_ms"], rel=1e-6)
    assert any(step["walk_rows"].get("prefill") for step in steps)
    assert all(step["run_ms"] > 0 and step["tokens"] >= step["rows"] for step in steps)
    assert all(min(step["launch_ms"], step["wait_ms"], step["gc_ms"]) >= 0 for step in steps)


def test_a_device_for_the_simulator_is_refused(capsys):
    with pytest.raises(SystemExit) as stop:
        bench_kv.main(["--device", "cuda"])
    assert stop.value.code == 2
    assert "--engine torch" in capsys.readouterr().err


def test_the_route_what_if_changes_only_the_steps_that_mix_prompt_and_decode_rows(capsys):
    from mstar.plan.io import load_plan

    plan = load_plan("generated/llama_chunked.plan")
    packed = bench_kv.with_route(plan, "packed")  # the plan's combined walk says split
    before = [m.attention for w in plan.workers for k in w.keys for m in k.mixtures]
    after = [m.attention for w in packed.workers for k in w.keys for m in k.mixtures]
    assert "split" in before and "split" not in after
    assert [a for a in before if a not in ("packed", "split")] == [a for a in after if a not in ("packed", "split")]
    assert bench_kv.main(["--decode-rows", "4", "--prompt-len", "512", "--scenario", "chunk", "--route", "packed",
                          "--json"]) == 0
    results = json.loads(capsys.readouterr().out)
    assert results["route"] == "packed"
    # the decode rows got tokens while the prompt prefilled, and the figures say how spread they were
    assert results["chunked"]["itl_p50_during_ms"] <= results["chunked"]["itl_max_during_ms"]
    # and the steady window's median beside its p99 (which, like the prefill's, is about one step)
    assert 0 < results["chunked"]["itl_p50_steady_ms"] <= results["chunked"]["itl_p99_steady_ms"]


def test_no_whole_skips_the_reference_runs(capsys):
    assert bench_kv.main(["--decode-rows", "4", "--prompt-len", "512", "--scenario", "chunk", "--no-whole"]) == 0
    out = capsys.readouterr().out
    assert "chunked: decode ITL p99" in out and "whole" not in out
    assert "(steady: p50 " in out
    assert bench_kv.main(["--decode-rows", "4", "--prompt-len", "512", "--scenario", "chunk", "--no-whole",
                          "--json"]) == 0
    results = json.loads(capsys.readouterr().out)
    assert "chunked" in results and "whole" not in results


@pytest.mark.parametrize("argv", [["--per-row"], ["--engine", "torch", "--per-row"], ["--no-blas-pdl"],
                                  ["--engine", "torch", "--no-blas-pdl"], ["--engine", "torch", "--flashinfer-packed"],
                                  ["--engine", "torch", "--fold-norms"], ["--decode-merge-in-kernel"],
                                  ["--engine", "torch", "--reference-weights"]],
                         ids=["sim", "torch_cpu", "no_blas_pdl_sim", "no_blas_pdl_torch_cpu",
                              "flashinfer_packed_torch_cpu", "fold_norms_torch_cpu", "merge_in_kernel_sim",
                              "reference_weights_torch_cpu"])
def test_gpu_what_ifs_need_the_gpu_fast_path(argv, capsys):
    with pytest.raises(SystemExit) as stop:
        bench_kv.main(argv)
    assert stop.value.code == 2
    assert "--device cuda" in capsys.readouterr().err


def test_per_row_turns_the_fast_path_runners_columns_off(monkeypatch):
    """`--per-row` reaches the engine: its GPU fast-path runners run row by row (built here on the
    CPU, as the columns' equivalence tests build them), other runners are left alone."""
    import torch

    from mstar.plan.io import load_plan
    from mstar.runtime.engine import torch_engine
    from mstar.runtime.engine.gpu.device_model import build_decoder
    from mstar.runtime.engine.gpu.runner import GpuDecoderRunner, decode_family
    from mstar.runtime.engine.placement import CPU

    plan = load_plan("generated/llama_chunked.plan")
    real = torch_engine.TorchEngine

    def with_fast_runner(plan, **_kwargs):
        engine = real(plan, num_pages=64)
        name = plan.nodes[0].name
        reference = engine.runners[name]
        model = build_decoder(reference.dims, torch.device("cpu"), torch.float32, position=0, seed=0)
        engine.runners[name] = GpuDecoderRunner(plan.nodes[0], reference.dims, model, reference.pool.page_size, 64,
                                                reference.max_seq_len, 0, CPU, decode_family(plan, name),
                                                is_flashinfer=False)
        return engine

    monkeypatch.setattr(torch_engine, "TorchEngine", with_fast_runner)
    monkeypatch.setattr(torch_engine, "plan_glue", lambda *_args: None)
    for is_columnar in (True, False):
        engine = bench_kv._engine(plan, bench_kv.EngineChoice("torch", "cpu", "tiny", None, is_columnar))
        fast = [r for r in engine.runners.values() if isinstance(r, GpuDecoderRunner)]
        assert fast and all(r.is_columnar is is_columnar for r in fast)


def test_no_run_ahead_reaches_the_torch_engine(monkeypatch):
    """`--no-run-ahead` builds the torch engine with launch-ahead off (and only the torch engine)."""
    from mstar.runtime.engine import torch_engine

    seen = []

    class Recording:
        def __init__(self, plan, **kwargs):
            seen.append(kwargs["run_ahead"])
            raise SystemExit(0)

    monkeypatch.setattr(torch_engine, "TorchEngine", Recording)
    monkeypatch.setattr(torch_engine, "plan_glue", lambda *_args: None)
    from mstar.plan.io import load_plan

    plan = load_plan("generated/llama_chunked.plan")
    for can_run_ahead in (True, False):
        with pytest.raises(SystemExit):
            bench_kv._engine(plan, bench_kv.EngineChoice("torch", "cpu", "tiny", None, True, can_run_ahead))
    assert seen == [True, False]


def test_no_run_ahead_needs_the_torch_engine(capsys):
    with pytest.raises(SystemExit) as stop:
        bench_kv.main(["--no-run-ahead"])
    assert stop.value.code == 2
    assert "--engine torch" in capsys.readouterr().err


def test_the_cached_first_steps_need_device_events():
    """The third prefix run has no device step to time on the CPU (the torch engine there has no
    device executor): no step figures rather than made-up ones, only the host's path."""
    from mstar.plan.io import load_plan
    from mstar.runtime.serve.workload import Request

    plan = load_plan("generated/llama_chunked.plan")
    requests = [Request(id=f"p{i}", prompt_tokens=[3] * 40 + [i + 1] * 4, max_tokens=2) for i in range(2)]
    figures = bench_kv._cached_first_steps(plan, bench_kv.EngineChoice("torch", "cpu", "tiny"), requests)
    assert set(figures) == {"cached_host_timeline_ms"}
    assert dict(figures["cached_host_timeline_ms"])["first token"] > 0


@pytest.fixture
def prefix_run_order(monkeypatch) -> list[str]:
    """The prefix scenario's runs in order, each "cached" or "uncached"."""
    order: list[str] = []
    real = bench_kv._one_after_another

    def recorded(plan, built, requests):
        order.append("cached" if any(p.prefix_cache == "pages" for p in plan.deployment.kv_pools) else "uncached")
        return real(plan, built, requests)

    monkeypatch.setattr(bench_kv, "_one_after_another", recorded)
    return order


def test_prefix_rounds_alternate_the_order_and_pool_every_run(prefix_run_order):
    """Three rounds: cached first, uncached first, cached first; the pooled TTFTs hold every run's
    requests after the first, and each round's ratio is its own runs' means."""
    from mstar.plan.io import load_plan

    order = prefix_run_order
    plan = load_plan("generated/llama_chunked.plan")
    figures = bench_kv.prefix_scenario(plan, bench_kv.EngineChoice("sim"), 3, 64, rounds=3)
    assert order == ["cached", "uncached", "uncached", "cached", "cached", "uncached"]
    assert len(figures["round_ratios"]) == 3
    low, _, high = figures["ttft_cached_range_ms"]
    assert low - 1e-3 <= figures["ttft_cached_ms"] <= high + 1e-3  # the range is rounded to 3 places


def test_on_a_wall_clock_the_slowest_steps_hold_the_whole_prompts_step(capsys):
    """On the torch engine a step's logged end comes after its post-processing, past the long prompt's
    first token: the whole prompt's step, the window's largest gap, was left out of the list."""
    assert bench_kv.main(["--engine", "torch", "--scenario", "chunk", "--decode-rows", "4", "--prompt-len", "512",
                          "--budget", "128", "--json"]) == 0
    whole = json.loads(capsys.readouterr().out)["whole"]
    steps = whole["slowest_steps_during"]
    assert any(step["walk_rows"].get("prefill") for step in steps)
    assert steps[0]["gap_ms"] >= 0.9 * whole["itl_max_during_ms"]


def test_the_torch_engine_runs_each_prefix_run_once_uncounted_first(prefix_run_order, monkeypatch, capsys):
    """A process's first runs pay its one-time costs: on the CPU with a 256-token prefix the first
    round's uncached TTFTs were 2-3x the later ones'. One cached and one uncached run now come
    first, not counted (each run says so on stderr); the sim, whose clock is simulated, runs none."""
    from mstar.plan.io import load_plan

    order = prefix_run_order
    monkeypatch.setattr(bench_kv, "_cached_first_steps", lambda *_args: {})
    plan = load_plan("generated/llama_chunked.plan")
    figures = bench_kv.prefix_scenario(plan, bench_kv.EngineChoice("torch", "cpu", "tiny"), 2, 32, rounds=1)
    assert order == ["cached", "uncached", "cached", "uncached"] and len(figures["round_ratios"]) == 1
    err = capsys.readouterr().err
    assert err.count("(warm-up, not counted)") == 2 and "round 1 of 1, cached" in err
    order.clear()
    bench_kv.prefix_scenario(plan, bench_kv.EngineChoice("sim"), 2, 32, rounds=1)
    assert order == ["cached", "uncached"]


def test_the_torch_engine_runs_each_chunk_variant_once_uncounted_first(monkeypatch, capsys):
    runs: list[object] = []

    def recorded(plan, engine, *_args):
        runs.append(bench_kv.budget_and_scale(plan)[0])
        return {"counted": len(runs)}

    monkeypatch.setattr(bench_kv, "chunk_scenario", recorded)
    monkeypatch.setattr(bench_kv, "_print", lambda results: None)
    assert bench_kv.main(["--engine", "torch", "--scenario", "chunk", "--no-flat", "--budget", "128"]) == 0
    assert runs == [128, 0, 128, 0]  # chunked, whole (no budget); then counted in the same order
    assert capsys.readouterr().err.count("(warm-up, not counted)") == 2
    runs.clear()
    assert bench_kv.main(["--scenario", "chunk", "--no-flat", "--budget", "128"]) == 0
    assert runs == [128, 0]
