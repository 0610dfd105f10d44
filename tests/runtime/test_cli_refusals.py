"""Bad input to `mstar` is one error line and a non-zero exit, never a traceback nor a silent
success: cases an audit of the command line found (each gave a traceback, a hang, an exit 0 that
measured or ran nothing, or an option quietly ignored)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from mstar.cli.mstar import main
from mstar.plan.io import load_plan
from mstar.runtime.engine.prompt_limits import text_prompt_vocab
from mstar.runtime.serve.workload import generate

pytestmark = pytest.mark.usefixtures("ordinary_signals")  # conftest.py: signals not inherited ignored

ROOT = Path(__file__).resolve().parents[2]
LLAMA = str(ROOT / "generated" / "llama.plan")
ORPHEUS_TP2 = str(ROOT / "generated" / "orpheus_tp2.plan")
COSMOS = str(ROOT / "generated" / "cosmos3.plan")


def _error(capsys) -> str:
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return err


@pytest.mark.parametrize("argv, words", [
    (["bench", "kv", "--scenario", "prefix", "--prefix-len", "20000", "--prefix-requests", "2", "--prefix-rounds",
      "1"], "produced no token"),  # past max_seq_len: a RuntimeError's traceback
    (["bench", "postprocess", "--plan", COSMOS, "--requests", "4", "--rounds", "1"], "not one loop step"),
    (["run", "--plan", LLAMA, "--arrival", "poisson", "--rate", "1e-300", "--requests", "2"], "more than 86400 s"),
    # refused before anything is drawn (an audit: 31 s and 2.9 GB of requests first)
    (["run", "--plan", LLAMA, "--arrival", "staggered", "--rate", "1e-300", "--requests", "2000000"],
     "more than 86400 s"),
    # 100 prompts of 10**6 tokens took 28 s and 3.1 GB, then every one was refused; 1,000 passed 12 GB
    (["run", "--plan", LLAMA, "--engine", "sim", "--requests", "1000", "--prompt-len", "1000000..1000000"],
     "tokens a generated workload may hold"),
    (["run", "--plan", LLAMA, "--output-len", "99999999999999999999"], "--output-len must be at most"),
    # past the decode loop's 2048 after the prefill's token: each request ended `length` at 2049
    (["run", "--plan", LLAMA, "--output-len", "3000..3000", "--requests", "2"], "at most 2049 output tokens"),
    (["run", "--plan", LLAMA, "--requests", "2", "--route", "LLM="], "leaves every partition out"),
    # SNAC starts only from the LLM's stream: every request ran nothing, "2 ok", finish `stop`
    (["run", "--plan", str(ROOT / "generated" / "orpheus.plan"), "--engine", "sim", "--route", "LLM="],
     "leaves out every partition a request starts (LLM; SNAC starts only from streams)"),
    (["run", "--plan", LLAMA, "--engine", "sim", "--dims", "spec"], "--dims chooses the torch engine's model"),
    # no rank process to wait for: it was ignored
    (["run", "--plan", ORPHEUS_TP2, "--engine", "sim", "--rank-timeout", "3"], "--rank-timeout bounds the wait"),
    # closed arrivals (the default) or a prompts file: --rate was ignored, exit 0 (a report audit)
    (["run", "--plan", LLAMA, "--engine", "sim", "--rate", "5"], "--rate sets the arrivals of --arrival poisson"),
    (["run", "--plan", LLAMA, "--requests", "2", "--rank-timeout", "3"], "this run has none"),
    # a generated workload has no audio: every request failed on the torch engine
    (["run", "--plan", str(ROOT / "generated" / "qwen3_asr.plan"), "--requests", "2"],
     "a generated workload has no audio"),
    # an empty path was taken for no option at all: exit 0, nothing written
    (["run", "--plan", LLAMA, "--engine", "sim", "--requests", "2", "--report", ""], "--report needs a path"),
    (["run", "--plan", LLAMA, "--engine", "sim", "--requests", "2", "--out", ""], "--out needs a path"),
    # every request past max_seq_len: refused before the run now (it ran and failed each one)
    (["run", "--plan", LLAMA, "--prompt-len", "9000..9000", "--requests", "2", "--engine", "sim"],
     "longer than the plan's 8192 tokens"),
    (["run", "--plan", LLAMA, "--requests", "1", "--device", ""], "not a device name"),  # ran on the CPU
    (["run", "--plan", LLAMA, "--requests", "1", "--device", "cpu:5"], "not a device name"),
    (["serve", "--plan", LLAMA, "--engine", "sim", "--dims", "spec"], "options of the torch engine"),
    # 64 decode rows and a chunk never fit llama_chunked's 64-row mixed step: the run said "raise --output-len"
    (["bench", "runner", "--plan", str(ROOT / "generated" / "llama_chunked.plan"), "--long-prompt", "8192"],
     "give --clients 63 or fewer"),
    # os.access said yes as root, and the run failed at its end: refused before it now
    (["run", "--plan", LLAMA, "--engine", "sim", "--requests", "1", "--report", "/proc/mstar-report.json"],
     "--report /proc/mstar-report.json is not writable"),
    (["run", "--plan", LLAMA, "--engine", "sim", "--requests", "1", "--timeline", "/proc/mstar-timeline.png"],
     "--timeline /proc/mstar-timeline.png is not writable"),
])
def test_a_refusal_is_one_line_and_exit_1(capsys, argv, words):
    assert main([*argv, "--no-progress"] if argv[0] == "run" else argv) == 1
    assert words in _error(capsys)


@pytest.mark.parametrize("argv", [
    [ORPHEUS_TP2, "--rank-timeout", "inf"],  # an OverflowError
    [ORPHEUS_TP2, "--rank-timeout", "1e-9"],  # torch waited 0 ms
    [LLAMA, "--ranks", "inproc", "--rank-timeout", "-1"],
    [LLAMA, "--ranks", "inproc", "--rank-timeout", "nan"],
])
def test_a_rank_timeout_out_of_range_is_a_usage_error(capsys, argv):
    """Checked by its argparse type (mstar/arg_types.py float_range) before the plan is read."""
    with pytest.raises(SystemExit) as stopped:
        main(["run", "--plan", *argv])
    assert stopped.value.code == 2
    assert "argument --rank-timeout: must be a number in [0.01, 86400], got" in _error(capsys)


def test_a_seed_past_64_bits_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as stopped:  # every request failed on its seed, exit 0
        main(["run", "--plan", LLAMA, "--seed", str(10**26)])
    assert stopped.value.code == 2 and "--seed" in _error(capsys)


def test_bench_load_refuses_a_dir_it_cannot_use(capsys, tmp_path):
    sizes = ["--layers", "1", "--hidden", "256", "--vocab", "16"]
    a_file = tmp_path / "a_file"
    a_file.write_text("")
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text("{bad")
    for directory, words in ((a_file, "is not a directory"), (broken, "not valid JSON")):
        assert main(["bench", "load", "--dir", str(directory), *sizes]) == 1
        assert words in _error(capsys)
    kept = tmp_path / "kept"
    assert main(["bench", "load", "--json", "--dir", str(kept), *sizes]) == 0
    capsys.readouterr()
    assert main(["bench", "load", "--dir", str(kept), "--layers", "2", "--hidden", "256", "--vocab", "16"]) == 1
    assert "holds a checkpoint of other sizes" in _error(capsys)  # it measured the old one, exit 0


def test_what_a_command_does_not_catch_is_an_internal_error_line(capsys, monkeypatch):
    from mstar.runtime.serve import bench_scheduler

    def broken(_argv):
        raise RuntimeError("a bug")

    monkeypatch.setattr(bench_scheduler, "main", broken)
    monkeypatch.delenv("MSTAR_TRACEBACK", raising=False)
    assert main(["bench", "scheduler"]) == 1
    assert "mstar: internal error (RuntimeError: a bug)" in _error(capsys)


def test_a_generated_workload_draws_below_the_plans_vocabulary():
    assert text_prompt_vocab(load_plan(LLAMA)) == 128256
    workload = generate(20, prompt_len=(50, 50), output_len=(1, 1), vocab_size=7)
    assert max(t for r in workload.requests for t in r.prompt_tokens) < 7


def test_a_run_with_one_good_request_still_exits_0(capsys, tmp_path):
    lines = [{"id": "good", "prompt_tokens": [1, 2, 3], "max_tokens": 3},
             {"id": "bad", "prompt_tokens": [1] * 9000, "max_tokens": 3}]
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps(line) + "\n" for line in lines))
    assert main(["run", "--plan", LLAMA, "--engine", "sim", "--prompts", str(prompts), "--no-progress"]) == 0
    assert "every request failed" not in _error(capsys)


@pytest.mark.parametrize("paths, words", [
    (lambda d: ["--out", str(d), "--report", str(d / "outputs.jsonl")], "--out's outputs.jsonl"),
    (lambda d: ["--report", str(d / "s.png"), "--timeline", str(d / "s.png")], "is the file of --report"),
    (lambda d: ["--report", LLAMA], "is the file of --plan"),
])
def test_a_written_file_is_not_another_file_of_the_run(capsys, tmp_path, paths, words):
    """The audit's case: `--report DIR/outputs.jsonl` beside `--out DIR` replaced the run's outputs
    with the report, exit 0; `--report` and `--timeline` on one path kept only the picture."""
    plan_bytes = Path(LLAMA).read_bytes()
    assert main(["run", "--plan", LLAMA, "--engine", "sim", "--requests", "2", "--no-progress", *paths(tmp_path)]) == 1
    err = _error(capsys)
    assert words in err and len(err.strip().splitlines()) == 1
    assert Path(LLAMA).read_bytes() == plan_bytes and not (tmp_path / "outputs.jsonl").exists()


def test_a_run_that_leaves_requests_unfinished_exits_1(capsys, monkeypatch):
    """A run whose loop ended with requests it could neither admit nor advance exited 0 with
    "unfinished: 3" in its table (an audit: a re-hashed plan admitting 0 requests at once)."""
    from mstar.runtime.conductor.conductor import Conductor

    monkeypatch.setattr(Conductor, "_admit", lambda self: None)  # the conductor admits nobody
    assert main(["run", "--plan", LLAMA, "--engine", "sim", "--requests", "3", "--no-progress"]) == 1
    assert "3 of 3 requests never finished" in _error(capsys)


def test_a_plan_admitting_no_request_is_refused_at_load():
    from pydantic import ValidationError

    from mstar.plan.schema import DeploymentPlan

    with pytest.raises(ValidationError, match="greater than or equal to 1"):
        DeploymentPlan(max_seq_len=16, max_concurrent_requests=0)


def _silent_wav(path) -> None:
    """0.1 s of 16 kHz mono silence, 16-bit."""
    import wave

    with wave.open(str(path), "wb") as clip:
        clip.setnchannels(1)
        clip.setsampwidth(2)
        clip.setframerate(16000)
        clip.writeframes(bytes(3200))


def test_a_wav_for_a_plan_whose_audio_input_takes_feature_frames_is_refused_at_load(capsys, tmp_path):
    """Qwen3-Omni's audio encoder (a stand-in) takes feature frames: each such request failed in the
    torch engine ("media features of shape (1, 80000)")."""
    _silent_wav(tmp_path / "a.wav")
    prompts = tmp_path / "p.jsonl"
    route = {"Thinker": ["prefill_text", "prefill_audio", "thinker_decode"]}
    prompts.write_text(json.dumps({"id": "x", "prompt_tokens": [1, 2, 3], "audio": "a.wav", "max_tokens": 4,
                                   "route": route}) + "\n")
    assert main(["run", "--plan", str(ROOT / "generated" / "qwen3_omni.plan"), "--prompts", str(prompts),
                 "--no-progress"]) == 1
    assert f"{prompts}:1: 'audio' is a WAV file of 16 kHz samples, and this plan's audio input takes feature" \
        in _error(capsys)


def test_a_wav_for_a_plan_without_an_audio_prompt_says_so(capsys, tmp_path):
    """Llama's plan takes no audio at all: it was told its audio input takes feature frames."""
    _silent_wav(tmp_path / "a.wav")
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"id": "x", "prompt_tokens": [1, 2], "audio": "a.wav", "max_tokens": 3}) + "\n")
    assert main(["run", "--plan", LLAMA, "--engine", "sim", "--prompts", str(prompts), "--no-progress"]) == 1
    assert f"{prompts}:1: 'audio': this plan takes no audio prompt (its prompt media: none)" in _error(capsys)


