"""Cases a black-box sweep of `mstarc` and `mstar` found (each exited 0 having done something other
than asked, or gave a wrong remedy): one clear line and a non-zero exit now.

Each calls the command's `main()` in-process, as tests/qa/test_bad_inputs.py does; the working
directory is a temporary one wherever a command could write into it.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from cli_call import call_main

from mstar.cli import mstar as mstar_cli
from mstar.cli import mstarc as mstarc_cli

ROOT = Path(__file__).resolve().parents[2]
LLAMA = str(ROOT / "generated" / "llama.plan")
CHECKPOINT_CONFIG = {"architectures": ["LlamaForCausalLM"], "hidden_size": 64, "num_hidden_layers": 2,
                     "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 128,
                     "vocab_size": 512}


def _call(main, argv, capsys) -> tuple[int, str]:
    status, text = call_main(main, argv, capsys)
    assert "Traceback" not in text and "internal error" not in text, text
    return status, text


# ---------------------------------------------------------------- empty paths

@pytest.fixture
def in_tmp(tmp_path, monkeypatch) -> Path:
    """A working directory of its own, with a checkpoint folder `ckpt` (config.json only)."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / "config.json").write_text(json.dumps(CHECKPOINT_CONFIG))
    return tmp_path


@pytest.mark.parametrize("argv, option", [
    # each wrote specs/ckpt.mw (or configs/ckpt.yaml) into the working directory, exit 0
    (["init", "--from-checkpoint", "ckpt", "-o", "", "--config-out", "c.yaml", "--plan-out", "p.plan"], "-o/--output"),
    (["init", "--from-checkpoint", "ckpt", "-o", "s.mw", "--config-out", "", "--plan-out", "p.plan"], "--config-out"),
    (["init", "--from-checkpoint", "", "-o", "s.mw", "--config-out", "c.yaml"], "--from-checkpoint"),
    # rebuilt (or benchmarked) the working directory's generated/, exit 0
    (["regen", "--root", ""], "--root"),
    (["regen", "--check", "--root", ""], "--root"),
    (["bench", "--runs", "1", "--root", ""], "--root"),
    # "spec path is a directory, not a file: ." and the like
    (["check", ""], "SPEC"),
    (["compile", ""], "SPEC"),
    (["check", ROOT / "specs" / "llama.mw", "--config", ""], "--config"),
    (["explain", ""], "PLAN"),
    (["fmt", ""], "SPEC"),
    (["graph", ROOT / "specs" / "llama.mw", "-o", ""], "-o/--output"),
])
def test_mstarc_refuses_an_empty_path(in_tmp, capsys, argv, option):
    status, text = _call(mstarc_cli.main, argv, capsys)
    assert status == 2, text
    assert f"argument {option}: needs a path, got an empty one" in text, text
    assert sorted(p.name for p in in_tmp.iterdir()) == ["ckpt"]  # nothing written


def test_mstarc_init_refuses_an_empty_name(in_tmp, capsys):
    """`--name ""` was taken for no --name: the model was named after the folder, exit 0."""
    status, text = _call(mstarc_cli.main, ["init", "--from-checkpoint", "ckpt", "--name", "", "-o", "s.mw",
                                           "--config-out", "c.yaml", "--plan-out", "p.plan"], capsys)
    assert status == 2 and "--name '': a model name is letters, digits and _" in text, text
    assert sorted(p.name for p in in_tmp.iterdir()) == ["ckpt"]


@pytest.mark.parametrize("argv, words", [
    (["--plan", ""], "--plan needs a path, got an empty one"),  # "cannot read plan .: is a directory"
    (["--plan", LLAMA, "--tokenizer", ""], "--tokenizer needs a path, got an empty one"),
    # exit 0 on the sim, the option ignored; "--weights : no config.json there" on the torch engine
    (["--plan", LLAMA, "--weights", ""], "--weights '': no checkpoint directory given"),
    (["--plan", LLAMA, "--weights", "LLM="], "--weights 'LLM=': no checkpoint directory given"),
])
def test_mstar_run_refuses_an_empty_path(capsys, argv, words):
    status, text = _call(mstar_cli.main, ["run", *argv, "--engine", "sim", "--requests", "1", "--no-progress"],
                         capsys)
    assert status == 1 and words in text, text
    assert "requests/s" not in text  # refused before the run


