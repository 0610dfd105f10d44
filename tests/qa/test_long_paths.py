"""Paths the OS cannot name, and long paths in messages: the clipped-values pass
(tests/qa/test_clipped_values.py) missed paths.

A 5,000-character name was `mstarc: internal error (OSError: [Errno 36] File name too long: ...)`
for `mstarc regen --root` (and `compile -o`, `explain`, `init`), `mstar: error: [Errno 36] File name
too long: '<all 5,000 characters>'` for `mstar run --plan`, `--weights`, `--tokenizer`, `mstar serve
--plan` and the benches' `--plan`, a traceback for `python3 -m mstar.runtime.engine.tp.memory`, a
raw OSError for the Python API's `tokenizer=`, and the whole name in "cannot read prompts file X",
"--out X", "cannot read spec X" and the like. Now every path option refuses a path past NAME_MAX
or PATH_MAX before it is used (`arg_types.path_arg`: a usage error, exit 2; `mstar run`'s own path
check, exit 1, as for its empty paths), and a message names a long path by its head and tail
(`arg_types.shown_path`). Each case failed before.
"""
from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
from cli_call import call_main

from mstar.arg_types import SHOWN_PATH_CHARS, os_error_text, path_problem, shown, shown_path, weights_problem
from mstar.cli import mstar as mstar_cli
from mstar.cli import mstarc as mstarc_cli

ROOT = Path(__file__).resolve().parents[2]
LLAMA = str(ROOT / "generated" / "llama.plan")
SPEC = str(ROOT / "specs" / "llama.mw")
LONG = "x" * 5000  # past PATH_MAX (4096) and NAME_MAX (255)
TOO_LONG = "needs a path shorter than 4096 bytes (this system's limit), got one of 5000 bytes: '" + "x" * 39 \
    + "... (5000 characters)"
CLIPPED_LONG = "x" * 90 + "..." + "x" * 90 + " (5000 characters)"  # shown_path(LONG)


def _call(main, argv, capsys) -> tuple[int, str]:
    status, text = call_main(main, argv, capsys)
    assert "Traceback" not in text and "internal error" not in text, text
    assert LONG not in text and len(text) < 1500, len(text)  # never the whole name
    return status, text


@pytest.fixture
def in_tmp(tmp_path, monkeypatch) -> Path:
    monkeypatch.chdir(tmp_path)
    return tmp_path


def _long_missing(base: Path, name: str) -> str:
    """A path the OS can name (6 names of 200 bytes), 1,200 characters and more, that is not there."""
    return str(base.joinpath(*["y" * 200] * 6, name))


# ---------------------------------------------------------------- path_problem, shown_path, os_error_text

def test_path_problem_holds_the_os_limits():
    """Measured in bytes, as the kernel counts: a name of 255 bytes is taken, 256 refused; a path
    of 4095 bytes taken, 4096 (its C string's NUL makes 4097) refused."""
    assert path_problem("x" * 255) is None and path_problem("/" + "/".join(["a"] * 2047) + "b") is None
    assert "names are at most 255 bytes each" in path_problem("x" * 256)
    assert "names are at most 255 bytes each" in path_problem("\u00e9" * 128)  # 256 bytes in UTF-8
    assert path_problem("/a" * 2048).startswith("needs a path shorter than 4096 bytes (this system's limit), got one "
                                                "of 4096 bytes: '/a/a/a")
    assert path_problem(LONG) == TOO_LONG and path_problem(b"x" * 5000) == TOO_LONG
    assert path_problem("") == "needs a path, got an empty one"
    assert path_problem("a\0b") == "needs a path without a NUL byte, got 'a\\x00b'"
    assert path_problem("a\ud800b") == "needs a path the file system can encode, got 'a\\ud800b'"  # os.stat raised


def test_a_weights_entry_is_checked_by_its_directory():
    """NODE=DIR: the part after '=' is the path; an entry the OS cannot name either way is refused."""
    near = "/".join(["y" * 200] * 20)  # 4019 bytes: with "LLM=" still under PATH_MAX
    assert weights_problem(f"LLM={near}") is None and weights_problem("LLM=" + "x" * 255) is None
    assert weights_problem("LLM=" + LONG).startswith("needs a path shorter than 4096 bytes")
    assert weights_problem("LLM=" + "x" * 300).startswith("needs a path whose names are at most 255 bytes")


