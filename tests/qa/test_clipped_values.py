"""What was left of an audit of command-line and request-file messages: a request's label or value,
or an option's, is echoed clipped (`mstar.arg_types.shown`, the one clipper), a number option is
read by an arg_types type (argparse's `type=int` and `type=float` echoed the value whole, and read
a 5000-digit `--rate` as infinity), and a route is worded once for `mstar run` and the Python API.

Each case failed before: the message held the value whole (or raised ValueError past Python's
4,300-digit limit of int -> str), or the run went on.
"""
from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from cli_call import call_main

from mstar.arg_types import SHOWN_CHARS, shown
from mstar.cli import mstar as mstar_cli
from mstar.plan.guidance_mode import unknown_label_problem
from mstar.plan.io import load_plan
from mstar.plan.output_bound import excess_tokens_problem
from mstar.runtime.conductor.loop_counts import LoopCounts
from mstar.runtime.serve.plan_checks import PlanChecks
from mstar.runtime.serve.workload import WorkloadError, check_route, route_names

ROOT = Path(__file__).resolve().parents[2]
LLAMA = str(ROOT / "generated" / "llama.plan")
LABEL = "x" * 10_000
CLIPPED_LABEL = "'" + "x" * (SHOWN_CHARS - 1) + "... (10000 characters)"
NINES = "9" * 5000  # past int()'s 4,300 digits


def _call(argv, capsys) -> tuple[int, str]:
    status, text = call_main(mstar_cli.main, argv, capsys)
    assert "Traceback" not in text and "internal error" not in text, text
    return status, text


# ---------------------------------------------------------------- a request's labels and values

def test_an_unknown_guidance_label_is_echoed_clipped():
    problem = unknown_label_problem(load_plan(LLAMA), {LABEL: 2.0})
    assert problem == f"guidance {CLIPPED_LABEL} is not a guidance label of the plan (labels: none)"


def test_a_loop_count_name_and_value_are_echoed_clipped():
    counts = LoopCounts(load_plan(str(ROOT / "generated" / "wan22.plan")))
    assert counts.problem({LABEL: 2}) == (f"loop_counts names {CLIPPED_LABEL}, which no loop of this plan counts by "
                                          "(counts: num_inference_steps)")
    problem = counts.problem({"num_inference_steps": 10**4000})
    assert problem is not None and problem.startswith("loop_counts num_inference_steps=" + "1" + "0" * 39
                                                      + "... (4001 digits) is outside 1..100")


@pytest.mark.parametrize("asked, echoed", [(10**4000, "1" + "0" * 39 + "... (4001 digits)"),
                                           (10**5000, "1" + "0" * 39 + "... (5001 digits)"),  # ValueError
                                           (3000, "3000")], ids=["4001-digits", "5001-digits", "3000"])
def test_asking_past_the_plans_tokens_echoes_the_count_clipped(asked, echoed):
    assert excess_tokens_problem("max_tokens", asked, 2049) == (
        f"max_tokens {echoed} is more than this plan makes for a request: at most 2049 output tokens (its loops' "
        "max iterations over its stages)")


@pytest.mark.parametrize("field, words", [
    ({"guidance": {LABEL: 2}}, f"guidance {CLIPPED_LABEL} is not a guidance label of the plan"),
    ({"loop_counts": {LABEL: 2}}, f"loop_counts names {CLIPPED_LABEL}, which no loop"),
    ({"max_tokens": 10**4000}, "'max_tokens' " + "1" + "0" * 39 + "... (4001 digits) is more than this plan makes"),
], ids=["guidance", "loop_counts", "max_tokens"])
def test_a_prompts_line_echoes_its_label_clipped(tmp_path, capsys, field, words):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"id": "a", "prompt_tokens": [1, 2], "max_tokens": 2, **field}) + "\n")
    status, text = _call(["run", "--plan", LLAMA, "--engine", "sim", "--prompts", prompts, "--no-progress"], capsys)
    assert status == 1 and f"p.jsonl:1: {words}" in text and len(text) < 400, text


# ---------------------------------------------------------------- shown, past the digit limit