@pytest.mark.parametrize("engine", ["sim", "torch"])
@pytest.mark.parametrize("tokenizer", [False, True])
def test_mstar_run_refuses_a_weights_directory_that_is_not_there(tmp_path, capsys, engine, tokenizer):
    """The sim engine reads --weights for its tokenizer only: a mistyped directory ran with exit 0
    and no text (and beside --tokenizer it was not looked at on either engine before the build)."""
    (tmp_path / "tok").mkdir()
    (tmp_path / "tok" / "tokenizer.json").write_text("{}")
    extra = ["--tokenizer", str(tmp_path / "tok")] if tokenizer else []
    status, text = _call(mstar_cli.main, ["run", "--plan", LLAMA, "--engine", engine, "--weights",
                                          str(tmp_path / "nope"), *extra, "--requests", "1", "--no-progress"], capsys)
    assert status == 1 and "--weights " + str(tmp_path / "nope") + ": no such directory" in text, text
    assert "requests/s" not in text


def test_serve_and_the_python_api_refuse_a_weights_file(tmp_path):
    """`mstar serve` and `LLM(...)` take their tokenizer from engine_setup.build_tokenizer."""
    from mstar.runtime.serve.engine_setup import SetupError, build_tokenizer, load

    (tmp_path / "f").write_text("")
    with pytest.raises(SetupError, match="is not a directory"):
        build_tokenizer(load(LLAMA), [str(tmp_path / "f")], None)


def test_bench_load_refuses_an_empty_dir(capsys):
    """`--dir ""` was taken for no --dir: a checkpoint written to a temporary folder, exit 0."""
    status, text = _call(mstar_cli.main, ["bench", "load", "--dir", "", "--layers", "1", "--hidden", "256",
                                          "--vocab", "16"], capsys)
    assert status == 2 and "argument --dir: needs a path, got an empty one" in text, text


# ---------------------------------------------------------------- a prompts file's seed

@pytest.mark.parametrize("seed", [2**63, -(2**63) - 1, 10**30])
def test_a_prompts_seed_past_64_bits_names_its_line(tmp_path, capsys, seed):
    """The other sampling fields are checked as the file is read; a seed past 64 bits ran with
    exit 0 on the sim (which samples nothing) and failed its request in the torch engine
    ("request a: seed must be a 64-bit integer"), the file's line unnamed."""
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"id": "a", "prompt_tokens": [1, 2], "max_tokens": 2, "seed": seed}) + "\n")
    status, text = _call(mstar_cli.main, ["run", "--plan", LLAMA, "--engine", "sim", "--prompts", prompts,
                                          "--no-progress"], capsys)
    assert status == 1 and "p.jsonl:1: 'seed' must be a 64-bit integer" in text, text
    assert "requests/s" not in text


@pytest.mark.parametrize("engine", ["sim", "torch"])
def test_a_prompts_stop_token_past_the_vocabulary_names_its_line(tmp_path, capsys, engine):
    """The Python API refuses such a stop token id; a prompts line ran with it, on either engine."""
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"id": "a", "prompt_tokens": [1, 2], "max_tokens": 2,
                                   "stop_tokens": [5, 99999999999]}) + "\n")
    status, text = _call(mstar_cli.main, ["run", "--plan", LLAMA, "--engine", engine, "--prompts", prompts,
                                          "--no-progress"], capsys)
    assert status == 1 and "p.jsonl:1: 'stop_tokens' holds token id 99999999999, outside the plan's vocabulary" \
        in text, text