def test_shown_path_keeps_a_path_whole_up_to_its_limit():
    short = "/tmp/" + "y" * (SHOWN_PATH_CHARS - 5)
    assert shown_path(short) == short and shown_path(Path("/tmp/a")) == "/tmp/a" and shown_path(b"/tmp/b") == "/tmp/b"
    assert shown_path(LONG) == CLIPPED_LONG
    long_path = "/tmp/" + "y" * 1000 + "/prompts.jsonl"
    assert shown_path(long_path) == "/tmp/" + "y" * 85 + "..." + "y" * 76 + "/prompts.jsonl (1019 characters)"


def test_os_error_text_names_its_files_clipped():
    assert os_error_text(OSError(36, "File name too long", LONG)) == f"File name too long: {CLIPPED_LONG}"
    assert os_error_text(FileNotFoundError(2, "No such file or directory")) == "No such file or directory"
    assert os_error_text(OSError(18, "Invalid cross-device link", "a", None, LONG)) == \
        f"Invalid cross-device link: a -> {CLIPPED_LONG}"
    assert os_error_text(OSError("a message of its own")) == "a message of its own"


# ---------------------------------------------------------------- mstarc: usage errors, exit 2

@pytest.mark.parametrize("argv, option", [
    (["regen", "--root", LONG], "--root"),  # mstarc: internal error (OSError ...)
    (["regen", "--check", "--root", LONG], "--root"),
    (["bench", "--runs", "1", "--root", LONG], "--root"),
    (["check", LONG], "SPEC"),  # a diagnostic naming the file, all of it twice
    (["compile", LONG], "SPEC"),
    (["compile", SPEC, "--config", LONG], "--config"),
    (["compile", SPEC, "-o", LONG + ".plan"], "-o/--output"),  # internal error
    (["explain", LONG], "PLAN"),  # internal error
    (["fmt", LONG], "SPEC"),  # "cannot read spec <all of it>"
    (["graph", LONG, "-o", "g.svg"], "SPEC"),
    (["graph", SPEC, "-o", LONG + ".svg"], "-o/--output"),  # "cannot write <all of it>"
    (["schema", "-o", LONG], "-o/--output"),
    (["init", "--from-checkpoint", LONG], "--from-checkpoint"),  # internal error
    (["init", "--from-checkpoint", ".", "--codec-checkpoint", LONG], "--codec-checkpoint"),
    (["init", "--from-checkpoint", ".", "-o", LONG], "-o/--output"),  # internal error
    (["init", "--from-checkpoint", ".", "--config-out", LONG], "--config-out"),
    (["init", "--from-checkpoint", ".", "--plan-out", LONG + ".plan"], "--plan-out"),
], ids=lambda value: value if isinstance(value, str) and len(value) < 40 else None)
def test_mstarc_refuses_a_path_the_os_cannot_name(in_tmp, capsys, argv, option):
    status, text = _call(mstarc_cli.main, argv, capsys)
    expected = TOO_LONG.replace("5000", str(len(next(a for a in argv if a.startswith(LONG)))))
    assert status == 2 and f"error: argument {option}: {expected}" in text, text
    assert list(in_tmp.iterdir()) == []  # nothing written


def test_mstarc_refuses_a_name_past_name_max(in_tmp, capsys):
    status, text = _call(mstarc_cli.main, ["regen", "--root", "a/" + "x" * 300], capsys)
    assert status == 2 and "argument --root: needs a path whose names are at most 255 bytes each (this system's " \
                           "limit), got one with a name of 300 bytes: 'a/xxx" in text, text


def test_mstarc_init_refuses_a_model_name_no_file_can_carry(in_tmp, capsys):
    """`init --name` of 5,000 letters names specs/NAME.mw, no path: it was `mstarc: internal error
    (OSError: [Errno 36] File name too long: 'specs/<5,000 x>.mw')`, then an OS error line (exit 1);
    now a usage error before anything is read (a model name is at most 200 characters)."""
    (in_tmp / "ckpt").mkdir()
    (in_tmp / "ckpt" / "config.json").write_text("{}")
    status, text = _call(mstarc_cli.main, ["init", "--from-checkpoint", "ckpt", "--name", LONG], capsys)
    assert status == 2 and text.strip() == "mstarc: --name " + shown(LONG) + ": a model name is at most 200 characters"


