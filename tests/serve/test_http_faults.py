"""Hostile bodies and methods against a real server (the fault-injection audit of `mstar serve`):
a body FastAPI's JSON reader fails on for a reason other than bad JSON is a 400 naming it and is
counted `invalid` (it said "There was an error parsing the body", uncounted); a model name is
echoed clipped; the read-only routes answer HEAD; a 405 keeps its `Allow` header."""
from __future__ import annotations

import http.client
import json
import urllib.request

import pytest

from mstar.runtime.serve.api import LLM
from serve_harness import LLAMA, make_service, running


@pytest.fixture(scope="module")
def server():
    service = make_service(LLM(LLAMA, engine="sim", sim_pace=0))
    with running(service) as url:
        yield url.removeprefix("http://").removesuffix("/v1")


def _ask(address: str, method: str, path: str, body: bytes = b"") -> tuple[int, dict[str, str], bytes]:
    host, port = address.split(":")
    connection = http.client.HTTPConnection(host, int(port), timeout=30)
    try:
        connection.request(method, path, body=body or None, headers={"Content-Type": "application/json"})
        answer = connection.getresponse()
        return answer.status, {k.lower(): v for k, v in answer.getheaders()}, answer.read()
    finally:
        connection.close()


def _invalid_count(address: str) -> float:
    text = urllib.request.urlopen(f"http://{address}/metrics", timeout=30).read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith('mstar_requests_total{outcome="invalid"}'))


@pytest.mark.parametrize("body, message", [
    (b'{"model": "llama", "prompt": "\xff\xfe"}',
     "the request body is not valid UTF-8 (byte 0xff at position 30): send JSON text in UTF-8"),
    (b'{"model": "llama", "prompt": [1], "x": ' + b"[" * 100_000 + b"]" * 100_000 + b"}",
     "the request body nests arrays or objects too deeply to be read"),
    (b'{"model": "llama", "prompt": [1], "max_tokens": ' + b"9" * 5000 + b"}",
     "the request body holds an integer of more than 4300 digits, which no field takes"),
], ids=["invalid-utf8", "nested-100000", "integer-5000-digits"])
def test_a_body_the_json_reader_fails_on_is_named_and_counted(server, body, message):
    before = _invalid_count(server)
    status, _, answer = _ask(server, "POST", "/v1/completions", body)
    error = json.loads(answer)["error"]
    assert status == 400 and error["message"] == message and error["type"] == "invalid_request_error"
    assert _invalid_count(server) == before + 1


@pytest.mark.parametrize("method, path, body", [
    ("GET", "/v1/models/nope", b""),
    ("POST", "/tokenize", b'{"model": "nope", "prompt": "hi"}'),
    ("POST", "/detokenize", b'{"model": "llama", "tokens": [999999999]}'),
    ("POST", "/tokenize", b'{"model": "llama", "prompt": '),  # (a body the JSON reader fails on)
])
def test_a_refused_call_that_is_no_request_is_not_counted(server, method, path, body):
    """A model card, /tokenize or /detokenize refused with a 4xx counted as an `invalid` request,
    inflating that share with metadata and tokenizer calls (the same calls answered 200 count nothing)."""
    before = _invalid_count(server)
    status, _, _ = _ask(server, method, path, body or None)
    assert 400 <= status < 500 and _invalid_count(server) == before


def test_an_unknown_model_is_echoed_clipped(server):
    body = json.dumps({"model": "m" * 100_000, "prompt": [1, 2]}).encode()
    status, _, answer = _ask(server, "POST", "/v1/completions", body)
    message = json.loads(answer)["error"]["message"]
    assert status == 404 and "... (100000 characters) does not exist" in message and len(message) < 200


@pytest.mark.parametrize("path", ["/health", "/v1/models", "/v1/models/llama", "/metrics"])
def test_the_read_only_routes_answer_head_as_get_without_a_body(server, path):
    status, headers, body = _ask(server, "HEAD", path)
    get_status, get_headers, _ = _ask(server, "GET", path)
    assert status == get_status == 200 and body == b""
    assert headers["content-type"] == get_headers["content-type"]


def test_a_method_a_route_does_not_take_is_a_405_naming_those_it_takes(server):
    for method, path, allowed in (("OPTIONS", "/v1/completions", {"POST"}), ("DELETE", "/metrics", {"GET", "HEAD"})):
        status, headers, body = _ask(server, method, path)
        assert status == 405 and set(headers["allow"].split(", ")) == allowed  # (starlette's order varies)
        assert json.loads(body)["error"]["type"] == "invalid_request_error"


def test_an_answer_while_the_loop_is_closed_is_counted_unavailable():
    """A closed (or dead) run loop answers 503, which counted nothing: /metrics stayed flat while
    every request failed."""
    llm = LLM(LLAMA, engine="sim", sim_pace=0)
    service = make_service(llm)
    with running(service) as url:
        address = url.removeprefix("http://").removesuffix("/v1")
        llm.loop.close(5)  # what mstar serve's drain does first
        for _ in range(2):
            status, _, _ = _ask(address, "POST", "/v1/completions", b'{"model": "llama", "prompt": [1, 2]}')
            assert status == 503
        text = urllib.request.urlopen(f"http://{address}/metrics", timeout=30).read().decode()
    assert 'mstar_requests_total{outcome="unavailable"} 2.0' in text