def test_a_prompts_seed_at_the_64_bit_ends_runs(tmp_path, capsys):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"id": f"s{i}", "prompt_tokens": [1, 2], "max_tokens": 2, "seed": seed})
                               + "\n" for i, seed in enumerate((2**63 - 1, -(2**63)))))
    status, text = _call(mstar_cli.main, ["run", "--plan", LLAMA, "--prompts", prompts, "--no-progress"], capsys)
    assert status == 0 and "2 (2 ok, 0 failed)" in text, text


# ---------------------------------------------------------------- bench runner's full decode step

@pytest.mark.parametrize("argv, words", [
    # llama's step holds 64 rows; a budget of 63 tokens, 63 one-token rows
    (["--clients", "65"], "a step of LLM:mixed holds at most 64 rows, so no decode step of 65 rows runs: "
                          "give --clients 64 or fewer"),
    (["--clients", "64", "--budget", "63"], "a step of LLM:mixed feeds at most 63 tokens (its token budget), so "
                                            "no decode step of 64 rows runs: give --clients 63 or fewer, or "
                                            "--budget 64 or more"),
    (["--clients", "10", "--budget", "5"], "give --clients 5 or fewer, or --budget 10 or more"),
])
def test_bench_runner_refuses_clients_no_step_holds(capsys, argv, words):
    """Each ran a round, then said "no full decode step of 65 decode rows ran (raise --output-len)",
    which no output length mends."""
    status, text = _call(mstar_cli.main, ["bench", "runner", "--plan", LLAMA, "--rounds", "1", "--no-bytecodes",
                                          *argv], capsys)
    assert status == 1 and words in text, text
    assert "raise --output-len" not in text


def test_bench_runner_runs_clients_a_step_just_holds(capsys):
    status, text = _call(mstar_cli.main, ["bench", "runner", "--plan", LLAMA, "--rounds", "1", "--no-bytecodes",
                                          "--clients", "8", "--budget", "8", "--output-len", "8", "--json"], capsys)
    assert status == 0 and json.loads(text)["clients"] == 8, text


def test_an_empty_path_arg_is_the_only_one_refused():
    from mstar.arg_types import path_arg

    assert path_arg("x") == "x" and path_arg(".") == "."
    with pytest.raises(Exception, match="needs a path"):
        path_arg("")


# ---------------------------------------------------------------- a prompts file's guidance and loop counts

@pytest.mark.parametrize("plan, field, words", [
    # ran with exit 0 on the sim; failed its request in the torch engine, the line unnamed
    ("llama", {"guidance": {"cfg": 2}}, "p.jsonl:1: guidance 'cfg' is not a guidance label of the plan (labels: none)"),
    ("bagel", {"guidance": {"cfg_txt": 2}}, "p.jsonl:1: guidance 'cfg_txt' is not a guidance label of the plan "
                                            "(labels: cfg_text, cfg_img)"),
    # failed the request at admission ("loop_counts names 'stepz' ..."), the line unnamed
    ("llama", {"loop_counts": {"stepz": 2}}, "p.jsonl:1: loop_counts names 'stepz', which no loop of this plan "
                                             "counts by (counts: none)"),
    ("wan22", {"loop_counts": {"num_inference_step": 2}}, "did you mean 'num_inference_steps'?"),
    ("wan22", {"loop_counts": {"num_inference_steps": 101}}, "p.jsonl:1: loop_counts num_inference_steps=101 is "
                                                             "outside 1..100"),
    # Orpheus sends no text tokens: logprobs came back [] and prompt_logprobs failed the request
    # once it ran (the Python API refused both before it ran)
    ("orpheus", {"logprobs": 1}, "p.jsonl:1: logprobs asks for what this plan does not give"),
    ("orpheus", {"prompt_logprobs": 0}, "p.jsonl:1: prompt_logprobs asks for what this plan does not give"),
    # and took a logit_bias or ignore_eos that act on text tokens only, running as if not asked
    ("orpheus", {"logit_bias": {"5": 3}}, "p.jsonl:1: logit_bias would change nothing on this plan"),
    ("orpheus", {"ignore_eos": True}, "p.jsonl:1: ignore_eos would change nothing on this plan"),
    # Whisper sends text, its transcript: the reason said its walks send the client no text tokens
    ("whisper", {"logprobs": 1}, "sampled tokens as text, one by one (a transcript's tokens, sent once final, are "
                                 "not)"),
])
def test_a_prompts_line_the_plan_does_not_take_names_its_line(tmp_path, capsys, plan, field, words):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"id": "a", "prompt_tokens": [1, 2], "max_tokens": 2, **field}) + "\n")
    status, text = _call(mstar_cli.main, ["run", "--plan", ROOT / "generated" / f"{plan}.plan", "--engine", "sim",
                                          "--prompts", prompts, "--no-progress"], capsys)
    assert status == 1 and words in text, text
    assert "requests/s" not in text and "failed" not in text  # refused as the file is read, before the run


