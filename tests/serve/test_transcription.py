"""/v1/audio/transcriptions on generated/whisper.plan with a tiny random Whisper checkpoint (the
parity tests' one, tests/engine/whisper_checkpoint.py) on the CPU, through the official client:
the transcript equals what `mstar run --prompts` makes of the same WAV (language detected, and a
chosen language), as json, text and a stream; bad input answers 4xx with an OpenAI error, never a
traceback; `/v1/models` says which plans transcribe."""
from __future__ import annotations

import asyncio
import io
import json
import socket
import sys
import urllib.error
import urllib.request
import wave
from pathlib import Path

import numpy as np
import pytest

from mstar.cli.mstar import main
from mstar.plan.io import load_plan
from mstar.runtime.serve.api import LLM
from mstar.runtime.serve.endpoints import endpoints_of
from mstar.runtime.serve.http_schema import ApiError
from serve_harness import LLAMA, ROOT, make_service, running

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "engine"))
from whisper_checkpoint import LANGUAGES, NO_TIMESTAMPS, START, TRANSCRIBE, save_tiny_whisper  # noqa: E402

openai = pytest.importorskip("openai")
WHISPER = str(ROOT / "generated" / "whisper.plan")
NUM_TOKENS = 24  # forced start tokens (language, task, no timestamps) included, as mstar run counts them


def wav_bytes(seconds: float, rate: int = 16000, seed: int = 3) -> bytes:
    """Two tones and some noise as 16-bit mono PCM."""
    t = np.arange(int(rate * seconds)) / rate
    noise = np.random.default_rng(seed).standard_normal(t.shape[0])
    samples = 0.3 * np.sin(2 * np.pi * 440 * t) + 0.2 * np.sin(2 * np.pi * 1250 * t) + 0.05 * noise
    buffer = io.BytesIO()
    with wave.open(buffer, "wb") as out:
        out.setnchannels(1)
        out.setsampwidth(2)
        out.setframerate(rate)
        out.writeframes(np.clip(np.round(samples * 32767), -32768, 32767).astype("<i2").tobytes())
    return buffer.getvalue()


