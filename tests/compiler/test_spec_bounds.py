"""Spec values mstarc once accepted and `load_plan` then refused as a hand-edited plan ("its tables do
not fit together", plan/references.py): caps and rows limits of 0 rows, empty, zero or repeated
capture lists, stream chunks of no items (an audit of specs/*.mw edits). Each is now a located
diagnostic at compile time (MW432, MW433, MW217), and nothing is written.

Every case edits a copy of a shipped spec, compiles it with the driver and asserts the code, the
words and the line of the error; the unedited copies compile, and a property test checks that
whatever the compiler accepts of such numbers gives a plan whose tables fit together.
"""
from __future__ import annotations

import re
from pathlib import Path
from typing import Optional

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mstar.cli.mstarc import main
from mstar.compiler.driver import compile_spec
from mstar.lang.diagnostics import Diagnostics
from mstar.plan.io import load_plan
from mstar.plan.references import reference_problems

ROOT = Path(__file__).resolve().parents[2]
DECODE_CAPTURE = "capture decode batched batch=[1, 2, 4, 8, 16, 32, 64] unroll_prompts=16"
PREFILL_CAPTURE = "capture prefill packed batch=[1, 2, 4] tokens=[32, 64, 128, 256, 384, 512]"
MIXED_BATCH = "capture packed batch=[1, 4, 16, 64]"


def _paths(tmp_path: Path, spec: str, config: str, edit=None) -> tuple[Path, Path]:
    """specs/SPEC.mw (with `edit(text)` applied) and configs/CONFIG.yaml, copied into tmp_path."""
    for folder in ("specs", "configs"):
        (tmp_path / folder).mkdir(exist_ok=True)
    text = (ROOT / "specs" / f"{spec}.mw").read_text()
    edited = edit(text) if edit else text
    assert edit is None or edited != text, "the edit changed nothing: the shipped spec moved on"
    spec_path = tmp_path / "specs" / f"{spec}.mw"
    spec_path.write_text(edited)
    config_path = tmp_path / "configs" / f"{config}.yaml"
    config_path.write_text((ROOT / "configs" / f"{config}.yaml").read_text())
    return spec_path, config_path


def _compile(tmp_path: Path, spec: str, config: str, edit=None) -> tuple[Optional[object], Diagnostics]:
    spec_path, config_path = _paths(tmp_path, spec, config, edit)
    diags = Diagnostics()
    return compile_spec(spec_path, config_path, diags, tmp_path / "out" / "x.plan"), diags


def _replace(old: str, new: str):
    return lambda text: text.replace(old, new, 1)


@pytest.mark.parametrize("spec, config", [("llama", "llama"), ("orpheus", "orpheus"),
                                          ("qwen3_omni", "qwen3_omni")])
def test_the_specs_edited_below_compile_unedited(tmp_path, spec, config):
    result, diags = _compile(tmp_path, spec, config)
    assert result is not None and not diags.has_errors, diags.render()
    assert reference_problems(result.plan) == []


