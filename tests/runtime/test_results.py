"""Results written as requests finish (mstar/runtime/serve/results.py), and what a failed write
leaves behind: never half a line or half a media file under its final name, always a message
naming the file. Also `Driver.stop()`, which an interrupt uses."""
from __future__ import annotations

import errno
import json
import os
import subprocess
import wave
from pathlib import Path

import pytest
import torch

from mstar.cli.mstar import main
from mstar.runtime.conductor.request import Request, RequestRecord
from mstar.runtime.engine.sim import SimEngine
from mstar.runtime.serve import results
from mstar.runtime.serve.driver import Driver
from mstar.runtime.serve.results import OutputError, ResultWriter, media_name
from mstar.runtime.serve.workload import generate

from runtime_plans import ROOT, generated

ORPHEUS = str(ROOT / "generated" / "orpheus.plan")


def _record(request_id: str, num_samples: int = 100) -> RequestRecord:
    record = RequestRecord(request=Request(id=request_id, prompt_tokens=[1], max_tokens=2), arrival_s=0.0,
                           first_token_s=0.01, finish_s=0.02, finish_reason="length", output_tokens=[5, 6])
    record.emit(0.01, ("audio_chunk", "audio"), torch.arange(num_samples, dtype=torch.int16))
    return record


def _check_whole(out: Path) -> list[dict]:
    """Every line of outputs.jsonl parses, every media file it names is a readable WAV, no
    temporary file is left, and no media file lacks its line."""
    text = (out / "outputs.jsonl").read_text()
    assert text == "" or text.endswith("\n")
    lines = [json.loads(line) for line in text.splitlines()]
    named = {name for line in lines for name in line["media"]}
    for name in named:
        with wave.open(str(out / name)) as audio:
            assert audio.getnframes() > 0
    on_disk = {p.name for p in out.iterdir()} - {"outputs.jsonl"}
    assert on_disk == named, on_disk ^ named
    return lines


@pytest.mark.parametrize("request_id", ["/abs/path", "../../x", "a/b", "..", ".", "a\x00b", "x" * 300,
                                        "é\ud800", "C:\\evil", ""])
def test_media_names_stay_inside_the_directory(tmp_path, request_id):
    name = media_name(request_id, ".wav")
    assert "/" not in name and "\\" not in name and "\x00" not in name and not name.startswith(".")
    assert len(name) <= results.MAX_NAME_STEM + 13
    writer = ResultWriter(str(tmp_path / "out"), 24000)
    writer.write(_record(request_id))
    writer.close()
    assert [p.name for p in (tmp_path / "out").iterdir() if p.suffix == ".wav"] == [name]
    assert [p.name for p in tmp_path.iterdir()] == ["out"]


def test_ids_that_clean_to_the_same_text_get_different_names():
    assert media_name("a:b", ".wav") != media_name("a_b", ".wav")
    assert media_name("a:b", ".wav").startswith("a_b-")


def test_each_request_is_on_disk_when_write_returns(tmp_path):
    writer = ResultWriter(str(tmp_path), 24000)
    writer.write(_record("r1"))
    # not closed: what another process (or a crash) sees now
    lines = _check_whole(tmp_path)
    assert [line["id"] for line in lines] == ["r1"] and lines[0]["output_tokens"] == [5, 6]
    writer.write(_record("r2"))
    assert [line["id"] for line in _check_whole(tmp_path)] == ["r1", "r2"]
    writer.close()


@pytest.mark.parametrize("link", ["symbolic", "hard"])
def test_outputs_jsonl_left_as_a_link_is_replaced_not_emptied_through(tmp_path, link):
    """A link left at DIR/outputs.jsonl (a symbolic one planted to a file outside --out, or a hard
    one) was opened with O_TRUNC: the file it led to was emptied, then written. Now the name is
    replaced by a new file (mode 644 under the umask) and the other file keeps its bytes."""
    other, out = tmp_path / "precious", tmp_path / "out"
    other.write_text("keep me\n")
    out.mkdir()
    if link == "symbolic":
        (out / "outputs.jsonl").symlink_to(other)
    else:
        os.link(other, out / "outputs.jsonl")
    writer = ResultWriter(str(out), 24000)
    writer.write(_record("r1"))
    writer.close()
    assert other.read_text() == "keep me\n"
    assert not (out / "outputs.jsonl").is_symlink() and [line["id"] for line in _check_whole(out)] == ["r1"]
    umask = os.umask(0)
    os.umask(umask)
    assert (out / "outputs.jsonl").stat().st_mode & 0o777 == 0o644 & ~umask


