"""The bench commands' integer options share one range check (mstar/arg_types.py): a value out of
range, or not an integer, is a one-line argparse error naming the option, with exit status 2,
before any work starts (no plan loaded, no GPU looked for)."""
from __future__ import annotations

import argparse

import pytest

from mstar.arg_types import int_range
from mstar.cli.mstar import main
from mstar.cli.mstarc import main as mstarc_main


@pytest.mark.parametrize("argv, message", [
    (["bench", "postprocess", "--clients", "0"], "argument --clients: must be between 1 and 1000000, got 0"),
    (["bench", "runner", "--rounds", "100001"], "argument --rounds: must be between 1 and 100000, got 100001"),
    (["bench", "kv", "--decode-rows", "0"], "argument --decode-rows: must be between 1 and 4096, got 0"),
    (["bench", "kv", "--decode-rows", "100000000"], "argument --decode-rows: must be between 1 and 4096"),
    (["bench", "scheduler", "--iters", "99999999999"], "argument --iters: must be between 1 and 1000000"),
    (["bench", "kv", "--prefix-requests", "1"], "argument --prefix-requests: must be between 2 and 4096, got 1"),
    (["bench", "kv", "--budget", "x"], "argument --budget: must be an integer, got 'x'"),
    (["bench", "scheduler", "--warmup", "-1"], "argument --warmup: must be between 0 and 1000000, got -1"),
    (["bench", "attention", "--kv-heads", "0"], "argument --kv-heads: must be between 1 and 256, got 0"),
    (["bench", "load", "--layers", "-3"], "argument --layers: must be between 1 and 4096, got -3"),
    (["bench", "engine", "--iters", "0"], "argument --iters: must be between 1 and 100000, got 0"),
    # each ran for ever on any machine (--host-pack needs no GPU)
    (["bench", "engine", "--host-pack", "--iters", "1000000000000"], "argument --iters: must be between 1 and 100000"),
    (["bench", "attention", "--context", "10000000000"], "argument --context: must be between 1 and 1048576"),
    # --decode's options without it were ignored, and its --iters past 100 cut to 100, unsaid (a bench audit)
    (["bench", "attention", "--context", "512", "--spread"], "--context, --spread: options of --decode, which was"),
    (["bench", "attention", "--decode", "--iters", "500"], "--decode: --iters is at most 100 graph replays, got 500"),
    # the device's options beside --host-pack were ignored: its table, exit 0
    (["bench", "engine", "--host-pack", "--capture-only", "--decode-kernel", "cuda", "--no-pdl"],
     "--host-pack times the host's packing alone; --decode-kernel, --capture-only, --no-pdl time the device"),
])
def test_an_option_out_of_range_is_one_usage_error(capsys, argv, message):
    with pytest.raises(SystemExit) as stop:
        main(argv)
    assert stop.value.code == 2
    err = capsys.readouterr().err
    assert f"mstar {' '.join(argv[:2])}: error: {message}" in err and "Traceback" not in err


@pytest.mark.parametrize("runs", ["0", "1000000000"])  # 10**9 ran for ever
def test_mstarc_bench_runs_takes_the_same_check(capsys, runs):
    with pytest.raises(SystemExit) as stop:
        mstarc_main(["bench", "--runs", runs])
    assert stop.value.code == 2
    assert f"argument --runs: must be between 1 and 1000, got {runs}" in capsys.readouterr().err


def test_the_range_type_says_a_huge_integer_is_out_of_range_and_clips_it():
    """An integer past int()'s 4,300 digits was "must be an integer, got '<5,000 digits>'"."""
    within = int_range(2, 5)
    for text, message in [("9" * 5000, "must be between 2 and 5, got '" + "9" * 39 + "... (5000 characters)"),
                          ("1" * 60, "must be between 2 and 5, got " + "1" * 40 + "... (60 digits)")]:
        with pytest.raises(argparse.ArgumentTypeError) as refused:
            within(text)
        assert str(refused.value) == message


def test_the_range_type_keeps_values_inside_it():
    within = int_range(2, 5)
    assert [within(text) for text in ("2", "5")] == [2, 5]
    for text in ("1", "6", "2.5"):
        with pytest.raises(argparse.ArgumentTypeError):
            within(text)


@pytest.mark.parametrize("argv, message", [
    # the decode rows' max_tokens passes max_seq_len at budget 1: every request refused (an IndexError;
    # then "40 of 40 requests failed", after the decode-only run)
    (["bench", "kv", "--engine", "sim", "--scenario", "chunk", "--budget", "1"], "give --prompt-len 5776 or fewer, "
                                                                                "or --budget 42 or more"),
    (["bench", "kv", "--engine", "torch", "--device", "cuda:7", "--scenario", "chunk"], "--device cuda:7"),
    # prompt + output past max_seq_len: every request refused, a table of dashes that exited 0
    (["bench", "postprocess", "--output-len", "8100", "--rounds", "1", "--requests", "2", "--clients", "2"],
     "--prompt-len 100 + --output-len 8100 is past the plan's max_seq_len 8192"),
    # blamed a decode request sized from it: "prompt (16) + max_tokens (307846) ..."
    (["bench", "kv", "--prompt-len", "1000000"], "max_seq_len 16384 tokens a request: --prompt-len 1000000"),
    # ran 44 s, then named the prompt's token ids past the vocabulary, not its length
    (["bench", "postprocess", "--prompt-len", "200000"], "--prompt-len 200000 + --output-len 200 is past"),
    (["bench", "load", "--device", "cuda"], "this machine has no CUDA GPU"),
    (["bench", "load", "--device", "bogus"], "--device 'bogus': not a device name (cpu, cuda, cuda:N)"),
    (["bench", "load", "--layers", "4096", "--hidden", "65536"], "is more than this machine's"),
])
def test_a_bench_that_cannot_run_says_why_in_one_line(capsys, tmp_path, argv, message):
    """Each was a traceback (or, for postprocess, a report of nothing with exit 0)."""
    import torch

    if "cuda" in argv and torch.cuda.is_available():
        pytest.skip("a GPU is here")
    extra = ["--dir", str(tmp_path / "ckpt")] if argv[1] == "load" else []
    assert main([*argv, *extra]) == 1
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err
    assert not (tmp_path / "ckpt").exists()  # bench load refused before writing a checkpoint


def test_bench_load_writes_only_into_a_new_or_empty_folder(capsys, tmp_path):
    """It wrote config.json and model-0000N.safetensors into any folder named (replacing files of
    those names) and made missing parents."""
    full = tmp_path / "full"
    full.mkdir()
    (full / "notes.txt").write_text("mine")
    small = ["--layers", "1", "--hidden", "256", "--vocab", "64"]
    assert main(["bench", "load", "--dir", str(full), *small]) == 1
    assert "holds other files and no checkpoint" in capsys.readouterr().err
    assert sorted(p.name for p in full.iterdir()) == ["notes.txt"]
    assert main(["bench", "load", "--dir", str(tmp_path / "no" / "such" / "x"), *small]) == 1
    assert "its parent folder does not exist" in capsys.readouterr().err and not (tmp_path / "no").exists()
    empty = tmp_path / "empty"
    empty.mkdir()
    assert main(["bench", "load", "--dir", str(empty), *small]) == 0  # written, then reused
    assert main(["bench", "load", "--dir", str(empty), *small]) == 0
