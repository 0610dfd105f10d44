"""`mstar run` and `mstar bench scheduler` through the CLI entry point."""
import json

from mstar.cli.mstar import main
from mstar.runtime.serve.results import media_name

from runtime_plans import ROOT

ORPHEUS = str(ROOT / "generated" / "orpheus.plan")


def test_missing_plan_exits_1_with_a_message(capsys, tmp_path):
    assert main(["run", "--plan", str(tmp_path / "nope.plan"), "--engine", "sim"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("mstar: error:") and "Traceback" not in err


def test_corrupt_plan_exits_1_with_a_message(capsys, tmp_path):
    bad = tmp_path / "bad.plan"
    bad.write_text('{"header": 3}')
    assert main(["run", "--plan", str(bad), "--engine", "sim"]) == 1
    err = capsys.readouterr().err
    assert "mstar: error:" in err and "Traceback" not in err


def test_sim_run_200_requests_with_report_timeline_and_outputs(capsys, tmp_path):
    report, timeline, out = tmp_path / "r.json", tmp_path / "t.png", tmp_path / "out"
    code = main(["run", "--plan", ORPHEUS, "--engine", "sim", "--requests", "200", "--no-progress",
                 "--report", str(report), "--timeline", str(timeline), "--out", str(out)])
    assert code == 0
    printed = capsys.readouterr().out
    assert "requests/s" in printed and "TTFT" in printed
    summary = json.loads(report.read_text())
    assert summary["num_requests"] == 200 and summary["num_completed"] == 200
    assert {"p50", "p90", "p99"} <= set(summary["ttft_ms"]) and summary["tokens_per_s"] > 0
    assert "LLM:mixed" in summary["step_composition"]
    assert timeline.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    lines = (out / "outputs.jsonl").read_text().splitlines()
    assert len(lines) == 200
    first = json.loads(lines[0])
    assert set(first) == {"id", "output_tokens", "text", "ttft_ms", "finish_reason", "media"}
    assert first["text"] is None  # no tokenizer in this run
    assert first["media"] == [media_name(first["id"], ".wav")] and (out / first["media"][0]).exists()


def test_prompts_file_runs_and_bad_lines_are_named(capsys, tmp_path):
    good = tmp_path / "p.jsonl"
    good.write_text('{"id": "a", "prompt_tokens": [1, 2, 3], "max_tokens": 5}\n\n'
                    '{"id": "b", "prompt_tokens": [4], "max_tokens": 3, "temperature": 0.7, "top_p": 0.9, "seed": 1}\n')
    assert main(["run", "--plan", ORPHEUS, "--engine", "sim", "--prompts", str(good), "--no-progress"]) == 0
    assert "2 (2 ok, 0 failed)" in capsys.readouterr().out
    for text, expected in [
        ('{"id": "a", "prompt_tokens": [1], "max_tokens": 5}\n{"id": "b", "max_tokens": 5}\n',
            "p.jsonl:2: missing required field 'prompt_tokens'"),
        ('{"id": "a", "prompt_tokens": [1], "max_tokens": 0}\n', "'max_tokens' must be >= 1"),
        # orpheus's LLM makes at most 2049 (plan/output_bound.py): such a request ended `length` there
        ('{"id": "a", "prompt_tokens": [1], "max_tokens": 3000}\n',
            "p.jsonl:1: 'max_tokens' 3000 is more than this plan makes for a request: at most 2049 output tokens"),
        ('{"id": "a", "prompt_tokens": "hi", "max_tokens": 3}\n', "field 'prompt_tokens' must be list"),
        ('not json\n', "p.jsonl:1: not valid JSON"),
        ('{"id": "a", "prompt_tokens": [1], "max_tokens": 3, "colour": 1}\n', "unknown field(s) ['colour']"),
        ('{"id": "a", "prompt_tokens": [1], "max_tokens": 3}\n{"id": "a", "prompt_tokens": [1], "max_tokens": 3}\n',
            "duplicate id 'a'"),
    ]:
        good.write_text(text)
        assert main(["run", "--plan", ORPHEUS, "--engine", "sim", "--prompts", str(good)]) == 1
        err = capsys.readouterr().err
        assert expected in err and "Traceback" not in err, err


def test_bad_ranges_and_routes_exit_1(capsys):
    assert main(["run", "--plan", ORPHEUS, "--engine", "sim", "--prompt-len", "9..3"]) == 1
    assert "--prompt-len: need 1 <= A <= B" in capsys.readouterr().err
    assert main(["run", "--plan", ORPHEUS, "--engine", "sim", "--route", "nonsense"]) == 1
    assert "--route: expected PARTITION=WALK,WALK" in capsys.readouterr().err


def test_a_route_that_skips_a_stage_is_refused_before_the_run(capsys):
    """`--route` applies to every request: one that leaves out a stage that is not optional ran and
    failed each request (exit 1 after the run); now one line before it."""
    code = main(["run", "--plan", ORPHEUS, "--engine", "sim", "--requests", "3", "--no-progress",
                 "--route", "LLM=prefill"])
    assert code == 1
    captured = capsys.readouterr()
    assert captured.out == "" and "Traceback" not in captured.err
    assert captured.err.strip() == ("mstar: error: --route: partition LLM: stage ['decode'] is not optional and "
                                    "the route ['prefill'] does not take it")


def test_a_prompts_line_whose_route_skips_a_stage_fails_alone(capsys, tmp_path):
    """A line's own route is that request's: it fails alone, the others run."""
    import json

    lines = [{"id": "bad", "prompt_tokens": [1, 2], "max_tokens": 4, "route": {"LLM": ["prefill"]}},
             {"id": "good", "prompt_tokens": [1, 2], "max_tokens": 4}]
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    assert main(["run", "--plan", ORPHEUS, "--engine", "sim", "--prompts", str(path), "--no-progress"]) == 0
    captured = capsys.readouterr()
    assert "2 (1 ok, 1 failed)" in captured.out and "stage ['decode'] is not optional" in captured.err


def test_bench_scheduler_is_wired(capsys):
    assert main(["bench", "scheduler", "--json", "--iters", "3", "--warmup", "0"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert "decode_64" in result["scenarios"]


def test_bench_load_is_wired(capsys, tmp_path):
    args = ["bench", "load", "--json", "--layers", "1", "--hidden", "256", "--vocab", "512", "--dir", str(tmp_path)]
    assert main(args) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["params"] > 512 * 256 and result["load_s"] > 0
    assert (tmp_path / "config.json").is_file()
    assert main(["bench", "load", "--hidden", "300"]) == 1  # not a multiple of 256


def test_bench_load_times_no_import(tmp_path):
    """A fresh process's first load imported safetensors and torch's symbolic shapes (485 modules)
    inside the timed region: the warm-up before the clock takes them (a bench audit)."""
    import subprocess
    import sys

    script = ("import sys; from pathlib import Path; from mstar.runtime.serve import bench_load as b\n"
              f"d = Path({str(tmp_path)!r}); b.write_checkpoint(d, b.llama_config(1, 256, 512))\n"
              "b._warm_up(d, 'cpu'); before = set(sys.modules); b._warm_up = lambda *a: None\n"
              "b.measure(d, 'cpu'); print(sorted(set(sys.modules) - before))")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    imported = eval(done.stdout.strip().splitlines()[-1])
    assert not [name for name in imported if name.startswith(("safetensors", "sympy", "mpmath", "torch"))], imported


def test_a_run_short_of_kv_pages_reports_the_pages_it_offloaded(capsys, tmp_path):
    """llama_chunked sizes a host pool (kv_cache.cpu_offload_pages): with a small device pool
    (`--kv-pages`) the run moves pages out and back, and the table and the report say how many;
    a plan without a host pool reports none. (Prompts of 8 to 400 tokens: a long request moved out
    starts several short ones, as a move must start more requests than it moves out.)"""
    report = tmp_path / "r.json"
    for engine in ("sim", "torch"):
        assert main(["run", "--plan", str(ROOT / "generated" / "llama_chunked.plan"), "--engine", engine,
                     "--kv-pages", "64", "--requests", "40", "--concurrency", "40", "--prompt-len", "8..400",
                     "--output-len", "8..40", "--no-progress", "--report", str(report)]) == 0
        moved = json.loads(report.read_text())["kv_offload"]["LLM"]
        assert moved["offloaded_pages"] > 0 and moved["restored_pages"] == moved["offloaded_pages"]
        assert "KV pages offloaded / restored LLM" in capsys.readouterr().out
    assert main(["run", "--plan", ORPHEUS, "--engine", "sim", "--requests", "3", "--no-progress",
                 "--report", str(report)]) == 0
    assert json.loads(report.read_text())["kv_offload"] == {}
    assert "offloaded" not in capsys.readouterr().out