@pytest.mark.parametrize("value, text", [
    (10**5000, "1" + "0" * 39 + "... (5001 digits)"),
    (-(10**5000), "-1" + "0" * 38 + "... (5001 digits)"),
    (10**5000 - 1, "9" * 40 + "... (5000 digits)"),
    (7 * 10**4300, "7" + "0" * 39 + "... (4301 digits)"),
    (int("9" * 4300), "9" * 40 + "... (4300 digits)"),  # at the limit: repr still writes it
], ids=["10**5000", "-10**5000", "10**5000-1", "7*10**4300", "4300-nines"])
def test_shown_writes_an_integer_past_the_digit_limit(value, text):
    """repr raises ValueError past 4,300 digits: `shown` raised it into the caller's message."""
    assert shown(value) == text


def test_a_range_past_the_digit_limit_is_echoed_by_shown():
    """workload.py's `_unreadable_integer` clipped by hand beside `shown`; the messages stay."""
    from mstar.runtime.serve.workload import parse_range

    for text, words in ((f"1..{NINES}", "--output-len must be at most 1000000 tokens, got " + "9" * 40),
                        (f"-{NINES}..3", "--output-len: need 1 <= A <= B, got -" + "9" * 39),
                        (f"9_{NINES}", "--output-len must be at most 1000000 tokens, got " + "9" * 40)):
        with pytest.raises(WorkloadError) as refused:
            parse_range(text, "--output-len", 1_000_000)
        assert str(refused.value).startswith(words) and str(refused.value).endswith(" digits)"), refused.value
    with pytest.raises(WorkloadError, match=r"^--output-len: 9{40}\.\.\. \(5001 digits\) is too large$"):
        parse_range(f"9_{NINES}", "--output-len")  # the digits, not the underscore


# ---------------------------------------------------------------- number options

@pytest.mark.parametrize("option", ["--requests", "--concurrency", "--kv-pages"])
@pytest.mark.parametrize("value, echoed", [
    ("x" * 5000, "'" + "x" * 39 + "... (5000 characters)"),
    (NINES, "'" + "9" * 39 + "... (5000 characters)"),
], ids=["letters", "digits"])
def test_mstar_run_echoes_a_bad_integer_clipped(capsys, option, value, echoed):
    """argparse's `type=int` said "invalid int value: '<all 5000 characters>'"."""
    status, text = _call(["run", "--plan", LLAMA, "--engine", "sim", "--no-progress", option, value], capsys)
    what = "an integer" if value[0] == "x" else "an integer of at most 4300 digits"
    assert status == 2 and f"argument {option}: must be {what}, got {echoed}" in text, text
    assert len(text) < 1500, len(text)


@pytest.mark.parametrize("value, echoed", [
    (NINES, "'" + "9" * 39 + "... (5000 characters)"),  # read as inf: every arrival at once, exit 0
    ("inf", "'inf'"), ("nan", "'nan'"), ("1e10", "10000000000.0"), ("0", "0.0"), ("-3", "-3.0"),
    ("x" * 5000, "'" + "x" * 39 + "... (5000 characters)"),
], ids=["5000-digits", "inf", "nan", "1e10", "0", "-3", "letters"])
def test_mstar_run_refuses_a_rate_out_of_range_as_a_usage_error(capsys, value, echoed):
    status, text = _call(["run", "--plan", LLAMA, "--engine", "sim", "--no-progress", "--arrival", "poisson",
                          "--rate", value], capsys)
    assert status == 2 and f"mstar run: error: argument --rate: must be a number in (0, 1e+09], got {echoed}" \
        in text, text
    assert "requests/s" not in text  # nothing ran


def test_mstar_run_takes_a_rate_at_its_bounds(capsys):
    for rate in ("1e9", "0.5"):
        status, text = _call(["run", "--plan", LLAMA, "--engine", "sim", "--no-progress", "--arrival", "poisson",
                              "--requests", "2", "--rate", rate], capsys)
        assert status == 0 and "2 (2 ok, 0 failed)" in text, text


def test_the_number_types_read_what_their_ranges_hold():
    from mstar.arg_types import float_range, integer

    within = float_range(0, 1e9, is_low_open=True)
    assert [within(text) for text in ("1e-300", " 5 ", "1e9")] == [1e-300, 5.0, 1e9]
    forever = float_range(0, math.inf, is_low_open=True)  # bench serve --request-rate: inf, all at once
    assert forever("inf") == forever("1e400") == math.inf
    assert integer(" -3 ") == -3 and integer("9" * 4000) == int("9" * 4000)