def test_a_signal_right_after_a_lost_rank_does_not_relabel_the_run(capsys, monkeypatch, tmp_path):
    """Under torchrun the agent sends SIGTERM to rank 0 once a rank died: the report said
    `interrupted: SIGTERM` and the exit was 143, where the lost rank is the run's outcome (exit 1)."""
    import os
    import signal as signals

    from lost_rank import LosesARank
    from mstar.cli import mstar as cli
    from mstar.runtime.serve.driver import Driver

    fail_active = Driver.fail_active

    def fail_then_terminated(driver, reason):  # the agent's SIGTERM, just after rank 0 saw the loss
        fail_active(driver, reason)
        os.kill(os.getpid(), signals.SIGTERM)

    monkeypatch.setattr(cli, "_engine", lambda plan, args: LosesARank(plan))
    monkeypatch.setattr(Driver, "fail_active", fail_then_terminated)
    monkeypatch.setattr(cli, "_exit_without_teardown", lambda code: (_ for _ in ()).throw(SystemExit(code)))
    report = tmp_path / "r.json"
    with pytest.raises(SystemExit) as exited:
        main(["run", "--plan", LLAMA, "--engine", "sim", "--requests", "40", "--no-progress", "--report",
              str(report)])
    assert exited.value.code == 1
    err = _error(capsys)
    assert "rank 1 was killed by SIGKILL" in err and "interrupted" not in err
    assert json.loads(report.read_text())["interrupted"] is None