def test_mstarc_clips_the_name_of_any_os_error(capsys, monkeypatch):
    def broken(_args):
        raise OSError(36, "File name too long", LONG)

    monkeypatch.setattr(mstarc_cli, "cmd_schema", broken)
    status, text = _call(mstarc_cli.main, ["schema"], capsys)
    assert status == 1 and text.strip() == f"mstarc: File name too long: {CLIPPED_LONG}", text


# ---------------------------------------------------------------- mstar run: exit 1, as its empty paths

@pytest.mark.parametrize("option, value", [
    ("--plan", LONG), ("--weights", LONG), ("--weights", "LLM=" + LONG), ("--tokenizer", LONG), ("--prompts", LONG),
    ("--out", LONG), ("--report", LONG), ("--timeline", LONG + ".png"), ("--gpu-profile", LONG + ".json"),
], ids=["plan", "weights", "weights-node", "tokenizer", "prompts", "out", "report", "timeline", "gpu-profile"])
def test_mstar_run_refuses_a_path_the_os_cannot_name(in_tmp, capsys, option, value):
    """--plan, --weights and --tokenizer said "mstar: error: [Errno 36] File name too long: '<all of
    it>'"; --report and --timeline ran the workload first, then failed naming all of it."""
    argv = ["run", "--plan", LLAMA, "--engine", "sim", "--requests", "2", "--no-progress", option, value]
    status, text = _call(mstar_cli.main, argv, capsys)
    expected = TOO_LONG.replace("5000", str(len(value))).replace("'" + "x" * 39, "'" + value[:39])
    assert status == 1 and text.strip() == f"mstar: error: {option} {expected}", text
    assert list(in_tmp.iterdir()) == []


# ---------------------------------------------------------------- mstar serve, the benches, tp.memory: exit 2

@pytest.mark.parametrize("argv, option", [
    (["serve", "--plan", LONG], "--plan"),
    (["serve", "--plan", LLAMA, "--tokenizer", LONG], "--tokenizer"),
    (["serve", "--plan", LLAMA, "--weights", LONG], "--weights"),
    (["serve", "--plan", LLAMA, "--weights", "LLM=" + LONG], "--weights"),
    (["bench", "kv", "--plan", LONG], "--plan"),
    (["bench", "runner", "--plan", LONG], "--plan"),
    (["bench", "postprocess", "--plan", LONG], "--plan"),
    (["bench", "lone", "--plan", LONG], "--plan"),
    (["bench", "offload", "--plan", LONG], "--plan"),
    (["bench", "engine", "--plan", LONG], "--plan"),  # "needs a CUDA GPU" first
    (["bench", "gdn", "--plan", LONG], "--plan"),
    (["bench", "products", "--plan", LONG], "--plan"),
    (["bench", "load", "--dir", LONG], "--dir"),
    (["bench", "serve", "--base-url", "http://127.0.0.1:1", "--dataset", LONG], "--dataset"),
], ids=["serve-plan", "serve-tokenizer", "serve-weights", "serve-weights-node", "kv", "runner", "postprocess",
        "lone", "offload", "engine", "gdn", "products", "load", "serve-dataset"])
def test_a_path_option_refuses_a_path_the_os_cannot_name(in_tmp, capsys, argv, option):
    status, text = _call(mstar_cli.main, argv, capsys)
    value = argv[argv.index(option) + 1]
    expected = TOO_LONG.replace("5000", str(len(value))).replace("'" + "x" * 39, "'" + value[:39])
    assert status == 2 and f": error: argument {option}: {expected}" in text, text
    assert list(in_tmp.iterdir()) == []


def test_tp_memory_refuses_a_plan_path_the_os_cannot_name(capsys):
    """`python3 -m mstar.runtime.engine.tp.memory --plan <5000 x>` ended in a traceback."""
    from mstar.runtime.engine.tp import memory

    status, text = _call(memory.main, ["--plan", LONG], capsys)
    assert status == 2 and f"error: argument --plan: {TOO_LONG}" in text, text


