"""Compiler-side inputs are bounded (issue 15, points 6, 8 and 9).

Every case runs `mstarc` in-process under bounded_call's limits (2 s, 500 MB of Python
allocations) and checks: exit 1 with the expected message, no traceback, no internal error.
Before the bounds, these inputs took 3.7 GB (alias bomb), read forever (/dev/zero, a FIFO),
took 20 s and 7.8 GB or ended in MemoryError (a billion layers), never finished (nested loops),
or ended in an internal error (deep nesting, surrogates, NaN in a plan, huge integers, NUL).
"""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from bounded_call import call_bounded
from mstar.cli import mstarc as mstarc_cli
from mstar.plan.io import content_hash, dump_plan
from mstar.plan.schema import Plan

ROOT = Path(__file__).resolve().parents[2]

BILLION_LAUGHS = "\n".join(
    ['  a: &a ["lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol"]']
    + [f"  {c}: &{c} [" + ", ".join([f"*{p}"] * 9) + "]" for p, c in zip("abcdefgh", "bcdefghi")])


@pytest.fixture
def work(tmp_path) -> Path:
    shutil.copytree(ROOT / "specs", tmp_path / "specs")
    shutil.copytree(ROOT / "configs", tmp_path / "configs")
    return tmp_path


def mstarc(argv, capsys, fragment: str, status: int = 1) -> str:
    outcome = call_bounded(mstarc_cli.main, argv, capsys)
    outcome.assert_clean()
    assert outcome.status == status, outcome.text
    assert fragment in outcome.text, outcome.text
    return outcome.text


def _config(work: Path, extra: str, name: str = "bad") -> Path:
    path = work / "configs" / f"{name}.yaml"
    path.write_text((work / "configs" / "orpheus.yaml").read_text() + extra)
    return path


def _check(work: Path, config: Path) -> list:
    return ["check", work / "specs" / "orpheus.mw", "--config", config]


# ---------------------------------------------------------------- deployment YAML

@pytest.mark.parametrize("where", ["unknown_key:\n", "model_kwargs:\n"])
def test_alias_bomb_is_measured_not_expanded(work, capsys, where):
    assert len(BILLION_LAUGHS) < 1024
    config = _config(work, "\n" + where + BILLION_LAUGHS + "\n")
    mstarc(_check(work, config), capsys, "expands to 490,329,")


def test_yaml_nested_5000_deep(work, capsys):
    config = _config(work, "\nmodel_kwargs: {a: " + "[" * 5000 + "]" * 5000 + "}\n")
    mstarc(_check(work, config), capsys, "nested more than 64 levels deep")


def test_unpaired_surrogate(work, capsys):
    config = _config(work, '\nmodel_kwargs: {a: "\\ud800"}\n')
    mstarc(_check(work, config), capsys, "unpaired surrogate")


def test_non_finite_numbers_are_refused_where_they_stand_and_never_reach_a_plan(work, capsys):
    config = _config(work, "\nmodel_kwargs: {a: .nan, b: .inf, c: [-.inf]}\n")
    plan = work / "out" / "bad.plan"
    text = mstarc(["compile", work / "specs" / "orpheus.mw", "--config", config, "-o", plan], capsys,
                  "nan is not a finite number")
    assert ":19: error[MW304]: nan" in text
    assert ":28: error[MW304]: inf" in text
    assert ":38: error[MW304]: -inf" in text
    assert not plan.exists()


@pytest.mark.parametrize("key, value", [("num_pages", 2**63), ("page_size", 2**63),
                                        ("num_pages", 2**63 - 1), ("page_size", 2**31)])
def test_huge_kv_pool_values(work, capsys, key, value):
    text = (work / "configs" / "orpheus.yaml").read_text()
    text = "\n".join(f"  {key}: {value}" if line.strip().startswith(f"{key}:") else line
                     for line in text.splitlines())
    config = work / "configs" / "bad.yaml"
    config.write_text(text + "\n")
    mstarc(_check(work, config), capsys, "error[MW304]")