def test_bench_attention_echoes_a_head_dim_clipped(capsys):
    status, text = call_main(mstar_cli.main, ["bench", "attention", "--head-dim", NINES], capsys)
    assert status == 2 and "argument --head-dim: must be between 64 and 256, got '" + "9" * 39 in text, text
    assert len(text) < 1500
    status, text = call_main(mstar_cli.main, ["bench", "attention", "--head-dim", "100"], capsys)
    assert status == 2 and "argument --head-dim: invalid choice: 100 (choose from 64, 128, 256)" in text, text


def test_an_integer_list_is_echoed_clipped(capsys):
    status, text = call_main(mstar_cli.main, ["bench", "kv", "--budgets", "," * 5000], capsys)
    assert status == 2 and "expected comma-separated integers, got '" + "," * 39 + "... (5000 characters)" in text
    status, text = call_main(mstar_cli.main, ["bench", "kv", "--budgets", "64," + "x" * 5000], capsys)
    assert status == 2 and "argument --budgets: '64," + "x" * 36 + "... (5003 characters): each must be an " \
                           "integer, got 'xxx" in text, text
    assert len(text) < 1500


def test_bench_serve_reads_a_rate_past_the_float_range_as_all_at_once():
    """`--request-rate inf` is documented as all at once; so is a number that reads as inf."""
    from mstar.runtime.serve.bench_serve import _parser

    args = _parser().parse_args(["--base-url", "http://127.0.0.1:1", "--request-rate", NINES])
    assert args.request_rate == math.inf


# ---------------------------------------------------------------- one wording of a route's names

@pytest.mark.parametrize("route", [{"Nope": ["prefill"]}, {"LLM": ["decod"]}, {"LLM": []}, {LABEL: ["x"]},
                                   {"LLM": ["prefill", LABEL]}],
                         ids=["partition", "walk", "left-out", "long-partition", "long-walk"])
def test_the_python_api_words_a_route_as_mstar_run_does(route):
    """`PlanChecks.route_problem` worded the names apart ("route names unknown partitions [...]",
    the name whole); it takes `check_route`'s words now."""
    plan = load_plan(LLAMA)
    with pytest.raises(WorkloadError) as refused:
        check_route(route, route_names(plan), "--route")
    problem = PlanChecks(plan).route_problem(route)
    assert problem == "route is not one this plan takes: " + str(refused.value).removeprefix("--route: ")
    assert len(problem) < 300, problem


def test_a_route_both_take_is_taken_by_both():
    plan = load_plan(LLAMA)
    check_route({"LLM": ["prefill", "decode"]}, route_names(plan), "--route")
    assert PlanChecks(plan).route_problem({"LLM": ["prefill", "decode"]}) is None


# ---------------------------------------------------------------- mstar serve's options

SERVE = ["serve", "--plan", LLAMA, "--engine", "sim", "--port", "0"]


@pytest.mark.parametrize("argv, words", [
    (["--seed", NINES], "argument --seed: must be between -8796093022208 and 8796093022208, got '" + "9" * 39
     + "... (5000 characters)"),
    (["--seed", str(10**20)], "argument --seed: must be between -8796093022208 and 8796093022208, got 1" + "0" * 20),
    (["--port", NINES], "argument --port: must be between 0 and 65535, got '" + "9" * 39 + "... (5000 characters)"),
    (["--port", "-" + "9" * 4000], "argument --port: must be between 0 and 65535, got -" + "9" * 39
     + "... (4000 digits)"),
    (["--kv-pages", "x" * 5000], "argument --kv-pages: must be an integer, got '" + "x" * 39),
    (["--max-waiting", "-1"], "argument --max-waiting: must be between 0 and 10000000, got -1"),
    (["--max-waiting", NINES], "argument --max-waiting: must be between 0 and 10000000, got '" + "9" * 39),
    (["--sim-pace", NINES], "argument --sim-pace: must be a number in [0, 1000], got '" + "9" * 39),
    (["--sim-pace", "1e300"], "argument --sim-pace: must be a number in [0, 1000], got 1e+300"),
    (["--drain-timeout", "inf"], "argument --drain-timeout: must be a number in [0, 86400], got 'inf'"),
    (["--drain-timeout", NINES], "argument --drain-timeout: must be a number in [0, 86400], got '" + "9" * 39),
    (["--drain-timeout", "-1"], "argument --drain-timeout: must be a number in [0, 86400], got -1.0"),
], ids=["seed-digits", "seed-1e20", "port-digits", "port-negative", "kv-pages-letters", "max-waiting--1",
        "max-waiting-digits", "sim-pace-digits", "sim-pace-1e300", "drain-inf", "drain-digits", "drain--1"])