def test_a_prompts_line_the_plan_takes_is_read(tmp_path):
    from mstar.plan.io import load_plan
    from mstar.runtime.serve.workload import read_prompts

    prompts = tmp_path / "p.jsonl"
    for plan, field in (("bagel", {"guidance": {"cfg_text": 4, "cfg_img": 0}}),
                        ("wan22", {"loop_counts": {"num_inference_steps": 100}}),
                        ("llama", {"logprobs": 2, "prompt_logprobs": 1})):
        prompts.write_text(json.dumps({"id": "a", "prompt_tokens": [1, 2], "max_tokens": 2, **field}) + "\n")
        workload = read_prompts(str(prompts), plan=load_plan(str(ROOT / "generated" / f"{plan}.plan")))
        assert len(workload.requests) == 1


# ---------------------------------------------------------------- bench kv: one scenario's options

@pytest.mark.parametrize("argv, words", [
    # each ran the other scenario as if the option were not given, exit 0
    (["--scenario", "prefix", "--no-whole"], "--no-whole: an option of the chunk scenario, which --scenario prefix "
                                             "does not run (use --scenario chunk or all)"),
    (["--scenario", "prefix", "--decode-rows", "4", "--no-flat", "--route", "packed"],
     "--decode-rows, --route, --no-flat: options of the chunk scenario"),
    (["--scenario", "prefix", "--chunk-rounds", "1"], "--chunk-rounds: an option of the chunk scenario"),
    (["--scenario", "prefix", "--budgets", "64,128"], "--budgets: an option of the chunk scenario"),
    (["--scenario", "chunk", "--prefix-len", "64"], "--prefix-len: an option of the prefix scenario, which "
                                                    "--scenario chunk does not run (use --scenario prefix or all)"),
    (["--scenario", "chunk", "--prefix-requests", "2", "--prefix-rounds", "1"],
     "--prefix-requests, --prefix-rounds: options of the prefix scenario"),
])
def test_bench_kv_refuses_an_option_its_scenario_does_not_read(capsys, argv, words):
    status, text = _call(mstar_cli.main, ["bench", "kv", *argv], capsys)
    assert status == 2 and f"mstar bench kv: error: {words}" in text, text


def test_bench_kv_prefix_scenario_runs_at_the_budget_given(capsys, monkeypatch):
    """`--scenario all --budget N` ran the prefix scenario at N; `--scenario prefix --budget N` ran it
    at the plan's budget."""
    from mstar.runtime.serve import bench_kv

    budgets = []

    def prefix_scenario(plan, engine, num_requests, prefix_len, rounds):
        budgets.append({k.token_budget for w in plan.workers for k in w.keys})
        assert (num_requests, prefix_len, rounds) == (8, 1024, 2)  # the defaults, filled in
        return {}

    monkeypatch.setattr(bench_kv, "prefix_scenario", prefix_scenario)
    monkeypatch.setattr(bench_kv, "_print_prefix", lambda results: None)
    status, text = _call(mstar_cli.main, ["bench", "kv", "--scenario", "prefix", "--budget", "96"], capsys)
    assert status == 0 and budgets == [{96}], text


# ---------------------------------------------------------------- bench kv: decode rows past max_seq_len