def test_missing_gpu_is_refused_before_the_spec_dims_wait_is_announced(capsys, monkeypatch):
    """`--device cuda --dims spec` on a machine without a GPU printed "building the models at the
    spec's dims (... 10-60 s ...)" and then the refusal: the device is checked first now."""
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert main(["run", "--plan", LLAMA, "--device", "cuda", "--dims", "spec", "--requests", "1"]) == 1
    err = _error(capsys)
    assert "no CUDA GPU" in err and "building the models" not in err


def test_a_refused_run_creates_no_out_directory(tmp_path, capsys):
    """A sim run given a torch option, or a --report on the run's own outputs.jsonl: refused, but
    the --out directory the checks had already created stayed behind."""
    out = tmp_path / "new"
    for extra in (["--dims", "spec"], ["--report", str(out / "outputs.jsonl")]):
        assert main(["run", "--plan", LLAMA, "--engine", "sim", "--requests", "1", "--out", str(out), *extra]) == 1
        assert not out.exists(), extra
    capsys.readouterr()


def test_a_run_refused_after_its_output_folders_were_made_removes_them(tmp_path, capsys, monkeypatch):
    """Refusals found after the output paths were checked (and their folders made): weights without
    a config.json, `--device cuda` without a GPU. The new, empty folders (every level made, --out's
    and --report's) left with the refusal; a folder that was there stays, and a run that wrote keeps
    its own."""
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    (tmp_path / "kept").mkdir()
    out, report = tmp_path / "kept" / "a" / "b", tmp_path / "r" / "s" / "report.json"
    for extra, words in ((["--weights", str(tmp_path / "kept")], "no config.json"), (["--device", "cuda"], "no CUDA")):
        assert main(["run", "--plan", LLAMA, "--requests", "1", "--out", str(out), "--report", str(report),
                     *extra]) == 1
        assert words in _error(capsys)
        assert sorted(p.name for p in tmp_path.iterdir()) == ["kept"] and not any((tmp_path / "kept").iterdir())
    assert main(["run", "--plan", LLAMA, "--engine", "sim", "--requests", "1", "--out", str(out),
                 "--report", str(report), "--no-progress"]) == 0
    assert (out / "outputs.jsonl").exists() and report.exists()
    capsys.readouterr()


