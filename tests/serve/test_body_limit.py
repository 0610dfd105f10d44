"""A JSON request body past the bound (serve/body_limit.py) is a 413 before it is read whole, with
a Content-Length or sent in chunks without one; a body within it and a multipart upload to the
transcription route pass, a multipart body to another route is bounded as JSON; the server answers
the next request. (Before, a 200 MB JSON body was read and parsed, and any multipart body passed.)"""
from __future__ import annotations

import http.client
import json

import pytest

from mstar.runtime.serve import body_limit
from mstar.runtime.serve.api import LLM
from serve_harness import LLAMA, make_service, running

LIMIT = 4096


@pytest.fixture(scope="module")
def served():
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(body_limit, "MAX_JSON_BODY_BYTES", LIMIT)  # read when the app is built
        service = make_service(LLM(LLAMA, engine="sim", sim_pace=0))
        with running(service) as base:
            yield base.removesuffix("/v1"), service


@pytest.fixture(scope="module")
def url(served):
    return served[0]


def _invalid(service) -> float:
    return sum(s.value for s in service.metrics.requests.collect()[0].samples
               if s.name.endswith("_total") and s.labels["outcome"] == "invalid")


def _post(url: str, body: bytes, chunked: bool = False, content_type: str = "application/json",
          path: str = "/v1/completions"):
    host, port = url.removeprefix("http://").split(":")
    connection = http.client.HTTPConnection(host, int(port), timeout=30)
    headers = {"Content-Type": content_type}
    if chunked:
        connection.request("POST", path, body=iter([body[i:i + 1000] for i in range(0, len(body), 1000)]),
                           headers=headers, encode_chunked=True)
    else:
        connection.request("POST", path, body=body, headers=headers)
    response = connection.getresponse()
    return response.status, json.loads(response.read() or b"{}")


def _completion(num_ids: int) -> bytes:
    return json.dumps({"model": "llama", "prompt": [1] * num_ids, "max_tokens": 2}).encode()


@pytest.mark.parametrize("chunked", [False, True], ids=["content_length", "chunked"])
def test_a_body_past_the_bound_is_413_and_the_server_goes_on(served, chunked):
    url, service = served
    before = _invalid(service)
    status, answer = _post(url, _completion(3000), chunked)  # about 9 kB
    assert status == 413 and f"larger than {LIMIT} bytes" in answer["error"]["message"]
    assert _invalid(service) == before + 1  # counted as every other 4xx is (it was not counted)
    status, answer = _post(url, _completion(8))
    assert status == 200 and answer["usage"]["completion_tokens"] == 2


def test_a_multipart_body_is_left_to_the_transcription_route_alone(url):
    form = "multipart/form-data; boundary=b"
    status, _ = _post(url, b"x" * (2 * LIMIT), content_type=form, path="/v1/audio/transcriptions")
    assert status == 404  # llama's plan does not transcribe: refused for what it is, not its size
    for chunked in (False, True):
        status, answer = _post(url, b"x" * (2 * LIMIT), chunked, content_type=form)
        assert status == 413 and f"larger than {LIMIT} bytes" in answer["error"]["message"]


def test_a_multipart_type_is_read_whatever_its_case(url):
    """Media types are case-insensitive: `Multipart/Form-Data` got the JSON bodies' cap, a 413 for an
    upload the transcription route takes."""
    status, _ = _post(url, b"x" * (2 * LIMIT), content_type="Multipart/Form-Data; boundary=b",
                      path="/v1/audio/transcriptions")
    assert status == 404  # llama's plan does not transcribe: refused for what it is, not its size


def test_the_bound_follows_the_plans_sequence_length(monkeypatch):
    monkeypatch.setattr(body_limit, "MAX_JSON_BODY_BYTES", 32 << 20)  # as shipped (the fixture lowers it)
    assert body_limit.json_body_limit(8192) == body_limit.MIN_JSON_BODY_BYTES  # 512 kB of tokens: the floor
    assert body_limit.json_body_limit(131072) == 131072 * body_limit.JSON_BYTES_PER_TOKEN
    assert body_limit.json_body_limit(10 ** 9) == body_limit.MAX_JSON_BODY_BYTES
