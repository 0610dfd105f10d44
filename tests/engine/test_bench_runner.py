"""`mstar bench runner` runs the fast path's runner on a stubbed device and prints its figures
(a command, not a timed test): the parts of a full decode step, bytecodes per row, run-ahead claims."""
import json
from pathlib import Path

import pytest

from mstar.cli.mstar import main

PLAN = Path(__file__).resolve().parents[2] / "generated" / "llama.plan"
CHUNKED = PLAN.parent / "llama_chunked.plan"
SMALL = ["--plan", str(PLAN), "--clients", "4", "--prompt-len", "5", "--output-len", "6", "--rounds", "1"]


def test_prints_both_variants_and_bytecodes(capsys):
    assert main(["bench", "runner", *SMALL]) == 0
    out = capsys.readouterr().out
    assert "ahead columns decode     us/step p50" in out and "no-ahead columns decode  us/step p50" in out
    assert "bytecodes/row" in out and "rows launched ahead claimed" in out


def test_no_ratio_where_no_row_ran_ahead(capsys):
    """One client with two tokens launches nothing ahead: both variants ran the same path, and a
    ratio of their times (1.07x) read as a difference."""
    argv = ["bench", "runner", "--plan", str(PLAN), "--clients", "1", "--output-len", "2", "--rounds", "1",
            "--no-bytecodes"]
    assert main([*argv, "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["variants"]["ahead"]["rows_launched_ahead"] == 0 and result["ahead_over_no_ahead"] is None
    assert main(argv) == 0
    assert "none (no row ran ahead: both ran the same path)" in capsys.readouterr().out


def test_json_counts_every_part_and_run_ahead_claims_rows(capsys):
    assert main(["bench", "runner", *SMALL, "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    ahead, serial = result["variants"]["ahead"], result["variants"]["no-ahead"]
    assert all(ahead["bytecodes_per_row"][part] > 0 for part in ("launch", "wait", "launch_ahead"))
    assert serial["bytecodes_per_row"]["launch_ahead"] == 0  # nothing launched ahead without run-ahead
    assert ahead["rows_claimed"] > 0 and serial["rows_launched_ahead"] == 0
    assert result["ahead_over_no_ahead"] > 0
    slow = ahead["total_us_per_step"]
    assert 0 < ahead["p50_us_per_step"]["total"] <= slow["p90"] <= slow["largest"]


def test_sampling_settings_reach_the_runner_and_cost_more_than_greedy(capsys):
    """--sampling: penalised clients and clients asking for log-probabilities (which the stand-in
    answers) run ahead, each costing more bytecodes a row than greedy clients (the per-row path,
    not the columns)."""
    rows = {}
    for name, sampling in (("greedy", "{}"), ("penalty", '{"repetition_penalty": 1.1}'),
                           ("logprobs", '{"logprobs": 2}')):
        assert main(["bench", "runner", *SMALL, "--json", "--sampling", sampling]) == 0
        ahead = json.loads(capsys.readouterr().out)["variants"]["ahead"]
        assert ahead["rows_claimed"] > 0, name
        rows[name] = sum(ahead["bytecodes_per_row"].values())
    assert rows["penalty"] > rows["greedy"] and rows["logprobs"] > rows["greedy"], rows


@pytest.mark.parametrize("sampling, words", [("[1]", "expected a JSON object of"), ('{"stop": 1}', "expected a JSON"),
                                             ('{"logprobs": 99}', "logprobs must be in [0, 20]"), ("{", "JSON object")])
def test_bad_sampling_settings_are_refused(capsys, sampling, words):
    with pytest.raises(SystemExit):
        main(["bench", "runner", *SMALL, "--sampling", sampling])
    assert words in capsys.readouterr().err


@pytest.mark.parametrize("argv, fragment", [(["--rounds", "0"], "argument --rounds: must be between"),
                                            (["--plan", "/nonexistent.plan"], "does not exist"),
                                            (["--plan", str(PLAN.parent / "pi05.plan")], "fast path takes")])
def test_bad_arguments_are_one_line_errors(capsys, argv, fragment):
    if argv[0] == "--rounds":
        with pytest.raises(SystemExit):
            main(["bench", "runner", *argv])
    else:
        assert main(["bench", "runner", *argv, "--rounds", "1", "--no-bytecodes"]) == 1
    assert fragment in capsys.readouterr().err


def test_failed_requests_are_named_not_taken_for_a_short_run(capsys, monkeypatch):
    """A fault in the run (here the stand-in executor's launch) fails the requests; the bench says
    so with the first failure instead of reporting that no full step ran."""
    from mstar.runtime.serve import bench_runner

    def broken(self, rows, *args, **kwargs):
        raise ValueError("the stand-in broke")

    monkeypatch.setattr(bench_runner.StubExecutor, "launch", broken)
    assert main(["bench", "runner", *SMALL, "--no-bytecodes"]) == 1
    err = capsys.readouterr().err
    assert "requests failed" in err and "the stand-in broke" in err


def test_failed_requests_with_a_long_prompt_due_end_the_run(capsys, monkeypatch):
    """With `--long-prompt` the run clock counts full decode steps: clients that fail before the
    long prompt is due stopped that clock, and the run waited for it for ever. Now the prompt comes
    at once and the bench says which requests failed."""
    import threading

    from mstar.runtime.serve import bench_runner

    def broken(self, pending):
        raise ValueError("the stand-in broke")

    monkeypatch.setattr(bench_runner.StubExecutor, "collect", broken)
    status = []
    argv = ["bench", "runner", "--plan", str(CHUNKED), "--clients", "4", "--prompt-len", "5", "--output-len", "24",
            "--rounds", "1", "--long-prompt", "300", "--budget", "48", "--no-bytecodes"]
    worker = threading.Thread(target=lambda: status.append(main(argv)), daemon=True)
    worker.start()
    worker.join(120)
    assert status == [1], "the run did not end"
    err = capsys.readouterr().err
    assert "requests failed" in err and "the stand-in broke" in err


def test_per_row_and_cpu_time_compare_the_runners_steps_in_one_tree(capsys):
    """`--per-row` runs steady decode steps row by row (more bytecodes a row than the columns);
    `--cpu-time` says which clock timed the parts."""
    figures = {}
    for flags in ([], ["--per-row", "--cpu-time"]):
        assert main(["bench", "runner", *SMALL, "--json", *flags]) == 0
        result = json.loads(capsys.readouterr().out)
        figures[result["steps"]] = result["variants"]["ahead"]["bytecodes_per_row"]["total"]
        assert result["clock"] == ("thread cpu" if flags else "wall")
    assert figures["per-row"] > figures["columns"] > 0


def test_long_prompt_reports_chunk_steps_and_compares_with_the_per_row_path(capsys):
    """`--long-prompt`: a prompt cut by the step token budget runs in chunk steps beside the
    clients' decode rows, reported apart; `--compare` runs the per-row path too and gives the
    ratio; the columns run the chunk steps' decode rows (fewer bytecodes a row than per-row)."""
    argv = ["bench", "runner", "--plan", str(CHUNKED), "--clients", "6", "--prompt-len", "5", "--output-len", "24",
            "--rounds", "1", "--long-prompt", "300", "--budget", "48", "--compare"]
    assert main([*argv, "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["budget"] == 48 and result["long_prompt"] == 300
    for variant in ("ahead", "no-ahead"):
        columns = result["variants"][variant]["chunk_steps"]
        per_row = result["per_row_variants"][variant]["chunk_steps"]
        assert columns["rows_per_step"] == per_row["rows_per_step"] == 7  # the chunk beside 6 decode rows
        assert columns["bytecodes_per_row_p50_step"] < 0.9 * per_row["bytecodes_per_row_p50_step"]
        ratios = result["columns_over_per_row"][variant]
        assert set(ratios) == {"decode", "chunk"} and ratios["chunk"]["bytecodes"] < 0.9
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "ahead columns chunk" in out and "no-ahead per-row chunk" in out and "columns / per-row, ahead" in out


def test_long_prompt_needs_a_step_token_budget(capsys):
    assert main(["bench", "runner", *SMALL, "--long-prompt", "100", "--no-bytecodes"]) == 1
    assert "cuts no prompt into chunks" in capsys.readouterr().err


def test_the_stubbed_runner_shares_prefix_pages_as_the_plan_says():
    """The bench's fast-path runner keeps the plan's prefix cache (llama_chunked: pages; llama:
    none), so a second request with the first one's 64 leading tokens starts on its cached pages,
    as in the engine the bench stands in for."""
    from mstar.plan.io import load_plan
    from mstar.runtime.conductor.request import Request
    from mstar.runtime.serve.bench_runner import build_engine
    from mstar.runtime.serve.driver import Driver, Workload

    generated = Path(__file__).resolve().parents[2] / "generated"
    _, plain = build_engine(load_plan(str(generated / "llama.plan")), True, 256)
    assert plain.pool.cache is None
    plan = load_plan(str(generated / "llama_chunked.plan"))
    engine, runner = build_engine(plan, True, 256)
    assert runner.pool.cache is not None
    prefix = [(5 * i) % 400 + 1 for i in range(64)]
    requests = [Request(id=f"q{i}", prompt_tokens=prefix + [i + 1] * 4, max_tokens=2) for i in range(2)]
    driver = Driver(plan, engine)
    driver.run(Workload(requests, closed_concurrency=1))
    assert [driver.conductor.records[r.id].num_cached_tokens for r in requests] == [0, 64]


@pytest.mark.parametrize("argv, words", [
    (["--clients", "65"], "a step of LLM:mixed holds at most 64 rows, so no decode step of 65 rows runs"),
    # the engine sized for these clients' pages failed to allocate first: "internal error (KvCacheError ...)"
    (["--clients", "100000", "--prompt-len", "100000", "--output-len", "100000"], "give --clients 64 or fewer"),
])
def test_clients_no_step_holds_are_refused_before_an_engine_is_built(capsys, monkeypatch, argv, words):
    from mstar.runtime.serve import bench_runner

    def built(*args, **kwargs):
        raise AssertionError("an engine was built")

    monkeypatch.setattr(bench_runner, "TorchEngine", built)
    assert main(["bench", "runner", "--plan", str(PLAN), "--rounds", "1", "--no-bytecodes", *argv]) == 1
    err = capsys.readouterr().err
    assert words in err and "an engine was built" not in err and "Traceback" not in err, err


def test_the_fast_node_is_read_from_the_plan_as_the_engine_picks_it():
    """`fast_node` reads the plan alone; the engine then runs that node's `DecoderRunner`."""
    from mstar.plan.io import load_plan
    from mstar.runtime.serve.bench_errors import BenchError
    from mstar.runtime.serve.bench_runner import build_engine, fast_node

    for name in ("llama", "qwen3_5"):
        plan = load_plan(str(PLAN.parent / f"{name}.plan"))
        _, runner = build_engine(plan, True, 64)
        assert fast_node(plan) == runner.node.name == "LLM"
    for name in ("whisper", "pi05", "bagel"):  # cross-attention, no decoder, guidance sequences
        with pytest.raises(BenchError, match="no decoder node the GPU fast path takes"):
            fast_node(load_plan(str(PLAN.parent / f"{name}.plan")))