def test_a_tensor_parallel_group_the_tiny_model_cannot_split_says_so(tmp_path, capsys):
    """Orpheus's 24 query heads split over 4 ranks; `--dims tiny`'s 6 do not. The refusal named
    qo_heads=6 as if the spec said it; now it says it is the tiny model's and what runs instead."""
    import sys

    sys.path.insert(0, str(ROOT / "tests"))
    from plan_variants import compiled

    config = (ROOT / "configs" / "orpheus_tp2.yaml").read_text()
    config = config.replace("ranks: [0, 1]", "ranks: [0, 1, 2, 3]").replace("tp_size: 2", "tp_size: 4")
    (tmp_path / "orpheus_tp4.yaml").write_text(config)
    plan = compiled(ROOT / "specs" / "orpheus.mw", tmp_path / "orpheus_tp4.yaml", tmp_path)
    assert main(["run", "--plan", str(plan), "--requests", "1", "--no-progress"]) == 1
    err = _error(capsys)
    assert "the tiny model of --dims tiny cannot be split over 4" in err and "--dims spec" in err


def test_a_bench_whose_reader_goes_away_ends_quietly():
    """`mstar bench scheduler | head -1`: "mstar: error: Broken pipe" and exit 1 before; now exit 0
    and nothing said, as mstarc does (a --report FIFO whose reader leaves is still an error)."""
    import subprocess
    import sys

    process = subprocess.Popen([sys.executable, "-m", "mstar.cli.mstar", "bench", "scheduler", "--iters", "10"],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert process.stdout is not None and process.stderr is not None
    process.stdout.readline()
    process.stdout.close()
    assert process.wait(timeout=300) == 0
    assert process.stderr.read() == b""