def test_a_pool_that_fits_int32_but_not_memory(work, capsys):
    config = _config(work, "").with_name("pool.yaml")
    config.write_text((work / "configs" / "orpheus.yaml").read_text().replace("16384", "2000000000"))
    mstarc(_check(work, config), capsys, "error[MW323]: KV pool of LLM")


def test_dates_and_binary_are_not_deployment_values(work, capsys):
    config = _config(work, "\nmodel_kwargs: {a: 2001-12-14, b: !!binary aGVsbG8=}\n")
    mstarc(_check(work, config), capsys, "a date value is not a deployment value")


# ---------------------------------------------------------------- files that are not files

@pytest.fixture
def fifo(tmp_path) -> Path:
    path = tmp_path / "fifo"
    os.mkfifo(path)
    return path


def test_dev_zero_and_fifo_as_spec_or_deployment(work, capsys, fifo):
    for special in ("/dev/zero", fifo):
        mstarc(["check", special, "--config", work / "configs" / "orpheus.yaml"], capsys,
               "not a regular file")
        mstarc(["check", work / "specs" / "orpheus.mw", "--config", special], capsys,
               "not a regular file")
        mstarc(["fmt", special], capsys, "not a regular file")
        mstarc(["explain", special], capsys, "not a regular file")


def test_oversized_spec(work, capsys):
    spec = work / "specs" / "huge.mw"
    spec.write_text("model m\n" + "# padding\n" * 200_000)
    mstarc(["check", spec, "--config", work / "configs" / "orpheus.yaml"], capsys, "over the limit")


# ---------------------------------------------------------------- plans

def _compiled_plan(work: Path, capsys) -> Path:
    plan = work / "out" / "orpheus.plan"
    mstarc(["compile", work / "specs" / "orpheus.mw", "-o", plan], capsys, "wrote", status=0)
    return plan


def _rewrite_header(plan_path: Path, **updates) -> None:
    """Edit header fields and recompute the content hash, as a careful hand edit would."""
    data = json.loads(plan_path.read_text())
    data["header"].update(updates)
    plan = Plan.model_validate(data)
    header = plan.header.model_copy(update={"content_sha256": content_hash(plan)})
    plan_path.write_text(dump_plan(plan.model_copy(update={"header": header})))


@pytest.mark.parametrize("field, fragment", [("spec_path", "not a regular file"),
                                             ("deployment_path", "not a regular file"),
                                             ("glue_path", "names its glue")])  # refused before any read
def test_plan_inputs_that_read_forever(work, capsys, fifo, field, fragment):
    plan = _compiled_plan(work, capsys)
    for special in ("/dev/zero", str(fifo)):
        _rewrite_header(plan, **{field: special})
        mstarc(["explain", plan], capsys, fragment)


def test_plan_input_path_with_nul(work, capsys):
    plan = _compiled_plan(work, capsys)
    _rewrite_header(plan, spec_path="../specs/orpheus.mw\0x")
    mstarc(["explain", plan], capsys, "may not contain a NUL byte")


@pytest.mark.parametrize("body, fragment", [
    ('{"header": {"a": ' + "[" * 200_000 + "]" * 200_000 + "}}", "nests its values too deeply"),
    ('{"header": {"schema_version": 1' + "0" * 5000 + "}}", "is out of range"),
    ('{"header": {"schema_version": NaN}}', "NaN is not a JSON number"),
])
def test_plan_json_that_is_not_a_plan(tmp_path, capsys, body, fragment):
    plan = tmp_path / "bad.plan"
    plan.write_text(body)
    mstarc(["explain", plan], capsys, fragment)


# ---------------------------------------------------------------- specs

SPEC = """model m
node LLM kv(layers={layers}, kv_heads=8, qo_heads=24, head_dim=128, hidden=3072, vocab=156940) {{
    in text_inputs
}}
walk prefill {{
    LLM(text_inputs) -> new_token: client text
}}
partition P = prefill
"""