def test_mstar_clips_the_name_of_an_os_error_it_reaches(capsys, monkeypatch):
    """`_guarded` printed str(error): "[Errno 36] File name too long: '<all 5,000 characters>'"."""
    from mstar.runtime.serve import bench_scheduler

    def broken(_argv):
        raise OSError(36, "File name too long", LONG)

    monkeypatch.setattr(bench_scheduler, "main", broken)
    status, text = _call(mstar_cli.main, ["bench", "scheduler"], capsys)
    assert status == 1 and text.strip() == f"mstar: error: File name too long: {CLIPPED_LONG}", text


# ---------------------------------------------------------------- the Python API

@pytest.mark.parametrize("arguments, words", [
    ({"tokenizer": "x" * 10_000}, "tokenizer needs a path shorter than 4096 bytes"),  # OSError from Path.is_file
    ({"tokenizer": "x" * 300}, "tokenizer needs a path whose names are at most 255 bytes each"),
    ({"weights": ["x" * 10_000]}, "weights entry needs a path shorter than 4096 bytes"),
    ({"weights": ["LLM=" + "x" * 300]}, "weights entry needs a path whose names are at most 255 bytes each"),
], ids=["tokenizer", "tokenizer-name", "weights", "weights-name"])
def test_the_python_api_refuses_a_path_the_os_cannot_name(arguments, words):
    from mstar.runtime.serve.api import LLM
    from mstar.runtime.serve.engine_setup import SetupError

    with pytest.raises(SetupError) as refused:
        LLM(LLAMA, engine="sim", **arguments)
    assert str(refused.value).startswith(words) and len(str(refused.value)) < 250, refused.value


def test_the_python_api_refuses_a_plan_path_the_os_cannot_name():
    from mstar.runtime.serve.api import LLM
    from mstar.runtime.serve.engine_setup import SetupError

    with pytest.raises(SetupError, match=r"^plan needs a path shorter than 4096 bytes .*\(10000 characters\)$"):
        LLM("x" * 10_000, engine="sim")  # an OSError from load_plan's Path.exists


def test_the_tokenizer_lookup_takes_any_path():
    from mstar.plan.io import load_plan
    from mstar.runtime.serve.tokenizer import TokenizerError, has_tokenizer, tokenizer_dir

    assert not has_tokenizer("x" * 10_000)  # Path.is_file raised ENAMETOOLONG
    with pytest.raises(TokenizerError, match=r"^--tokenizer needs a path shorter than 4096 bytes"):
        tokenizer_dir(load_plan(LLAMA), {}, "x" * 10_000)
    with pytest.raises(TokenizerError, match=r"^--weights x{90}\.\.\.x{90} \(10000 characters\): no such directory"):
        tokenizer_dir(load_plan(LLAMA), {"LLM": "x" * 10_000}, None)  # (os.path.isdir: False, never raising)


def test_a_plan_path_past_the_limits_is_a_plan_error():
    """load_plan's Path.exists raised the OSError (tp.memory, the Python API's Plan readers)."""
    from mstar.plan.io import PlanError, load_plan

    with pytest.raises(PlanError) as refused:
        load_plan("x" * 10_000)
    assert str(refused.value) == "cannot read plan " + "x" * 90 + "..." + "x" * 90 + " (10000 characters): cannot " \
                                 "read it (File name too long)"


# ---------------------------------------------------------------- messages naming a long path clip it

def test_mstar_run_names_a_long_prompts_path_clipped(tmp_path, capsys):
    prompts = _long_missing(tmp_path, "p.jsonl")
    status, text = _call(mstar_cli.main, ["run", "--plan", LLAMA, "--engine", "sim", "--no-progress",
                                          "--prompts", prompts], capsys)
    assert status == 1 and text.strip() == f"mstar: error: cannot read prompts file {shown_path(prompts)}: no such " \
                                           "file", text
    assert shown_path(prompts).endswith("yyy/p.jsonl (" + str(len(prompts)) + " characters)")


def test_mstar_run_names_a_long_out_path_clipped(tmp_path, capsys):
    (tmp_path / "a_file").write_text("")
    out = _long_missing(tmp_path / "a_file", "out")  # its parent is a file: no folder can be made
    status, text = _call(mstar_cli.main, ["run", "--plan", LLAMA, "--engine", "sim", "--no-progress", "--out", out],
                         capsys)
    assert status == 1 and text.strip() == f"mstar: error: --out {shown_path(out)}: cannot create directory: Not a " \
                                           "directory", text