def test_a_line_cut_by_a_full_disk_is_removed(tmp_path, monkeypatch):
    writer = ResultWriter(str(tmp_path), 24000)
    writer.write(_record("r1"))
    real_write = os.write

    def half_then_full(fd, data):
        if fd != writer._fd:
            return real_write(fd, data)
        if len(data) > 10:
            return real_write(fd, bytes(data[:10]))  # a short write, as a filling disk gives
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(results.os, "write", half_then_full)
    with pytest.raises(OutputError, match=r"cannot write .*outputs.jsonl: No space left on device; .* holds the 1 "):
        writer.write(_record("r2"))
    monkeypatch.undo()
    writer.close()
    # r2's WAV was written before its line failed: it is whole, and only its line is missing
    lines = [json.loads(line) for line in (tmp_path / "outputs.jsonl").read_text().splitlines()]
    assert [line["id"] for line in lines] == ["r1"]


def test_a_media_file_cut_by_a_full_disk_leaves_nothing_under_its_name(tmp_path, monkeypatch):
    import mstar.files

    writer = ResultWriter(str(tmp_path), 24000)
    real_fdopen = os.fdopen

    class Full:
        def __init__(self, handle):
            self.handle = handle

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.handle.close()

        def write(self, data):
            self.handle.write(data[:7])
            self.handle.flush()
            raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(mstar.files.os, "fdopen", lambda fd, mode: Full(real_fdopen(fd, mode)))
    with pytest.raises(OutputError, match=r"cannot write .*r1-[0-9a-f]{8}\.wav: No space left on device"):
        writer.write(_record("r1"))
    monkeypatch.undo()
    writer.close()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["outputs.jsonl"]
    assert (tmp_path / "outputs.jsonl").read_bytes() == b""


@pytest.fixture
def small_tmpfs(tmp_path):
    """A 64 KiB tmpfs (where this process may mount one: root on Linux), else the test is skipped."""
    mount = tmp_path / "small"
    mount.mkdir()
    try:
        done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(mount)],
                              capture_output=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        pytest.skip("cannot run mount")
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.decode(errors='replace').strip()}")
    yield mount
    subprocess.run(["umount", str(mount)], check=True, timeout=30)


def test_a_full_disk_during_out_names_the_file_and_keeps_whole_results(small_tmpfs, capsys):
    out = small_tmpfs / "out"
    report = small_tmpfs.parent / "run.json"
    status = main(["run", "--plan", ORPHEUS, "--requests", "40", "--output-len", "8..12", "--no-progress",
                   "--out", str(out), "--report", str(report)])
    err = capsys.readouterr().err
    assert status == 1, err
    assert f"mstar: error: --out: cannot write {out}/" in err and "No space left on device" in err
    assert "Traceback" not in err and "internal error" not in err
    lines = _check_whole(out)
    assert 0 < len(lines) < 40
    assert json.loads(report.read_text())["num_requests"] > 0  # the report is still written


def test_driver_stop_returns_with_the_rest_unfinished():
    plan = generated("orpheus")
    ended: list[str] = []
    driver = None

    def on_finish(request_ids):
        ended.extend(request_ids)
        if len(ended) >= 3:
            driver.stop()

    driver = Driver(plan, SimEngine(plan), on_finish=on_finish)
    workload = generate(50, prompt_len=(4, 8), output_len=(20, 40), concurrency=4)
    driver.run(workload)
    records = driver.conductor.records
    finished = [rid for rid, record in records.items() if record.is_finished]
    assert sorted(finished) == sorted(ended) and 3 <= len(ended) < 50
    assert len(records) < 50  # nothing was admitted after the stop
