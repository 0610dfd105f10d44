"""/v1/audio/transcriptions on generated/qwen3_asr.plan with a tiny random Qwen3-ASR checkpoint
(tests/engine/qwen3_asr_checkpoint.py) on the CPU, through the official client: the transcript
equals what `mstar run --prompts` makes of the same WAV (the language left to the model, and a
forced language: the prompt format's frame with `language English<asr_text>`); a language the
model was not trained with answers 400."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from mstar.cli.mstar import main
from mstar.runtime.serve.api import LLM
from serve_harness import ROOT, make_service, running
from test_transcription import wav_bytes

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "engine"))
from qwen3_asr_checkpoint import save_tiny_qwen3_asr  # noqa: E402

openai = pytest.importorskip("openai")
pytest.importorskip("transformers.models.qwen3_asr")
PLAN = str(ROOT / "generated" / "qwen3_asr.plan")
NUM_TOKENS = 12


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("qwen3_asr")
    checkpoint = tmp / "checkpoint"
    save_tiny_qwen3_asr(checkpoint)
    audio = wav_bytes(3.0)
    (tmp / "speech.wav").write_bytes(audio)
    lines = [{"id": "auto", "audio": "speech.wav", "max_tokens": NUM_TOKENS},
             {"id": "en", "audio": "speech.wav", "prompt": "language English<asr_text>", "max_tokens": NUM_TOKENS}]
    (tmp / "prompts.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    assert main(["run", "--plan", PLAN, "--weights", str(checkpoint), "--prompts", str(tmp / "prompts.jsonl"),
                 "--out", str(tmp / "out")]) == 0
    expected = {o["id"]: o for o in map(json.loads, (tmp / "out" / "outputs.jsonl").read_text().splitlines())}
    assert expected["auto"]["text"] and expected["auto"]["output_tokens"] != expected["en"]["output_tokens"]
    llm = LLM(PLAN, weights=[str(checkpoint)])
    with running(make_service(llm)) as url:
        yield {"audio": audio, "expected": expected,
               "client": openai.OpenAI(base_url=url, api_key="none", max_retries=0)}


def transcribe(served, **fields):
    return served["client"].audio.transcriptions.create(model="qwen3_asr", file=("speech.wav", served["audio"]),
                                                        extra_body={"max_tokens": NUM_TOKENS}, **fields)


def test_the_transcript_is_mstar_runs(served):
    assert transcribe(served).text == served["expected"]["auto"]["text"]


def test_a_chosen_language_prefills_the_answer_as_mstar_run_does(served):
    assert transcribe(served, language="en").text == served["expected"]["en"]["text"]


def test_a_language_the_model_does_not_know_is_refused(served):
    with pytest.raises(openai.BadRequestError, match="language 'xx' is not one of this model's languages"):
        transcribe(served, language="xx")
