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