def test_serve_refuses_a_number_out_of_range_as_a_usage_error(capsys, argv, words):
    """`type=int` and `type=float` echoed a 5000-digit value whole (5,600 characters), and read it
    as inf for --sim-pace (exit 1) and --drain-timeout (an internal error once the engine was built);
    --seed 10**20, --max-waiting -1 and --drain-timeout -1 were exit 1 after the same checks."""
    status, text = _call([*SERVE, *argv], capsys)
    assert status == 2 and f"mstar serve: error: {words}" in text, text
    assert len(text) < 1500, len(text)


@pytest.mark.parametrize("argv, words", [
    (["--kv-pages", "-" + "9" * 4000], "--kv-pages must be a positive number of pages, got -" + "9" * 39
     + "... (4000 digits)"),
    (["--kv-pages", "0"], "--kv-pages must be a positive number of pages, got 0"),
], ids=["kv-pages", "kv-pages-0"])
def test_serve_echoes_a_page_count_out_of_range_clipped(capsys, argv, words):
    """Its range stays a check with exit 1 (as `mstar run --kv-pages`); the value was echoed whole. (The
    port's range is now a usage error, exit 2, as every number option's: above.)"""
    status, text = _call([*SERVE, *argv], capsys)
    assert status == 1 and text.strip() == f"mstar serve: error: {words}", text


# ---------------------------------------------------------------- python3 -m mstar.runtime.engine.tp.memory

@pytest.mark.parametrize("argv, words", [
    (["--tp", NINES], "argument --tp: must be between 1 and 1024, got '" + "9" * 39 + "... (5000 characters)"),
    (["--tp", "0"], "argument --tp: must be between 1 and 1024, got 0"),  # taken as no --tp: exit 0
    (["--bytes-per-param", "-3"], "argument --bytes-per-param: must be between 1 and 8, got -3"),  # -10850.5 MiB
    (["--bytes-per-param", "x" * 5000], "argument --bytes-per-param: must be an integer, got '" + "x" * 39),
], ids=["tp-digits", "tp-0", "bytes--3", "bytes-letters"])
def test_tp_memory_refuses_an_option_out_of_range(capsys, argv, words):
    from mstar.runtime.engine.tp import memory

    status, text = call_main(memory.main, ["--plan", str(ROOT / "generated" / "orpheus_tp2.plan"), *argv], capsys)
    assert status == 2 and words in text and "MiB" not in text, text
    assert len(text) < 1500, len(text)


# ---------------------------------------------------------------- the Python API's and the HTTP API's values

@pytest.mark.parametrize("params, words", [
    ({"route": {LABEL: "prefill"}}, "route must map partition names to lists of walk names, got {'" + "x" * 38
     + "... (10015 characters)"),
    ({"max_tokens": -(10**5000)}, "max_tokens must be >= 1, got -1" + "0" * 38 + "... (5001 digits)"),
    ({"stop": ["", LABEL]}, "stop must be a list of non-empty strings, got ['', '" + "x" * 33),
    ({"top_k": LABEL}, f"top_k must be an integer, got {CLIPPED_LABEL}"),
], ids=["route", "max_tokens", "stop", "top_k"])
def test_sampling_params_echo_a_value_clipped(params, words):
    from mstar.runtime.serve.api import SamplingError, SamplingParams

    with pytest.raises(SamplingError) as refused:
        SamplingParams(**params).check()
    assert str(refused.value).startswith(words) and len(str(refused.value)) < 200, refused.value


def test_sampling_params_take_a_max_tokens_past_the_digit_limit():
    """Every check wrote max_tokens into its message first: one past 4,300 digits raised
    Python's "Exceeds the limit (4300 digits)" ValueError (the plan refuses it later, by its length)."""
    from mstar.runtime.serve.api import SamplingParams

    SamplingParams(max_tokens=10**5000).check()


@pytest.mark.parametrize("body, words", [
    ({"quality": LABEL}, f"quality {CLIPPED_LABEL} is not supported: auto or standard ("),
    ({"style": LABEL}, f"style {CLIPPED_LABEL} is not supported: leave it out ("),
    ({"n": 10**4000}, "n must be 1, got 1" + "0" * 39 + "... (4001 digits)"),
], ids=["quality", "style", "n"])
def test_an_image_request_echoes_a_value_clipped(body, words):
    from mstar.runtime.serve.http_schema import ApiError, ImageBody

    with pytest.raises(ApiError) as refused:
        ImageBody(model="bagel", prompt="a cat", **body).checks()
    assert refused.value.status == 400 and refused.value.message.startswith(words), refused.value.message
    assert len(refused.value.message) < 200