@pytest.mark.parametrize("layers", [10**9, 10**12])
def test_a_billion_layers_states_the_memory(tmp_path, capsys, layers):
    spec = tmp_path / "big.mw"
    spec.write_text(SPEC.format(layers=layers))
    text = mstarc(["check", spec, "--config", ROOT / "configs" / "llama.yaml"], capsys, "error[MW123]")
    assert "TiB of weights and state" in text


def test_twenty_nested_loops(tmp_path, capsys):
    body = "LLM(text_inputs) -> new_token: client text"
    for _ in range(20):
        body = f"loop max=3 {{\n{body}\n}}"
    spec = tmp_path / "nested.mw"
    spec.write_text(SPEC.format(layers=2).replace("LLM(text_inputs) -> new_token: client text", body))
    mstarc(["check", spec, "--config", ROOT / "configs" / "llama.yaml"], capsys, "error[MW214]")


def test_a_capture_of_a_hundred_million_rows_without_a_budget(work, capsys):
    """Lowering sizes a lookup table by the largest batch: this took over a minute and 2.4 GB."""
    spec = work / "specs" / "llama.mw"
    huge = spec.read_text().replace("batch=[1, 2, 4, 8, 16, 32, 64]", "batch=[1, 2, 4, 8, 16, 32, 64, 100000000]")
    spec.write_text(huge)
    config = work / "configs" / "nobudget.yaml"
    config.write_text("".join(line for line in (work / "configs" / "llama.yaml").read_text().splitlines(True)
                              if not line.startswith("capture_memory_budget_mb")))
    mstarc(["compile", spec, "--config", config, "-o", work / "out.plan"], capsys, "error[MW411]")


def test_a_combined_walk_of_fourteen_walks(tmp_path, capsys):
    """The plan lists all 2**n mixtures of a combined walk: 14 walks made a 3 MB plan in 6 s."""
    walks = [f"w{i}" for i in range(14)]
    spec = tmp_path / "comb.mw"
    spec.write_text(
        "model m\nnode LLM kv(layers=2, kv_heads=2, qo_heads=4, head_dim=64, hidden=256, vocab=1024) {\n"
        "    in text_inputs: tokens prompt text\n    out text_inputs: tokens\n    out new_token: tokens\n"
        f"    combine all = {' + '.join(walks)} {{\n        cap 4\n    }}\n}}\n"
        + "".join(f"walk {w} {{\n    LLM(text_inputs) -> new_token: client text\n}}\n" for w in walks)
        + f"partition P = {' -> '.join(walks)}\n")
    config = tmp_path / "comb.yaml"
    config.write_text("model: m\nmax_seq_len: 1024\nnode_groups:\n  - node_names: [LLM]\n    ranks: [0]\n")
    mstarc(["compile", spec, "--config", config, "-o", tmp_path / "comb.plan"], capsys,
           "combined walk all mixes 14 walks; at most 12")


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs FIFOs")
def test_a_fifo_swapped_in_after_a_stat_of_the_path_does_not_block_the_read(tmp_path, monkeypatch):
    """The file kind was checked by os.stat(path), then the path opened: a FIFO put in its place
    between the two blocked the open (no writer comes) forever. The kind is now read from the
    opened descriptor; here every stat of the path swaps the file for a FIFO just after it."""
    import threading

    from mstar.files import InputFileError, read_bytes_bounded

    path = tmp_path / "spec.mw"
    path.write_text("model m {}\n")
    real_stat = os.stat

    def stat_then_swap(target, *args, **kwargs):
        info = real_stat(target, *args, **kwargs)
        if str(target) == str(path) and not os.path.exists(str(path) + ".swapped"):
            os.unlink(path)
            os.mkfifo(path)
            Path(str(path) + ".swapped").touch()
        return info

    monkeypatch.setattr(os, "stat", stat_then_swap)
    outcome: list = []

    def read() -> None:
        try:
            outcome.append(read_bytes_bounded(path, max_bytes=1024, what="spec"))
        except InputFileError as error:
            outcome.append(error)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    reader.join(timeout=5)
    if reader.is_alive():  # let the blocked open return, so the thread ends
        with open(path, "wb"):
            pass
    assert outcome, "the read blocked on a FIFO swapped in after the stat"