@pytest.mark.parametrize("argv, words", [
    # each ran the decode-only workload, then "4096 of 4096 requests failed ... exceeds max_seq_len 16384"
    (["--decode-rows", "4096"], "the decode rows would each run 26050 (a 16-token prompt, then enough to outlast "
                                "the long prompt: twice its arrival after --arrive-after 10 steps and its 13001 "
                                "prefill steps beside --decode-rows 4096 at budget 512, plus 12): give --decode-rows "
                                "510 or fewer, --prompt-len 5776 or fewer, or --budget 4098 or more"),
    (["--arrive-after", "100000"], "the decode rows would each run 200086 (a 16-token prompt, then enough to outlast "
                                   "the long prompt: twice its arrival after --arrive-after 100000 steps and its 29 "
                                   "prefill steps beside --decode-rows 40 at budget 512, plus 12): give "
                                   "--arrive-after 8149 or fewer"),
    (["--budgets", "1,512", "--decode-rows", "600"], "at budget 1 of --budgets, plus 12): give --prompt-len 5776 or "
                                                     "fewer"),
])
def test_bench_kv_refuses_decode_rows_past_max_seq_len_before_running(capsys, monkeypatch, argv, words):
    from mstar.runtime.serve import bench_kv

    def run(*args, **kwargs):
        raise AssertionError("ran")

    monkeypatch.setattr(bench_kv, "_run", run)
    status, text = _call(mstar_cli.main, ["bench", "kv", "--scenario", "chunk", *argv], capsys)
    assert status == 1 and "mstar bench kv: error: plan generated/llama_chunked.plan holds at most max_seq_len " \
                           "16384 tokens a request, and" in text and words in text, text


@pytest.mark.parametrize("budget, change, fits", [
    (None, {"decode_rows": 510}, True), (None, {"decode_rows": 511}, False),
    (None, {"arrive_after": 8149}, True), (None, {"arrive_after": 8150}, False),
    (1, {"prompt_len": 5776}, True), (1, {"prompt_len": 5777}, False),
    (42, {}, True), (41, {}, False),  # --budget: the least that fits
])
def test_bench_kv_the_value_named_is_the_largest_that_fits(budget, change, fits):
    """Each value named above was run on the sim, and ran."""
    import argparse

    from mstar.plan.io import load_plan
    from mstar.runtime.serve import bench_kv

    plan = load_plan(str(ROOT / "generated" / "llama_chunked.plan"))
    plan = bench_kv.with_budget(plan, budget) if budget else plan
    args = argparse.Namespace(**{"decode_rows": 40, "arrive_after": 10, "prompt_len": 8192, "budgets": None, **change})
    assert (bench_kv.decode_rows_problem(plan, args) is None) == fits


# ---------------------------------------------------------------- long values echoed in messages

NINES = "9" * 5000  # past Python's 4300-digit limit of int()
CLIPPED = "9" * 40 + "... (5000 digits)"


@pytest.mark.parametrize("argv, words", [
    # "--prompt-len: expected A..B or N with integers, got '999...'": an integer, too large, echoed whole
    (["--prompt-len", NINES], f"--prompt-len must be at most 1000000 tokens, got {CLIPPED}"),
    (["--output-len", f"1..{NINES}"], f"--output-len must be at most 1000000 tokens, got {CLIPPED}"),
    (["--prompt-len", "9" * 4000], "--prompt-len must be at most 1000000 tokens, got " + "9" * 40
                                   + "... (4000 digits)"),
    (["--prompt-len", "x" * 5000], "--prompt-len: expected A..B or N with integers, got '" + "x" * 39
                                   + "... (5000 characters)"),
    (["--requests", "9" * 4000], "--requests must be at most 10000000, got " + "9" * 40 + "... (4000 digits)"),
    (["--kv-pages", "-" + "9" * 4000], "--kv-pages must be a positive number of pages, got -" + "9" * 39
                                       + "... (4000 digits)"),
    (["--route", NINES], "--route: expected PARTITION=WALK,WALK, got '" + "9" * 39 + "... (5000 characters)"),
    (["--route", f"LLM={NINES}"], "--route: partition 'LLM' has no walk '" + "9" * 39 + "... (5000 characters)"),
])
def test_a_long_value_is_echoed_clipped(capsys, argv, words):
    status, text = _call(mstar_cli.main, ["run", "--plan", LLAMA, "--engine", "sim", "--no-progress", *argv], capsys)
    assert status == 1 and words in text, text
    assert "9" * 41 not in text and "x" * 41 not in text


