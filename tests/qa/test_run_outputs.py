"""`mstar run`'s own files: a failed report or timeline write keeps --out; request ids never
become paths; the prompts file is read bounded (a device or FIFO refused at once); random prompts
files give a message or a run, never a traceback."""
from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cli_call import call_main

from mstar.cli import mstar as mstar_cli
from mstar.runtime.serve.workload import WorkloadError, read_prompts

ROOT = Path(__file__).resolve().parents[2]
ORPHEUS = str(ROOT / "generated" / "orpheus.plan")
GOOD = {"id": "a", "prompt_tokens": [1, 2, 3], "max_tokens": 4}


def _call(argv, capsys) -> tuple[int, str]:
    return call_main(mstar_cli.main, argv, capsys)


def _prompts(tmp_path: Path, *lines) -> Path:
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join((json.dumps(line) if isinstance(line, dict) else line) + "\n" for line in lines))
    return path


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="no /dev/full here")
@pytest.mark.parametrize("option", ["--report", "--timeline"])
def test_a_failed_report_or_timeline_write_keeps_the_outputs(tmp_path, capsys, option):
    out = tmp_path / "out"
    status, text = _call(["run", "--plan", ORPHEUS, "--requests", 3, "--output-len", "8..12", "--no-progress",
                          "--out", out, option, "/dev/full"], capsys)
    assert status == 1, text
    assert f"mstar: error: {option}: cannot write /dev/full: No space left on device" in text
    assert "Traceback" not in text and "internal error" not in text
    lines = [json.loads(line) for line in (out / "outputs.jsonl").read_text().splitlines()]
    assert len(lines) == 3
    assert sorted(p.name for p in out.glob("*.wav")) == sorted(name for line in lines for name in line["media"])
    assert os.path.exists("/dev/full") and not os.path.isfile("/dev/full")  # written in place, never replaced


def test_a_failed_report_write_leaves_the_old_report(tmp_path, capsys, monkeypatch):
    import mstar.files

    report = tmp_path / "run.json"
    report.write_text('{"old": true}\n')

    def fail(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(mstar.files.os, "fsync", fail)
    status, text = _call(["run", "--plan", ORPHEUS, "--engine", "sim", "--requests", 2, "--no-progress",
                          "--report", report], capsys)
    assert status == 1 and f"--report: cannot write {report}: No space left on device" in text, text
    assert report.read_text() == '{"old": true}\n'
    assert [p.name for p in tmp_path.iterdir()] == ["run.json"]  # no temporary left


@pytest.mark.parametrize("request_id, fragment", [
    ("/abs/path", "got '/'"),
    ("../../x", "got '/'"),
    ("a/b", "got '/'"),
    ("a\\b", "got '\\\\'"),
    ("a\x00b", "got '\\x00'"),
    ("a b", "got ' '"),
    ("x" * 300, "'id' must be 1 to 128 characters, got 300"),
    ("", "'id' must be 1 to 128 characters, got 0"),
])
def test_unsafe_request_ids_are_refused_with_the_line(tmp_path, capsys, request_id, fragment):
    path = _prompts(tmp_path, GOOD | {"id": "fine"}, GOOD | {"id": request_id})
    status, text = _call(["run", "--plan", ORPHEUS, "--engine", "sim", "--prompts", path, "--no-progress",
                          "--out", tmp_path / "out"], capsys)
    assert status == 1, text
    assert "prompts.jsonl:2: " in text and fragment in text, text
    assert "Traceback" not in text
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())


def test_ids_with_dots_and_colons_write_inside_out(tmp_path, capsys):
    ids = ["..", ".hidden", "a:b", "a_b", "x" * 128]
    path = _prompts(tmp_path, *(GOOD | {"id": i, "max_tokens": 12} for i in ids))
    out = tmp_path / "out"
    status, text = _call(["run", "--plan", ORPHEUS, "--prompts", path, "--no-progress", "--out", out], capsys)
    assert status == 0, text
    lines = [json.loads(line) for line in (out / "outputs.jsonl").read_text().splitlines()]
    assert sorted(line["id"] for line in lines) == sorted(ids)
    names = [name for line in lines for name in line["media"]]
    assert len(set(names)) == len(ids)
    assert sorted(p.name for p in out.iterdir()) == sorted(names + ["outputs.jsonl"])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out", "prompts.jsonl"]


@pytest.mark.parametrize("kind", ["/dev/zero", "fifo", "directory"])
def test_a_prompts_file_that_is_no_regular_file_is_refused_at_once(tmp_path, kind):
    if kind == "fifo":
        path = str(tmp_path / "prompts.fifo")
        os.mkfifo(path)  # nobody writes it: reading would block for ever
    elif kind == "directory":
        path = str(tmp_path)
    else:
        path = kind
        if not os.path.exists(path):
            pytest.skip("no /dev/zero here")
    started = time.monotonic()
    with pytest.raises(WorkloadError, match=f"cannot read prompts file {path}: "):
        read_prompts(path)
    assert time.monotonic() - started < 2.0


