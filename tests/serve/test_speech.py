"""/v1/audio/speech on the Orpheus plan (tiny random Llama + codec on the CPU) with the official
client: a valid WAV equal to the Python API's audio, PCM streamed one codec window at a time,
and server-sent audio deltas."""
from __future__ import annotations

import base64
import io
import json
import urllib.request
import wave

import numpy as np
import pytest

from mstar.runtime.serve.api import LLM, SamplingParams
from mstar.runtime.serve.engine_setup import build_engine, load
from mstar.runtime.serve.media import pcm_bytes
from mstar.runtime.step import RowResult
from serve_harness import ORPHEUS, Gate, make_service, post_json, running, write_tokenizer

openai = pytest.importorskip("openai")
import httpx2  # noqa: E402  (the openai client's HTTP library: pyproject's test extra)

NUM_TOKENS = 42  # 28-token windows every 7 tokens: 3 windows, then a final partial one


TEXT = "hello world"


@pytest.fixture(scope="module")
def orpheus(tmp_path_factory):
    llm = LLM(ORPHEUS, tokenizer=str(write_tokenizer(tmp_path_factory.mktemp("tok"))))
    service = make_service(llm)
    # What the Python API makes of the same prompt (greedy: every answer below must equal it).
    output = llm.generate({"prompt": TEXT, "voice": "leo"}, SamplingParams(max_tokens=NUM_TOKENS))[0]
    # the plan's prompt format frames it: "{voice}: {prompt}" between Orpheus's special tokens
    form = llm.plan.nodes[0].prompt_format
    assert output.prompt_token_ids == form.before + llm.tokenizer.encode(f"leo: {TEXT}") + form.after
    chunks = [value for modality, value in output.media if modality == "audio"]
    assert len(chunks) >= 2
    with running(service) as url:
        yield chunks, url, openai.OpenAI(base_url=url, api_key="none", max_retries=0)


def test_speech_is_a_wav_of_the_codec_windows(orpheus):
    chunks, _, client = orpheus
    answer = client.audio.speech.create(model="orpheus", voice="leo", input=TEXT,
                                        extra_body={"max_tokens": NUM_TOKENS})
    with wave.open(io.BytesIO(answer.content)) as wav:
        assert (wav.getnchannels(), wav.getsampwidth(), wav.getframerate()) == (1, 2, 24000)
        samples = np.frombuffer(wav.readframes(wav.getnframes()), dtype="<i2")
    assert samples.tobytes() == b"".join(pcm_bytes(c) for c in chunks)


def test_pcm_streams_window_by_window(orpheus):
    chunks, _, client = orpheus
    with client.audio.speech.with_streaming_response.create(
            model="orpheus", voice="leo", input=TEXT, response_format="pcm",
            extra_body={"max_tokens": NUM_TOKENS}) as response:
        assert response.headers["content-type"] == "audio/pcm"
        data = b"".join(response.iter_bytes())
    assert data == b"".join(pcm_bytes(c) for c in chunks)


