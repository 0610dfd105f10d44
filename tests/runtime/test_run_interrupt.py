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