@pytest.mark.parametrize("argv, words", [
    (["fmt", "{path}.mw"], "mstarc: cannot read spec {shown}: no such file"),
    (["check", "{path}.mw"], "{shown}:1:1: error[MW500]: spec file not found: {shown}"),
    (["regen", "--root", "{path}"], "mstarc: {shown} has no configs/ and no specs/; run from the repository root or "
                                    "pass --root"),
    (["init", "--from-checkpoint", "{path}"], "mstarc: --from-checkpoint {shown}: no config.json there"),
], ids=["fmt", "check", "regen", "init"])
def test_mstarc_names_a_long_path_clipped(in_tmp, capsys, argv, words):
    path = _long_missing(in_tmp, "s")
    argv = [a.replace("{path}", path) for a in argv]
    status, text = _call(mstarc_cli.main, argv, capsys)
    named = next(a for a in argv if a.startswith(path))
    assert status == 1 and words.replace("{shown}", shown_path(named)) in text, text
    assert path not in text


def test_bench_serve_names_a_long_dataset_path_clipped(tmp_path, capsys):
    dataset = _long_missing(tmp_path, "d.jsonl")
    status, text = _call(mstar_cli.main, ["bench", "serve", "--base-url", "http://127.0.0.1:1", "--dataset", dataset],
                         capsys)
    assert status == 1 and f"cannot read dataset {shown_path(dataset)}: no such file" in text, text


def test_the_python_api_names_a_long_plan_path_clipped(tmp_path):
    from mstar.runtime.serve.api import LLM
    from mstar.runtime.serve.engine_setup import SetupError

    plan = _long_missing(tmp_path, "p.plan")
    with pytest.raises(SetupError) as refused:
        LLM(plan, engine="sim")
    assert str(refused.value) == f"plan {shown_path(plan)} does not exist; compile one with `mstarc compile SPEC`"
    assert os.path.basename(plan) in str(refused.value)  # the tail, the file's own name, is kept


# ---------------------------------------------------------------- deep paths (files.make_dirs)

def _deep(base: Path, name: str) -> str:
    """A valid path 1,100 levels deep (2,200 characters of "d/"): os.makedirs and
    Path.mkdir(parents=True) recursed once a missing level and raised RecursionError."""
    return str(base / ("d/" * 1100 + name))


def _remove_deep(base: Path) -> None:
    """Take the deep tree down from its bottom: pytest's own clean-up of its temporary folders
    recurses a level too and raised RecursionError at exit."""
    for depth in range(1100, 0, -1):
        folder = base.joinpath(*["d"] * depth)
        if folder.is_dir():
            for entry in os.scandir(folder):  # the deeper levels are gone: a shallow folder (--out's) or files
                shutil.rmtree(entry.path) if entry.is_dir(follow_symlinks=False) else os.unlink(entry.path)
            folder.rmdir()


@pytest.mark.parametrize("main, argv", [
    (mstar_cli.main, ["run", "--plan", LLAMA, "--requests", "1", "--no-progress", "--report", "{deep}r.json"]),
    (mstar_cli.main, ["run", "--plan", LLAMA, "--requests", "1", "--no-progress", "--out", "{deep}out"]),
    (mstarc_cli.main, ["schema", "-o", "{deep}schema.json"]),
])
def test_a_deep_output_path_is_made(main, argv, in_tmp, capsys, request):
    deep = _deep(in_tmp, "")
    request.addfinalizer(lambda: _remove_deep(in_tmp))
    status, text = call_main(main, [a.replace("{deep}", deep + os.sep) for a in argv], capsys)
    assert status == 0 and "internal error" not in text and "Recursion" not in text, text[-300:]
    assert os.path.isdir(deep)


def test_make_dirs_leaves_what_exists_and_refuses_a_file_in_the_way(tmp_path):
    from mstar.files import make_dirs

    make_dirs(tmp_path / "a" / "b")
    make_dirs(tmp_path / "a" / "b")  # exists: left as it is
    assert (tmp_path / "a" / "b").is_dir()
    (tmp_path / "f").write_text("x")
    with pytest.raises(OSError):
        make_dirs(tmp_path / "f" / "g")