# (spec, config, old text, new text, code, words in the message, the text the diagnostic points at)
CASES = {
    "a walk cap of 0 (decode)": (
        "llama", "llama", "cap decode 64", "cap decode 0", "MW432",
        "cap decode 0 lets a step of decode on LLM hold no rows", "cap decode 0"),
    "a walk cap of 0 (prefill)": (
        "llama", "llama", "cap prefill 16", "cap prefill 0", "MW432",
        "give a cap of at least 1, or leave the line out", "cap prefill 0"),
    "a combined walk's cap of 0": (
        "llama", "llama", "        cap 64\n", "        cap 0\n", "MW432",
        "cap 0 lets a mixed step of mixed on LLM hold no rows", "cap 0"),
    "a rows limit of 0": (
        "llama", "llama", "rows prefill <= 4", "rows prefill <= 0", "MW432",
        "rows prefill <= 0 lets a mixed step of mixed on LLM hold no prefill rows: give a limit of at least 1",
        "rows prefill <= 0"),
    "a prefill capture without token buckets": (
        "llama", "llama", "tokens=[32, 64, 128, 256, 384, 512]", "tokens=[]", "MW433",
        "lists no token buckets: give them with `tokens=[...]`", "tokens=[]"),
    "a packed capture that leaves tokens= out": (
        "llama", "llama", " tokens=[32, 64, 128, 256, 384, 512]", "", "MW433",
        "lists no token buckets", PREFILL_CAPTURE.split(" tokens=")[0]),
    "a token bucket of 0": (
        "llama", "llama", "tokens=[32, 64, 128, 256, 384, 512]", "tokens=[0]", "MW433",
        "tokens=[0]: a token bucket of 0 holds no tokens: token buckets are at least 1", "tokens=[0]"),
    "a token bucket listed twice": (
        "llama", "llama", "tokens=[32, 64, 128, 256, 384, 512]", "tokens=[32, 32]", "MW433",
        "token bucket 32 is listed twice; each token bucket is one graph, so list it once (write [32])",
        "tokens=[32, 32]"),
    "a packed capture without batch sizes": (
        "llama", "llama", MIXED_BATCH, "capture packed batch=[]", "MW433",
        "batch=[]: no batch sizes, so no graph would be captured", "batch=[]"),
    "a batch size of 0": (
        "llama", "llama", "packed batch=[1, 2, 4] tokens=[32,", "packed batch=[0, 2, 4] tokens=[32,", "MW433",
        "a batch size of 0 holds no rows: batch sizes are at least 1 (write [2, 4])", "batch=[0, 2, 4]"),
    "a batch size listed twice": (
        "llama", "llama", "packed batch=[1, 2, 4] tokens=[32,", "packed batch=[1, 2, 2] tokens=[32,", "MW433",
        "batch size 2 is listed twice", "batch=[1, 2, 2]"),
    "tokens_per_row=0": (
        "llama", "llama", "unroll_prompts=16", "tokens_per_row=0", "MW433",
        "tokens_per_row=0 captures rows of no tokens", "tokens_per_row=0"),
    "token buckets on a batched capture": (
        "llama", "llama", "unroll_prompts=16", "tokens=[64]", "MW433",
        "a batched capture has no token buckets", "tokens=[64]"),
    "a window of no items": (
        "orpheus", "orpheus", "window(28, stride=7)", "window(0, stride=7)", "MW217",
        "stream LLM.new_token into partition SNAC: a window size of 0 cuts chunks of no items",
        "window(0, stride=7)"),
    "a window that never moves": (
        "orpheus", "orpheus", "window(28, stride=7)", "window(28, stride=0)", "MW217",
        "stride=0 would never move the window", "window(28, stride=0)"),
    "fixed chunks of no items": (
        "qwen3_omni", "qwen3_omni", "fixed(1, continue_after_done)", "fixed(0, continue_after_done)", "MW217",
        "a fixed size of 0 cuts chunks of no items", "fixed(0, continue_after_done)"),
    "a window past the most tokens a step holds": (
        "orpheus", "orpheus", "window(28, stride=7)", "window(1048577, stride=7)", "MW217",
        "a chunk policy of 1048577 items is past 1048576", "window(1048577, stride=7)"),
    "left-context chunks of no items": (
        "qwen3_omni", "qwen3_omni", "left_context(chunk=25,", "left_context(chunk=0,", "MW217",
        "a left_context chunk of 0 cuts chunks of no items, so its consumer would never run; give a chunk of at "
        "least 1", "left_context(chunk=0,"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_a_value_the_plan_loader_refuses_is_a_located_error(tmp_path, case):
    spec, config, old, new, code, words, at = CASES[case]
    result, diags = _compile(tmp_path, spec, config, _replace(old, new))
    rendered = diags.render()
    assert result is None, f"compiled, expected {code}"
    errors = [d for d in diags.items if d.severity == "error"]
    assert [d.code for d in errors] == [code], rendered
    assert words in errors[0].message, rendered
    line = (tmp_path / "specs" / f"{spec}.mw").read_text().splitlines()[errors[0].span.line - 1]
    assert line[errors[0].span.col - 1:].startswith(at), rendered
    assert "Traceback" not in rendered and not (tmp_path / "out").exists()


def test_unroll_prompts_on_a_capture_without_batch_sizes_is_a_diagnostic_not_a_crash(tmp_path, capsys):
    """`mstarc check` once ended in `internal error (ValueError: max() arg is an empty sequence)` in
    check_captures' MW426, which took the largest of no batch sizes."""
    edit = _replace(DECODE_CAPTURE, "capture decode batched batch=[] unroll_prompts=16")
    spec_path, config_path = _paths(tmp_path, "llama", "llama", edit)
    assert main(["check", str(spec_path), "--config", str(config_path)]) == 1
    err = capsys.readouterr().err
    assert "internal error" not in err and "error[MW433]" in err and "batch=[]: no batch sizes" in err
    out = tmp_path / "out" / "x.plan"
    assert main(["compile", str(spec_path), "--config", str(config_path), "-o", str(out)]) == 1
    assert "error[MW433]" in capsys.readouterr().err and not out.parent.exists()


def test_lists_in_another_order_compile_and_load(tmp_path):
    """Only empty, zero and repeated entries are refused: lowering sorts the lists."""
    def edit(text):
        return text.replace("packed batch=[1, 2, 4] tokens=[32, 64, 128, 256, 384, 512]",
                            "packed batch=[4, 1, 2] tokens=[512, 32, 384, 64, 256, 128]")
    spec_path, config_path = _paths(tmp_path, "llama", "llama", edit)
    out = tmp_path / "out" / "x.plan"
    assert main(["compile", str(spec_path), "--config", str(config_path), "-o", str(out)]) == 0
    key = next(k for k in load_plan(out).workers[0].keys if k.name == "LLM:mixed")
    family = next(f for f in key.captures if f.name == "LLM:prefill")
    assert family.batch_sizes == [1, 2, 4] and family.token_buckets == [32, 64, 128, 256, 384, 512]


def _numbers(low: int, high: int, is_usable: bool) -> st.SearchStrategy[str]:
    """A capture list: any (often empty, 0 or repeated), or one mstarc can key (distinct, positive)."""
    values = (st.lists(st.integers(max(low, 1), high), min_size=1, max_size=4, unique=True) if is_usable
              else st.lists(st.integers(low, high), max_size=4))
    return values.map(lambda v: "[" + ", ".join(map(str, v)) + "]")


@st.composite
def _llama_edits(draw) -> dict[str, str]:
    """Small caps, rows limits and capture lists in llama's node: half the examples any (often 0,
    empty or repeated: almost none compiles), half sizes of at least one row, distinct (most
    compile), so the property below holds of many compiled plans, not of two in forty."""
    usable = draw(st.booleans())
    least = 1 if usable else 0
    return {
        "cap decode 64": f"cap decode {draw(st.integers(least, 70))}",
        "cap prefill 16": f"cap prefill {draw(st.integers(least, 20))}",
        "        cap 64\n": f"        cap {draw(st.integers(least, 70))}\n",
        "rows prefill <= 4": f"rows prefill <= {draw(st.integers(least, 5))}",
        "batched batch=[1, 2, 4, 8, 16, 32, 64]": f"batched batch={draw(_numbers(0, 70, usable))}",
        "packed batch=[1, 2, 4] tokens=[32, 64, 128, 256, 384, 512]":
            f"packed batch={draw(_numbers(0, 20, usable))} tokens={draw(_numbers(0, 600, usable))}",
    }


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(edits=_llama_edits())
def test_whatever_compiles_gives_tables_that_fit_together(tmp_path_factory, edits):
    def edit(text):
        for old, new in edits.items():
            assert old in text
            text = text.replace(old, new, 1)
        return text
    tmp_path = tmp_path_factory.mktemp("spec")
    spec_path, config_path = _paths(tmp_path, "llama", "llama")
    spec_path.write_text(edit(spec_path.read_text()))
    diags = Diagnostics()
    result = compile_spec(spec_path, config_path, diags, tmp_path / "x.plan")
    assert (result is None) == diags.has_errors
    if result is not None:
        assert reference_problems(result.plan) == [], diags.render()
    else:
        assert not re.search(r"internal error|Traceback", diags.render())
