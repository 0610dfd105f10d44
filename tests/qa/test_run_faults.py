"""Faults injected into `mstar run` (an audit of "one bad request fails alone; the others finish;
nothing is lost; never a traceback"): outputs.jsonl removed or replaced mid-run, a run stopped by a
failed --out write, a last line cut by a kill, a line's audio too large for the memory, and an
encoder row that cannot allocate its memory."""
from __future__ import annotations

import json
import os
import shutil
import wave
from pathlib import Path

import numpy as np
import pytest

from cli_call import call_main

from mstar.cli import mstar as mstar_cli
from mstar.runtime.serve import results
from mstar.runtime.serve.results import read_outputs

ROOT = Path(__file__).resolve().parents[2]


def _call(argv, capsys) -> tuple[int, str]:
    return call_main(mstar_cli.main, argv, capsys)


def _remove_file(out: Path) -> None:
    os.unlink(out / "outputs.jsonl")


def _remove_folder(out: Path) -> None:
    shutil.rmtree(out)


def _directory_instead(out: Path) -> None:
    os.unlink(out / "outputs.jsonl")
    os.mkdir(out / "outputs.jsonl")


@pytest.mark.parametrize("fault", [_remove_file, _remove_folder, _directory_instead])
@pytest.mark.parametrize("num_requests", [20, 3])  # 3: removed after the last line (found at close)
def test_outputs_removed_mid_run_is_an_error(tmp_path, capsys, monkeypatch, fault, num_requests):
    """The lines went on into the removed file and the run exited 0 with nothing kept."""
    out = tmp_path / "out"
    write = results.ResultWriter.write

    def write_then_fault(self, record):
        write(self, record)
        if self.num_lines == 3:
            fault(out)

    monkeypatch.setattr(results.ResultWriter, "write", write_then_fault)
    status, text = _call(["run", "--plan", ROOT / "generated" / "llama.plan", "--engine", "sim", "--requests",
                          num_requests, "--concurrency", 1, "--no-progress", "--out", out], capsys)
    assert status == 1, text
    assert (f"mstar: error: --out: {out / 'outputs.jsonl'} was removed or replaced during the run; the 3 requests "
            "written to it went with it") in text
    assert text.count("was removed or replaced") == 1
    if num_requests == 20:
        assert "16 of 20 requests never finished: the run stopped at the failed --out write" in text
    assert "Traceback" not in text


def test_a_failed_out_write_is_said_as_the_reason_requests_never_finished(tmp_path, capsys, monkeypatch):
    """The run stopped at a full disk also said "N requests never finished: the run could not admit
    or advance them", which sent the reader to the plan."""
    def full(path, data):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(results, "_replace", full)  # the first WAV
    status, text = _call(["run", "--plan", ROOT / "generated" / "orpheus.plan", "--engine", "sim", "--requests", 10,
                          "--concurrency", 1, "--no-progress", "--out", tmp_path / "out"], capsys)
    assert status == 1, text
    assert "could not admit or advance" not in text
    assert "9 of 10 requests never finished: the run stopped at the failed --out write" in text


def test_read_outputs_leaves_out_a_last_line_cut_by_a_kill(tmp_path):
    lines = [{"id": "a", "media": []}, {"id": "b", "media": []}]
    text = "".join(json.dumps(line) + "\n" for line in lines)
    (tmp_path / "outputs.jsonl").write_text(text + '{"id": "c", "outp')
    assert read_outputs(str(tmp_path)) == lines
    (tmp_path / "outputs.jsonl").write_text(text)
    assert read_outputs(str(tmp_path)) == lines
    (tmp_path / "outputs.jsonl").write_text('{"id": "a"}\n{"id": \n{"id": "c"}\n')
    with pytest.raises(ValueError, match="outputs.jsonl:2: not a JSON line"):
        read_outputs(str(tmp_path))


def _wav(path: Path, seconds: float) -> None:
    samples = (0.1 * np.sin(np.arange(int(16000 * seconds)) / 10.0) * 32767).astype(np.int16)
    with wave.open(str(path), "wb") as out:
        out.setnchannels(1)
        out.setsampwidth(2)
        out.setframerate(16000)
        out.writeframes(samples.tobytes())


def _audio_prompts(tmp_path: Path, clips: dict[str, float]) -> Path:
    for request_id, seconds in clips.items():
        _wav(tmp_path / f"{request_id}.wav", seconds)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"id": request_id, "audio": f"{request_id}.wav", "max_tokens": 4}) + "\n"
                               for request_id in clips))
    return prompts


def test_a_line_whose_audio_does_not_fit_the_memory_is_named(tmp_path, capsys, monkeypatch):
    """The command said "out of memory (a pool or an input larger than this machine holds)",
    naming neither the line nor the file (a 60 MB WAV under `ulimit -v 1100000`)."""
    from mstar.runtime.serve import wav

    decode = wav.decode_wav

    def decode_or_fail(data, where, *args):
        if "long.wav" in where:
            raise MemoryError()
        return decode(data, where, *args)

    monkeypatch.setattr(wav, "decode_wav", decode_or_fail)
    prompts = _audio_prompts(tmp_path, {"short": 1.0, "long": 2.0})
    status, text = _call(["run", "--plan", ROOT / "generated" / "whisper.plan", "--engine", "sim", "--prompts",
                          prompts, "--no-progress"], capsys)
    assert status == 1, text
    assert f"mstar: error: {prompts}:2: audio file long.wav: out of memory decoding it" in text


def test_an_encoder_row_out_of_memory_fails_that_request_alone(tmp_path, capsys, monkeypatch):
    """Three clips in one Whisper encoder step, the long one's features past the memory (torch's
    CPU allocator raises a RuntimeError): every request of the step failed; now that one alone."""
    from mstar.runtime.engine.runners import whisper as whisper_runner

    log_mel = whisper_runner.log_mel

    def log_mel_or_fail(samples, bins):
        if samples.numel() > 16000:
            raise RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to allocate 300001600 bytes")
        return log_mel(samples, bins)

    monkeypatch.setattr(whisper_runner, "log_mel", log_mel_or_fail)
    out = tmp_path / "out"
    prompts = _audio_prompts(tmp_path, {"a": 1.0, "b": 2.0, "c": 1.0})
    status, text = _call(["run", "--plan", ROOT / "generated" / "whisper.plan", "--prompts", prompts, "--no-progress",
                          "--out", out], capsys)
    assert status == 0, text
    reasons = {line["id"]: line["finish_reason"] for line in read_outputs(str(out))}
    assert reasons["b"].startswith("error: node ") and "out of memory for this request" in reasons["b"]
    assert not reasons["a"].startswith("error") and not reasons["c"].startswith("error"), reasons