def test_a_prompts_file_over_the_limit_is_refused(tmp_path, monkeypatch):
    from mstar.runtime.serve import workload

    path = _prompts(tmp_path, GOOD)
    monkeypatch.setattr(workload, "MAX_PROMPTS_BYTES", 10)
    with pytest.raises(WorkloadError, match=r"prompts file .*: \d+ bytes is over the limit of 10 bytes"):
        read_prompts(str(path))


def test_a_json_string_may_hold_a_line_separator(tmp_path):
    """U+2028 inside a JSON string is not a line end (str.splitlines would split there)."""
    path = tmp_path / "prompts.jsonl"
    path.write_text('{"id": "a", "prompt_tokens": [1], "max_tokens": 2, "route": {"x\u2028y": []}}\n',
                    encoding="utf-8")
    assert read_prompts(str(path)).requests[0].route == {"x\u2028y": []}


# ---------------------------------------------------------------- fuzz: the prompts reader

_json = st.recursive(
    st.none() | st.booleans() | st.integers(-10**6, 10**6) | st.floats() | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)
_near_request = st.fixed_dictionaries(
    {"id": st.one_of(st.text(max_size=6), _json),
     "prompt_tokens": st.one_of(st.lists(st.integers(-2, 300), max_size=4), _json),
     "max_tokens": st.one_of(st.integers(-2, 6), _json)},
    optional={"temperature": _json, "top_p": _json, "seed": _json, "stop_tokens": _json, "route": _json,
              "guidance": _json, "repetition_penalty": _json},
)
_line = st.one_of(_near_request.map(lambda obj: json.dumps(obj, allow_nan=True)), _json.map(json.dumps),
                  st.text(max_size=30))
_content = st.one_of(st.binary(max_size=200),
                     st.lists(_line, max_size=5).map(lambda lines: "\n".join(lines).encode("utf-8", "surrogatepass")))


@settings(max_examples=25)
@given(content=_content)
def test_any_prompts_file_gives_a_message_or_a_run(tmp_path_factory, content):
    """Random bytes and lines shaped like requests (tests/qa/test_fuzz_file_readers.py sends its
    generic inputs to the prompts reader too): exit 0 (a valid file runs) or 1 with one
    message; never a traceback or an internal error, and quickly."""
    import contextlib
    import io

    path = tmp_path_factory.mktemp("fuzz") / "prompts.jsonl"
    path.write_bytes(content)
    stdout, stderr = io.StringIO(), io.StringIO()
    started = time.monotonic()
    with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
        status = mstar_cli.main(["run", "--plan", ORPHEUS, "--engine", "sim", "--prompts", str(path),
                                 "--no-progress"])
    text = stdout.getvalue() + stderr.getvalue()
    assert time.monotonic() - started < 2.0
    assert status in (0, 1), text
    assert "Traceback" not in text and "internal error" not in text, text
    if status == 1:
        assert text.startswith("mstar: error: "), text


def test_a_request_refused_at_admission_has_its_line_with_the_reason(tmp_path, capsys):
    # the engine refuses b at admission (it can never fit the 4-page pool); its result is written
    # like any other ending, so nothing submitted is missing from outputs.jsonl
    llama = str(ROOT / "generated" / "llama.plan")
    prompts = _prompts(tmp_path, GOOD, {"id": "b", "prompt_tokens": [1, 2, 3], "max_tokens": 400})
    status, text = _call(["run", "--plan", llama, "--engine", "sim", "--kv-pages", 4, "--prompts", prompts,
                          "--out", tmp_path / "out", "--no-progress"], capsys)
    assert status == 0, text
    written = (tmp_path / "out" / "outputs.jsonl").read_text().splitlines()
    lines = {line["id"]: line for line in map(json.loads, written)}
    assert set(lines) == {"a", "b"}
    assert lines["b"]["finish_reason"].startswith("error: can never fit") and lines["b"]["output_tokens"] == []
    assert len(lines["a"]["output_tokens"]) == 4


def test_prompts_lines_without_a_seed_sample_apart_and_repeat_with_the_runs_seed(tmp_path, capsys):
    """A line without a seed samples with --seed x 1000003 + its place in the file (a generated
    workload's rule): two lines of one prompt differ, the same --seed repeats them, a line's own
    seed is kept. With one seed for all they sampled the same tokens."""
    line = {"prompt_tokens": [1, 9, 10], "max_tokens": 6, "temperature": 1.0}
    path = _prompts(tmp_path, {"id": "a", **line}, {"id": "b", **line}, {"id": "c", **line, "seed": 3},
                    {"id": "d", **line, "seed": 3})
    assert [r.seed for r in read_prompts(str(path), seed=2).requests] == [2_000_006, 2_000_007, 3, 3]
    runs = []
    for run in range(2):
        out = tmp_path / f"out{run}"
        status, text = _call(["run", "--plan", str(ROOT / "generated" / "llama.plan"), "--prompts", path,
                              "--seed", 2, "--no-progress", "--out", out], capsys)
        assert status == 0, text
        runs.append({r["id"]: r["output_tokens"] for r in map(json.loads, (out / "outputs.jsonl").open())})
    assert runs[0] == runs[1]
    assert runs[0]["a"] != runs[0]["b"] and runs[0]["c"] == runs[0]["d"]