def test_a_speech_request_echoes_its_response_format_clipped():
    from mstar.runtime.serve.http_schema import ApiError, SpeechBody

    with pytest.raises(ApiError) as refused:
        SpeechBody(model="orpheus", input="hi", response_format=LABEL).checks()
    assert refused.value.message == f"response_format {CLIPPED_LABEL} is not supported: wav or pcm"


# ---------------------------------------------------------------- KV pools too large to allocate

def test_a_kv_cache_echoes_its_page_count_clipped(capsys):
    """`mstar run --kv-pages <4000 digits>` was a 4,200-character line."""
    status, text = _call(["run", "--plan", LLAMA, "--requests", "1", "--no-progress", "--kv-pages", "9" * 4000],
                         capsys)
    assert status == 1 and text.startswith("mstar: error: cannot allocate a KV cache of " + "9" * 40
                                           + "... (4000 digits) pages x 16 positions (about 2^"), text
    assert text.rstrip().endswith("more bytes than one tensor can address; lower kv_pool.num_pages in the deployment "
                                  "or pass --kv-pages N") and len(text) < 400, text


def test_bench_runner_says_in_one_line_that_its_kv_pool_cannot_be_allocated(capsys, monkeypatch):
    """A pool the machine cannot hold (64 clients of 100000 + 100000 tokens under a 3 GB memory
    limit: 800,128 pages) was `mstar: internal error (KvCacheError ...)`, its way out the
    deployment's pages or --kv-pages, neither of which this bench has. Here every tensor is too large."""
    from mstar.runtime.engine.kv import cache

    monkeypatch.setattr(cache, "MAX_TENSOR_BYTES", 1024)
    status, text = _call(["bench", "runner", "--rounds", "1", "--no-bytecodes"], capsys)
    assert status == 1 and text.startswith("mstar bench runner: cannot allocate a KV cache of "), text
    assert text.rstrip().endswith("more bytes than one tensor can address; the bench sizes the pool for every "
                                  "request's tokens: ask for fewer or shorter requests") and "--kv-pages" not in text


def test_bench_runner_says_in_one_line_that_its_runners_pages_cannot_be_allocated(capsys, monkeypatch):
    """The fast-path runner's own KV pages are one tensor (`PagedKv`): under a 9.5 GB memory limit
    the engine's per-layer pool fitted and it did not, torch's RuntimeError an internal error."""
    from mstar.runtime.engine.gpu import runner

    def refuse(*args, **kwargs):
        raise RuntimeError("[enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: can't allocate "
                           "memory: you tried to allocate 6554656768 bytes.\nError code 12")

    monkeypatch.setattr(runner, "PagedKv", refuse)
    status, text = _call(["bench", "runner", "--rounds", "1", "--no-bytecodes"], capsys)
    assert status == 1 and len(text.strip().splitlines()) == 1, text
    assert text.startswith("mstar bench runner: cannot build the fast-path runner of LLM with ") and \
        "KV pages: [enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: can't allocate memory: you " \
        "tried to allocate 6554656768 bytes. Error code 12; the bench sizes the pool" in text, text


def test_an_internal_error_line_is_clipped(monkeypatch, capsys):
    """The catch-all "internal error (...)" line printed the exception's text whole (a value of
    5,000 characters in it came out whole); now its head and tail, and an exception whose text
    cannot be written is still named."""
    from mstar.arg_types import SHOWN_ERROR_CHARS, shown_error

    def fails(args):
        raise ValueError("y" * 5000 + " the end")

    monkeypatch.setattr(mstar_cli, "run_command", fails)
    status, text = call_main(mstar_cli.main, ["run", "--plan", str(Path(__file__).resolve().parents[2]
                                                                    / "generated" / "llama.plan")], capsys)
    assert status == 1 and "internal error (ValueError: yyy" in text and "the end" in text
    assert "y" * 1000 not in text and "(5020 characters)" in text

    class Unwritable(Exception):
        def __str__(self):
            raise RuntimeError("no")

    assert shown_error(Unwritable()) == "Unwritable: (its message could not be written)"
    assert len(shown_error(KeyError("k" * 10**6))) < SHOWN_ERROR_CHARS + 40
