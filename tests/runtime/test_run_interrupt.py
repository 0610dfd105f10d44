"""A real `mstar run` interrupted by SIGINT, SIGTERM or SIGHUP once some requests finished: it
exits 128 + the signal's number with one line saying what was kept, every finished request's
line in outputs.jsonl and its WAV are whole, and the report says `interrupted`."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import wave
from pathlib import Path

import pytest

from runtime_plans import ROOT

pytestmark = pytest.mark.usefixtures("ordinary_signals")  # conftest.py: signals not inherited ignored

START_TIMEOUT_S = 180.0  # interpreter and torch start-up on a busy 2-core machine
MIN_FINISHED = 3


def _num_lines(path: Path) -> int:
    try:
        return path.read_bytes().count(b"\n")
    except FileNotFoundError:
        return 0


@pytest.mark.parametrize("signum, engine", [
    (signal.SIGINT, "torch"),
    (signal.SIGTERM, "torch"),
    (signal.SIGHUP, "sim"),  # the cost-model engine (its audio chunks are placeholders)
])
def test_an_interrupted_run_keeps_every_finished_request(tmp_path, signum, engine):
    out, report = tmp_path / "out", tmp_path / "run.json"
    command = [sys.executable, "-m", "mstar.cli.mstar", "run", "--plan", str(ROOT / "generated" / "orpheus.plan"),
               "--engine", engine, "--requests", "20000" if engine == "sim" else "2000",
               "--output-len", "30..40", "--no-progress", "--out", str(out), "--report", str(report)]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    process = subprocess.Popen(command, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while _num_lines(out / "outputs.jsonl") < MIN_FINISHED:
            assert process.poll() is None, process.communicate()
            assert time.monotonic() < deadline, "no request finished in time"
            time.sleep(0.05)
        process.send_signal(signum)
        stdout, stderr = process.communicate(timeout=60)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    err = stderr.decode()
    assert process.returncode == 128 + signum, err
    name = signal.Signals(signum).name
    summary = [line for line in err.splitlines() if line.startswith(f"mstar: interrupted by {name}: ")]
    assert len(summary) == 1 and "marked interrupted" in summary[0], err
    assert "Traceback" not in err
    text = (out / "outputs.jsonl").read_text()
    assert text.endswith("\n")
    lines = [json.loads(line) for line in text.splitlines()]
    assert len(lines) >= MIN_FINISHED and f"kept {len(lines)} in " in summary[0]
    assert all(line["finish_reason"] in ("stop", "length", "done") for line in lines)
    media = {name for line in lines for name in line["media"]}
    assert len(media) == len(lines)  # orpheus: one WAV per request
    for file_name in media:
        with wave.open(str(out / file_name)) as audio:
            assert audio.getnframes() > 0
    assert {p.name for p in out.iterdir()} == media | {"outputs.jsonl"}  # no temporary or orphan file
    summary_json = json.loads(report.read_text())
    assert summary_json["interrupted"] == name
    assert summary_json["num_unfinished"] > 0
    assert summary_json["finish_kinds"].get("unfinished") == summary_json["num_unfinished"]
    assert summary_json["num_completed"] + summary_json["num_failed"] == len(lines)


def _run_in_process(tmp_path: Path, plan: str) -> tuple[int, str, Path]:
    """`mstar run` on the sim engine in this process, one request at a time (so the first
    signal stops it with few requests written); (status, stderr, out folder)."""
    import contextlib
    import io

    from mstar.cli import mstar as mstar_cli

    out = tmp_path / "out"
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        status = mstar_cli.main(["run", "--plan", str(ROOT / "generated" / f"{plan}.plan"), "--engine", "sim",
                                 "--requests", "20", "--concurrency", "1", "--no-progress", "--out", str(out),
                                 "--report", str(tmp_path / "run.json")])
    return status, err.getvalue(), out


def test_a_second_signal_while_outputs_close_keeps_the_run_said(tmp_path, monkeypatch):
    """SIGINT once 3 requests are written, a second one while outputs.jsonl is closed (its fsync):
    the command said "interrupted by SIGINT before the run started; nothing was written" with 3
    lines kept. Now the second signal abandons the report alone and the line says what was kept."""
    from mstar.runtime.serve import results

    write, close = results.ResultWriter.write, results.ResultWriter.close

    def write_then_signal(self, record):
        write(self, record)
        if self.num_lines == 3:
            os.kill(os.getpid(), signal.SIGINT)

    def close_under_signal(self):
        if self._fd >= 0:
            os.kill(os.getpid(), signal.SIGINT)
        close(self)

    monkeypatch.setattr(results.ResultWriter, "write", write_then_signal)
    monkeypatch.setattr(results.ResultWriter, "close", close_under_signal)
    status, err, out = _run_in_process(tmp_path, "llama")
    assert status == 130, err
    assert "before the run started" not in err
    assert "stopped by a second signal while writing the report and timeline" in err
    assert "mstar: interrupted by SIGINT: 3 requests finished, 17 not; kept 3 in " in err
    assert len((out / "outputs.jsonl").read_text().splitlines()) == 3
    assert not (tmp_path / "run.json").exists()


def test_a_second_signal_between_a_requests_media_and_its_line_waits_for_the_line(tmp_path, monkeypatch):
    """Two signals right after request 3's WAV is written: the second ended the run before its
    line, leaving the WAV without a line ("3 requests finished ... kept 2"). Now the line is
    written first."""
    from mstar.runtime.serve import results

    write_media = results.ResultWriter._write_media

    def media_then_signals(self, request_id, emissions):
        names = write_media(self, request_id, emissions)
        if self.num_media == 3:
            os.kill(os.getpid(), signal.SIGINT)  # stops the run after this step
            os.kill(os.getpid(), signal.SIGINT)  # ends it at once
        return names

    monkeypatch.setattr(results.ResultWriter, "_write_media", media_then_signals)
    status, err, out = _run_in_process(tmp_path, "orpheus")
    assert status == 130, err
    lines = [json.loads(line) for line in (out / "outputs.jsonl").read_text().splitlines()]
    assert len(lines) == 3 and "3 requests finished, 17 not; kept 3 in " in err
    assert {p.name for p in out.iterdir()} == {name for line in lines for name in line["media"]} | {"outputs.jsonl"}
    assert "Traceback" not in err


def test_a_second_signal_before_a_finished_requests_line_is_written_keeps_the_line(tmp_path, monkeypatch):
    """Two signals right after the conductor ended request 3, before the driver handed it to
    on_finish: the run ended with it counted finished ("3 requests finished ... kept 2") and its
    tokens in memory only. Now the command writes every finished request's line it has not."""
    from mstar.runtime.serve import routing

    forget = routing.Routing.forget
    forgotten = []

    def forget_then_signals(self, request_id):
        forget(self, request_id)
        forgotten.append(request_id)
        if len(forgotten) == 3:
            os.kill(os.getpid(), signal.SIGINT)  # stops the run after this step
            os.kill(os.getpid(), signal.SIGINT)  # ends it at once, before on_finish

    monkeypatch.setattr(routing.Routing, "forget", forget_then_signals)
    status, err, out = _run_in_process(tmp_path, "llama")
    assert status == 130, err
    lines = [json.loads(line) for line in (out / "outputs.jsonl").read_text().splitlines()]
    assert [line["id"] for line in lines] == forgotten[:3]
    assert "3 requests finished, 17 not; kept 3 in " in err and "Traceback" not in err
    assert all(line["finish_reason"] == "length" and line["output_tokens"] for line in lines)


def test_a_signal_the_parent_ignores_stays_ignored():
    """`nohup mstar run` was stopped by the hangup (exit 129, "interrupted by SIGHUP"): the run put
    its handler over the SIG_IGN it inherited. The signals it inherited handled are still its own."""
    from mstar.cli import mstar as mstar_cli

    previous = signal.signal(signal.SIGHUP, signal.SIG_IGN)
    try:
        with mstar_cli._Signals() as signals:
            assert signal.getsignal(signal.SIGHUP) is signal.SIG_IGN
            assert signal.getsignal(signal.SIGINT) == signals._handle
        assert signal.getsignal(signal.SIGHUP) is signal.SIG_IGN
        assert signal.getsignal(signal.SIGINT) != signals._handle
    finally:
        signal.signal(signal.SIGHUP, previous)