def test_sse_speech_sends_audio_deltas_then_usage(orpheus):
    chunks, url, _ = orpheus
    body = json.dumps({"model": "orpheus", "voice": "leo", "input": TEXT, "stream_format": "sse",
                       "max_tokens": NUM_TOKENS}).encode()
    request = urllib.request.Request(f"{url}/audio/speech", body, {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=30) as response:
        events = [json.loads(line[6:]) for line in response.read().decode().splitlines() if line.startswith("data: ")]
    deltas = [e for e in events if e["type"] == "speech.audio.delta"]
    assert [base64.b64decode(e["audio"]) for e in deltas] == [pcm_bytes(c) for c in chunks]
    assert events[-1]["type"] == "speech.audio.done" and events[-1]["usage"]["output_tokens"] == NUM_TOKENS


def test_speech_refuses_what_it_cannot_make(orpheus):
    _, _, client = orpheus
    with pytest.raises(openai.BadRequestError) as caught:
        client.audio.speech.create(model="orpheus", voice="tara", input="hi", response_format="mp3")
    assert "response_format" in caught.value.message
    with pytest.raises(openai.NotFoundError) as caught:
        client.completions.create(model="orpheus", prompt=[1, 2])
    assert "does not serve completions (it serves: speech)" in caught.value.message


@pytest.mark.parametrize("fields, named", [({"instructions": "whisper it"}, "instructions"), ({"n": 2}, "n"),
                                           ({"vocie": "leo"}, "vocie"), ({"prompt": "other"}, "prompt")])
def test_speech_refuses_a_field_the_plans_prompt_does_not_take(orpheus, fields, named):
    """Orpheus's prompt format names `voice` alone: OpenAI's `instructions` and an extra field such
    as `"n": 2` were accepted and ignored (an audit); then refused as "the prompt names 'n', which
    it does not take" with `param: null`, and a `prompt` field was dropped for `input`. Now a 400
    naming the field in `param` and saying it is not supported."""
    _, url, _ = orpheus
    body = {"model": "orpheus", "voice": "tara", "input": "hi", "max_tokens": NUM_TOKENS, **fields}
    status, error = post_json(f"{url}/audio/speech", json.dumps(body).encode())
    assert status == 400 and error["param"] == named, error
    assert error["message"] == (f"{named} is not supported: this model's speech takes voice beside input (its "
                                "prompt format's fields)")


@pytest.mark.parametrize("value", [True, "yes", 0])
def test_speech_refuses_stream_saying_how_it_streams(orpheus, value):
    """`"stream": true` was read as a prompt format field: "the prompt names 'stream', which it does
    not take", `param: null`. The speech API streams by its formats."""
    _, url, _ = orpheus
    body = {"model": "orpheus", "input": TEXT, "stream": value, "max_tokens": NUM_TOKENS}
    status, error = post_json(f"{url}/audio/speech", json.dumps(body).encode())
    assert status == 400 and error["param"] == "stream", error
    assert error["message"] == ('speech takes no "stream" field: it streams by its formats, "response_format": '
                                '"pcm" (raw samples as they are made) or "stream_format": "sse" (audio delta events)')


@pytest.mark.parametrize("value", [False, None])
def test_speech_takes_a_stream_that_asks_for_nothing(orpheus, value):
    """false and null ask for the answer speech gives anyway (they were refused as a prompt field)."""
    chunks, url, _ = orpheus
    body = {"model": "orpheus", "voice": "leo", "input": TEXT, "stream": value, "max_tokens": NUM_TOKENS}
    request = urllib.request.Request(f"{url}/audio/speech", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=30) as response, wave.open(io.BytesIO(response.read())) as wav:
        samples = wav.readframes(wav.getnframes())
    assert samples == b"".join(pcm_bytes(c) for c in chunks)


class FailingAfter(Gate):
    """Fails every row of each step after the first `num_ok`, as a node's fault would."""

    def __init__(self, inner, num_ok: int):
        super().__init__(inner)
        self.num_ok = num_ok

    def wait(self, handle):
        result = super().wait(handle)
        if self.num_steps > self.num_ok:
            result.rows = [RowResult(row.request_id, error="node snac_decoder: a fault") for row in result.rows]
        return result


@pytest.mark.parametrize("num_ok", [40, 0], ids=["after_the_first_audio", "before_any_audio"])
def test_a_pcm_stream_whose_request_fails_is_not_answered_as_complete(tmp_path, num_ok):
    """Raw PCM cannot carry an error event: a request that failed after its first window ended
    its stream as if done (200, shorter audio), and one that failed before any audio was a 200
    with no bytes. Now the first is cut (no last chunk: the client reads an incomplete body) and
    the second is a JSON 500; the next request runs."""
    engine = FailingAfter(build_engine(load(ORPHEUS), "sim", sim_pace=0), num_ok)
    llm = LLM(ORPHEUS, engine=engine, tokenizer=str(write_tokenizer(tmp_path / "tok")))
    body = {"model": "orpheus", "input": TEXT, "response_format": "pcm", "max_tokens": 1200}
    with running(make_service(llm)) as url:
        client = httpx2.Client(timeout=30)
        if num_ok:
            with pytest.raises(httpx2.RemoteProtocolError, match="incomplete"):
                with client.stream("POST", f"{url}/audio/speech", json=body) as response:
                    assert response.status_code == 200
                    assert b"".join(response.iter_bytes())  # some audio, then the cut
        else:
            response = client.post(f"{url}/audio/speech", json=body)
            assert response.status_code == 500 and "a fault" in response.json()["error"]["message"]
        engine.num_ok = 10 ** 9
        answer = client.post(f"{url}/audio/speech", json={**body, "max_tokens": 42})
        assert answer.status_code == 200 and len(answer.content) == 3 * 2  # the sim's three 1-sample windows


def _speech(url: str, body: dict) -> tuple[int, bytes]:
    request = urllib.request.Request(url + "/audio/speech", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as answer:
        return answer.status, answer.read()


def test_null_speech_fields_ask_for_their_defaults(orpheus):
    """`null` for response_format, max_tokens or voice asks for the default, as the text endpoints
    take it (each was a 400); the answer is the default request's WAV."""
    _, url, _ = orpheus
    body = {"model": "orpheus", "input": TEXT, "voice": "leo", "max_tokens": NUM_TOKENS}
    plain = _speech(url, body)
    assert plain[0] == 200 and plain[1][:4] == b"RIFF"
    assert _speech(url, {**body, "response_format": None}) == plain
    status, wav = _speech(url, {**body, "voice": None, "max_tokens": None})
    assert status == 200 and wav[:4] == b"RIFF"


@pytest.mark.parametrize("fields, param, words", [
    ({"voice": "\ud800"}, "voice", "'voice' is not valid Unicode"),
    ({"input": "hi " * 140000}, "input", "leaves no room to generate"),  # past max_seq_len 131072
], ids=["a_bad_voice", "an_input_with_no_room"])
def test_a_refused_speech_prompt_names_the_field_at_fault(orpheus, fields, param, words):
    """A voice that is not valid Unicode was a 400 with `param: null`, and an input too long for
    the plan blamed a `max_tokens` the client never sent (the endpoint's default): an audit."""
    _, url, _ = orpheus
    body = {"model": "orpheus", "voice": "leo", "input": "hi", **fields}
    status, error = post_json(f"{url}/audio/speech", json.dumps(body).encode())
    assert status == 400 and error["param"] == param and words in error["message"], error


def test_tokenize_takes_the_prompt_formats_fields_as_speech_does(orpheus, tmp_path):
    """/tokenize on Orpheus ignored `voice` (the count was the default voice's, not the speech
    request's) and any misspelt field; vLLM's `add_special_tokens: false` was ignored too (an audit)."""
    _, url, _ = orpheus
    base = url[:-len("/v1")]
    with LLM(ORPHEUS, tokenizer=str(write_tokenizer(tmp_path))) as llm:
        for voice in ("leo", "the cat sat on"):
            status, answer = post_json(f"{base}/tokenize", json.dumps({"model": "orpheus", "prompt": TEXT,
                                                                       "voice": voice}).encode())
            assert status == 200 and answer["tokens"] == llm.prompt_tokens({"prompt": TEXT, "voice": voice})
        assert answer["tokens"] != llm.prompt_tokens(TEXT)  # (the default voice's)
    for extra, param in (({"vocie": "leo"}, "vocie"), ({"add_special_tokens": False}, "add_special_tokens")):
        status, error = post_json(f"{base}/tokenize", json.dumps({"model": "orpheus", "prompt": TEXT,
                                                                  **extra}).encode())
        assert status == 400 and error["param"] == param, error