def post(url: str, body: bytes, content_type: str) -> tuple[int, dict]:
    """POST a body; the status and the JSON answer (an error's too)."""
    request = urllib.request.Request(f"{url}/audio/transcriptions", body, {"Content-Type": content_type})
    try:
        with urllib.request.urlopen(request, timeout=30) as answer:
            return answer.status, json.loads(answer.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


def multipart(fields: dict[str, str], files: dict[str, tuple[str, bytes]]) -> bytes:
    """A multipart/form-data body with the boundary `b0undary`."""
    parts = [f'--b0undary\r\nContent-Disposition: form-data; name="{k}"\r\n\r\n{v}\r\n'.encode()
             for k, v in fields.items()]
    parts += [f'--b0undary\r\nContent-Disposition: form-data; name="{k}"; filename="{name}"\r\n\r\n'.encode()
              + data + b"\r\n" for k, (name, data) in files.items()]
    return b"".join(parts) + b"--b0undary--\r\n"


def mstar_run(tmp: Path, checkpoint: Path, audio: bytes, line: dict) -> dict:
    """`mstar run --prompts` on one line with `audio`: its outputs.jsonl record."""
    tmp.mkdir()
    (tmp / "speech.wav").write_bytes(audio)
    prompts = tmp / "prompts.jsonl"
    prompts.write_text(json.dumps({"id": "clip", "audio": "speech.wav", "max_tokens": NUM_TOKENS, **line}) + "\n")
    assert main(["run", "--plan", WHISPER, "--weights", str(checkpoint), "--prompts", str(prompts),
                 "--out", str(tmp / "out")]) == 0
    return json.loads((tmp / "out" / "outputs.jsonl").read_text())


@pytest.fixture(scope="module")
def whisper(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("whisper")
    checkpoint = tmp / "checkpoint"
    save_tiny_whisper(checkpoint, forced=True, text_only=True)
    audio = wav_bytes(7.0)
    detected = mstar_run(tmp / "detected", checkpoint, audio, {})
    german = [START, LANGUAGES["<|de|>"], TRANSCRIBE, NO_TIMESTAMPS]
    chosen = mstar_run(tmp / "de", checkpoint, audio, {"prompt_tokens": german})
    assert len(detected["text"].split()) > 5 and detected["text"] != chosen["text"]
    llm = LLM(WHISPER, weights=[str(checkpoint)])
    with running(make_service(llm)) as url:
        yield {"url": url, "audio": audio, "detected": detected, "de": chosen, "checkpoint": checkpoint,
               "client": openai.OpenAI(base_url=url, api_key="none", max_retries=0)}


def transcribe(whisper, **fields):
    fields.setdefault("file", ("speech.wav", whisper["audio"]))
    return whisper["client"].audio.transcriptions.create(model="whisper", extra_body={"max_tokens": NUM_TOKENS},
                                                         **fields)


def test_the_transcript_is_mstar_runs(whisper):
    answer = transcribe(whisper)
    assert answer.text == whisper["detected"]["text"]
    assert answer.usage.type == "duration" and answer.usage.seconds == 7.0


def test_a_chosen_language_starts_the_sequence_as_mstar_run_does(whisper):
    assert transcribe(whisper, language="de").text == whisper["de"]["text"]


def test_text_format_is_the_bare_transcript(whisper):
    assert transcribe(whisper, response_format="text") == whisper["detected"]["text"]


def test_a_stream_sends_text_deltas_then_the_whole_text(whisper):
    events = list(transcribe(whisper, stream=True))
    deltas = [e.delta for e in events if e.type == "transcript.text.delta"]
    assert len(deltas) > 5 and "".join(deltas) == whisper["detected"]["text"]
    assert events[-1].type == "transcript.text.done" and events[-1].text == whisper["detected"]["text"]
    # the decoder's outputs, forced start tokens included, as mstar run's output tokens
    assert events[-1].usage.output_tokens == len(whisper["detected"]["output_tokens"]) == NUM_TOKENS


def test_models_says_whisper_transcribes(whisper):
    assert "transcription" in whisper["client"].models.list().data[0].serves
    assert "transcription" in endpoints_of(load_plan(str(ROOT / "generated" / "qwen3_asr.plan"))).names()


@pytest.mark.parametrize("name", ["whisper", "whisper_turbo", "qwen3_asr"])
def test_a_plan_whose_route_needs_audio_serves_no_text_completions(name):
    """Its LLM takes the text prompt, but a request without a route runs the audio encoder: a text
    request has no audio to give (Qwen3-ASR's encoder failed each one, a 500; Whisper transcribed
    stand-in noise). Completions now answer 404 naming what the plan serves."""
    assert endpoints_of(load_plan(str(ROOT / "generated" / f"{name}.plan"))).names() == ["transcription"]
    assert "text" in endpoints_of(load_plan(str(ROOT / "generated" / "qwen3_omni.plan"))).names()  # optional audio
    # Higgs-Audio's audio prompt goes to the stand-in encoder, which takes feature frames, not a WAV
    assert "transcription" not in endpoints_of(load_plan(str(ROOT / "generated" / "higgs_audio.plan"))).names()


def test_a_clip_past_30_s_is_transcribed_window_by_window_as_mstar_run_does(whisper, tmp_path):
    """generated/whisper.plan repeats its partition per 30 s window (`repeat while audio_left`), so
    the endpoint takes a 65 s clip and answers what `mstar run --prompts` makes of it."""
    audio = wav_bytes(65.0, seed=5)
    expected = mstar_run(tmp_path / "long", whisper["checkpoint"], audio, {"max_tokens": 2000})
    answer = whisper["client"].audio.transcriptions.create(model="whisper", file=("long.wav", audio),
                                                           extra_body={"max_tokens": 2000})
    assert answer.text == expected["text"] and answer.usage.seconds == 65.0
    # past one sequence's worth of tokens: the decoder starts a sequence per window
    assert len(expected["output_tokens"]) > 448


def test_the_audio_bound_is_the_front_ends_window_times_the_partitions_rounds():
    from mstar.runtime.serve.audio_input import audio_input_of

    whisper_input = audio_input_of(load_plan(WHISPER))  # `repeat while audio_left max=max_windows` (1000)
    assert whisper_input.window_samples == 480000 and whisper_input.max_samples == 1000 * 480000
    asr_input = audio_input_of(load_plan(str(ROOT / "generated" / "qwen3_asr.plan")))  # no repeat: one window
    assert asr_input.max_samples == asr_input.window_samples == 480000


@pytest.mark.parametrize("fields, status, message", [
    ({"file": ("notes.txt", b"hello, not audio")}, 400, "file 'notes.txt': not a WAV file"),
    ({"file": ("fast.wav", wav_bytes(0.5, rate=44100))}, 400, "44100 Hz; the audio input takes 16000 Hz"),
    ({"file": ("empty.wav", wav_bytes(0.0))}, 400, "holds no samples"),
    ({"model": "whisper-1"}, 404, "the model 'whisper-1' does not exist"),
    ({"prompt": "earlier words"}, 400, "prompt (text that conditions the transcript) is not supported"),
    ({"response_format": "srt"}, 400, "response_format 'srt' is not supported: json or text"),
    ({"timestamp_granularities": ["word"]}, 400, "timestamp_granularities is not supported"),
    ({"language": "xx"}, 400, "language 'xx' is not one of this model's languages"),
    ({"language": "english"}, 400, "language must be an ISO 639-1 code"),
    ({"temperature": -1}, 400, "temperature must be >= 0"),
    # read by Python's int() and float(), which take other scripts' digits and nan
    ({"extra_body": {"max_tokens": "\u0665"}}, 400, "max_tokens must be an integer, got '\u0665'"),
    ({"temperature": "nan"}, 400, "temperature must be a number, got 'nan'"),
    # past Python's 4,300-digit int() limit: a 500 "internal error (ValueError ...)"; values echoed clipped
    ({"extra_body": {"max_tokens": "9" * 5000}}, 400, "max_tokens is out of range (too many digits), got '999"),
    ({"extra_body": {"seed": "-" + "9" * 5000}}, 400, "seed is out of range (too many digits), got '-99"),
    ({"language": "x" * 100_000}, 400, "got 'xxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxx... (100000 characters)"),
    ({"response_format": "x" * 100_000}, 400, "... (100000 characters) is not supported"),
    ({"extra_body": {"stream": "y" * 100_000}}, 400, "stream must be true or false, got 'yyyy"),
])
def test_bad_input_is_an_openai_error(whisper, fields, status, message):
    fields.setdefault("model", "whisper")
    fields.setdefault("file", ("speech.wav", whisper["audio"]))
    with pytest.raises(openai.APIStatusError) as caught:
        whisper["client"].audio.transcriptions.create(**fields)
    assert caught.value.status_code == status and message in caught.value.message
    assert caught.value.body["type"] in ("invalid_request_error", "not_found_error")
    assert len(caught.value.message) < 300  # a value is echoed clipped, never whole


def test_a_form_without_a_file_is_refused(whisper):
    form = "multipart/form-data; boundary=b0undary"
    for body, kind in ((multipart({"model": "whisper"}, {}), form),
                       (multipart({"model": "whisper", "file": "speech.wav"}, {}), form),
                       (b"model=whisper", "application/x-www-form-urlencoded"),
                       (json.dumps({"model": "whisper", "file": "speech.wav"}).encode(), "application/json")):
        status, answer = post(whisper["url"], body, kind)
        assert status == 400 and answer["error"]["message"].startswith("file: a WAV file is required")
    status, answer = post(whisper["url"], multipart({"model": "whisper", "temperature": "warm"},
                                                    {"file": ("a.wav", whisper["audio"])}), form)
    assert status == 400 and answer["error"]["message"] == "temperature must be a number, got 'warm'"
    status, answer = post(whisper["url"], multipart({}, {"file": ("a.wav", whisper["audio"])}), form)
    assert status == 400 and answer["error"]["message"] == "model: a model name is required"
    status, answer = post(whisper["url"], b"--b0undary\r\nnot a part", form)
    assert status == 400 and answer["error"]["type"] == "invalid_request_error"


def test_a_body_past_the_limit_is_refused_before_it_is_read(whisper):
    port = int(whisper["url"].rsplit(":", 1)[1].split("/")[0])
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(b"POST /v1/audio/transcriptions HTTP/1.1\r\nHost: x\r\nContent-Length: 999999999\r\n"
                     b"Content-Type: multipart/form-data; boundary=b\r\n\r\n")
        answer = b""
        while b"}}" not in answer:  # the JSON error closes with two braces
            answer += sock.recv(65536)
    head, body = answer.decode().split("\r\n\r\n", 1)
    assert head.startswith("HTTP/1.1 413") and "an audio file may have at most" in json.loads(body)["error"]["message"]


def test_a_body_without_a_length_is_counted_as_it_arrives():
    from starlette.requests import Request

    from mstar.files import MAX_AUDIO_BYTES
    from mstar.runtime.serve.transcription import read_form

    head = b'--b\r\nContent-Disposition: form-data; name="file"; filename="a.wav"\r\n\r\n'
    chunk = b"x" * (1 << 20)
    sent = []

    async def receive():  # a file part that never ends, sent without a Content-Length
        body = chunk if sent else head
        sent.append(len(body))
        return {"type": "http.request", "body": body, "more_body": True}

    scope = {"type": "http", "method": "POST", "path": "/", "headers": [
        (b"content-type", b"multipart/form-data; boundary=b")]}
    with pytest.raises(ApiError) as caught:
        asyncio.run(read_form(Request(scope, receive)))
    assert caught.value.status == 413 and sum(sent) <= MAX_AUDIO_BYTES + 2 * len(chunk)


def test_a_client_that_aborts_its_upload_ends_quietly():
    """A disconnect mid-upload was starlette's ClientDisconnect, uncaught: a traceback in the server's
    log for a client's abort; now an answer nobody reads, not counted as a bad request."""
    from starlette.requests import Request

    from mstar.runtime.serve.transcription import read_form

    messages = iter([{"type": "http.request", "body": b'--b\r\nContent-Disposition: form-data; name="file"; '
                                                     b'filename="a.wav"\r\n\r\nRIFF', "more_body": True},
                     {"type": "http.disconnect"}])

    async def receive():
        return next(messages)

    scope = {"type": "http", "method": "POST", "path": "/", "headers": [
        (b"content-type", b"multipart/form-data; boundary=b")]}
    with pytest.raises(ApiError) as caught:
        asyncio.run(read_form(Request(scope, receive)))
    assert caught.value.status == 400 and caught.value.is_counted and "disconnected" in str(caught.value)


def test_a_clip_too_long_is_refused_from_its_header_before_decoding(monkeypatch):
    """Qwen3-ASR takes one 30 s window: a 40 s upload is refused from the WAV header's count, its
    samples never decoded (a 64 MiB 8-bit upload took 0.9 GB to decode before its refusal)."""
    from mstar.runtime.serve import wav
    from mstar.runtime.serve.audio_input import audio_input_of
    from mstar.runtime.serve.transcription import TranscriptionForm, samples

    audio = audio_input_of(load_plan(str(ROOT / "generated" / "qwen3_asr.plan")))
    monkeypatch.setattr(wav, "_decode", lambda *args: pytest.fail("decoded a clip refused by its length"))
    form = TranscriptionForm(model="qwen3_asr", data=wav_bytes(40.0), filename="long.wav")
    with pytest.raises(ApiError) as caught:
        samples(form, audio)
    assert caught.value.status == 400 and "40.00 s of audio; this model transcribes at most 30 s" in str(caught.value)
    one_past = wav_bytes(0.0)[:40] + (960002).to_bytes(4, "little") + bytes(960002)  # 480,001 16-bit samples
    one_past = one_past[:4] + (len(one_past) - 8).to_bytes(4, "little") + one_past[8:]
    with pytest.raises(ApiError, match="30.000062 s of audio"):  # (it read "30.00 s", as if within 30 s)
        samples(TranscriptionForm(model="qwen3_asr", data=one_past, filename="a.wav"), audio)


def test_8_bit_samples_decode_to_their_centred_values():
    header = wav_bytes(0.0)  # 16-bit mono at 16 kHz, no samples: rewritten as 8-bit below
    raw = bytes([0, 64, 128, 192, 255])
    fmt = header[:20] + (1).to_bytes(2, "little") + (1).to_bytes(2, "little") + (16000).to_bytes(4, "little") \
        + (16000).to_bytes(4, "little") + (1).to_bytes(2, "little") + (8).to_bytes(2, "little")
    data = fmt + b"data" + len(raw).to_bytes(4, "little") + raw
    data = data[:4] + (len(data) - 8).to_bytes(4, "little") + data[8:]
    from mstar.runtime.serve.wav import decode_wav

    assert decode_wav(data, "x").tolist() == [-1.0, -0.5, 0.0, 0.5, 127 / 128]


def test_a_plan_that_cannot_transcribe_says_what_it_serves():
    with running(make_service(LLM(LLAMA, engine="sim"))) as url:
        client = openai.OpenAI(base_url=url, api_key="none", max_retries=0)
        assert "transcription" not in client.models.list().data[0].serves
        with pytest.raises(openai.NotFoundError) as caught:
            client.audio.transcriptions.create(model="llama", file=("a.wav", wav_bytes(0.5)))
    assert "does not serve transcription (it serves: text)" in caught.value.message


def test_the_sim_engine_takes_a_clip_past_30_s_as_the_torch_engine_does(tmp_path):
    """The sim bounded prompt + max_tokens by one window's max_seq_len (448) and refused a 40 s clip
    (the default 896 tokens, two rounds) that the torch engine transcribes: it now bounds them by
    max_seq_len a round of the repeating partition, as the server does."""
    from serve_harness import write_tokenizer

    llm = LLM(WHISPER, engine="sim", tokenizer=str(write_tokenizer(tmp_path / "tok")))
    with running(make_service(llm)) as url:
        client = openai.OpenAI(base_url=url, api_key="none", max_retries=0)
        answer = client.audio.transcriptions.create(model="whisper", file=("long.wav", wav_bytes(40.0, seed=2)))
    assert answer.usage.seconds == 40.0


def _invalid_count(url: str) -> float:
    text = urllib.request.urlopen(url.rstrip("/").removesuffix("/v1") + "/metrics", timeout=30).read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("mstar_requests_total") and 'outcome="invalid"' in line)


def test_a_body_that_is_not_a_form_is_answered_and_counted_as_invalid(whisper):
    """starlette's own 400 for an unparsable multipart body was answered but not counted."""
    before = _invalid_count(whisper["url"])
    form = "multipart/form-data; boundary=b0undary"
    two_files = multipart({"model": "whisper"}, {"file": ("a.wav", whisper["audio"])}).replace(
        b"--b0undary--", b"--b0undary\r\nContent-Disposition: form-data; name=\"file\"; filename=\"b.wav\"\r\n\r\nx\r\n"
        b"--b0undary--")
    for body, kind in ((b"x", "multipart/form-data"), (b"--b0undary\r\nnot a part", form), (two_files, form)):
        status, answer = post(whisper["url"], body, kind)
        assert status == 400 and answer["error"]["type"] == "invalid_request_error", answer
    assert _invalid_count(whisper["url"]) == before + 3


def test_a_fmt_chunk_of_zero_bits_is_refused_not_divided_by():
    """0 bits a sample and a block of 0 bytes passed the fmt check (0 == 1 x 0 // 8), then the
    sample count divided by the block: a ZeroDivisionError, an internal error of `mstar run`."""
    from mstar.runtime.serve.wav import WavError, decode_wav

    header = wav_bytes(0.0)
    raw = bytes(8)
    fmt = header[:20] + (1).to_bytes(2, "little") + (1).to_bytes(2, "little") + (16000).to_bytes(4, "little") \
        + (0).to_bytes(4, "little") + (0).to_bytes(2, "little") + (0).to_bytes(2, "little")
    data = fmt + b"data" + len(raw).to_bytes(4, "little") + raw
    data = data[:4] + (len(data) - 8).to_bytes(4, "little") + data[8:]
    with pytest.raises(WavError, match="inconsistent fmt chunk .1 channels, 0 bits, block 0"):
        decode_wav(data, "x")