@pytest.mark.parametrize("field, words", [
    ({"max_tokens": "x" * 5000}, "field 'max_tokens' must be int, got 'xxx"),
    ({"max_tokens": -(10**4000)}, "'max_tokens' must be >= 1, got -1000"),
    ({"seed": 10**4000}, "'seed' must be a 64-bit integer (-2**63 to 2**63 - 1), got 1000"),
    ({"top_k": -(10**4000)}, "'top_k' must be >= 0 (0: no limit), got -1000"),
    ({"guidance": {"x" * 5000: -1}}, "guidance scale of 'xxx"),
    ({"loop_counts": {"steps": -(10**4000)}}, "'loop_counts' maps a loop's count param to a positive integer; "
                                              "'steps' has -1000"),
    ({"x" * 5000: 1}, "unknown field(s) ['xxx"),
])
def test_a_long_value_of_a_prompts_line_is_echoed_clipped(tmp_path, capsys, field, words):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"id": "a", "prompt_tokens": [1, 2], "max_tokens": 2, **field}) + "\n")
    status, text = _call(mstar_cli.main, ["run", "--plan", LLAMA, "--engine", "sim", "--prompts", prompts,
                                          "--no-progress"], capsys)
    assert status == 1 and f"p.jsonl:1: {words}" in text, text
    assert "... (4000 digits)" in text or "... (4001 digits)" in text or "... (5000 characters)" in text, text
    assert len(text) < 600, text


def test_a_range_past_the_digit_limit_without_a_bound_is_too_large():
    """`mstar bench serve` reads its ranges without a bound."""
    from mstar.runtime.serve.workload import WorkloadError, parse_range

    with pytest.raises(WorkloadError, match=r"^--prompt-len: 9{40}\.\.\. \(5000 digits\) is too large$"):
        parse_range(NINES, "--prompt-len")
    with pytest.raises(WorkloadError, match=r"^--prompt-len: need 1 <= A <= B, got -9{39}\.\.\. \(5000 digits\)$"):
        parse_range(f"-{NINES}..3", "--prompt-len")


# ---------------------------------------------------------------- bench runner --long-prompt, an unchunked plan

@pytest.mark.parametrize("argv, words", [
    # "..., and --budget only resizes the chunks of one that does" with no --budget given
    ([], "the plan cuts no prompt into chunks (compiled without max_prefill_chunk_size), so --long-prompt has no "
         "chunk steps to time: use a chunked plan such as generated/llama_chunked.plan"),
    (["--budget", "64"], "the plan cuts no prompt into chunks (compiled without max_prefill_chunk_size), and --budget "
                         "only resizes the chunks of one that does: use a chunked plan"),
])
def test_bench_runner_long_prompt_on_an_unchunked_plan_words_what_was_given(capsys, argv, words):
    status, text = _call(mstar_cli.main, ["bench", "runner", "--plan", LLAMA, "--long-prompt", "100", *argv], capsys)
    assert status == 1 and words in text, text
    assert argv or "--budget" not in text


def test_a_bench_default_plan_missing_outside_the_repository_says_where_it_looked(tmp_path, monkeypatch, capsys):
    """`mstar bench offload` from another folder: its default plan (generated/llama_chunked.plan, a
    path relative to the working directory) was "does not exist" with no word of where it looked."""
    monkeypatch.chdir(tmp_path)
    status, text = _call(mstar_cli.main, ["bench", "offload"], capsys)
    assert status == 1 and "generated/llama_chunked.plan does not exist (looked for under " in text, text
    assert str(tmp_path) in text
