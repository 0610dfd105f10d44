"""`mstar serve --cors-origin`: answers carry CORS headers for the named origins (preflight, JSON
answers, streams and refusals alike) and for no other; without the option there are none. A
malformed origin is a usage error."""
from __future__ import annotations

import json
import urllib.request

import pytest

from mstar.runtime.serve import server
from mstar.runtime.serve.api import LLM
from mstar.runtime.serve.http_app import Service
from mstar.runtime.serve.prom import ServerMetrics
from serve_harness import LLAMA, running

ALLOWED = "http://localhost:3000"


def _served(origins):
    llm = LLM(LLAMA, engine="sim", sim_pace=0.0)
    metrics = ServerMetrics()
    llm.loop.observer = metrics
    return running(Service(llm, "llama", metrics, origins))


def _ask(url: str, method: str = "GET", origin: str = ALLOWED, body: bytes = b"", **headers: str):
    return _answer(url, method, origin, body, **headers)[:2]


def _answer(url: str, method: str = "GET", origin: str = ALLOWED, body: bytes = b"", **headers: str):
    """(status, headers, body bytes)."""
    request = urllib.request.Request(url, data=body or None, method=method,
                                     headers={"Origin": origin, "Content-Type": "application/json", **headers})
    try:
        with urllib.request.urlopen(request, timeout=30) as answer:
            return answer.status, dict(answer.headers), answer.read()
    except urllib.error.HTTPError as error:
        return error.code, dict(error.headers), error.read()


@pytest.fixture(scope="module")
def cors():
    with _served([ALLOWED]) as url:
        yield url


def test_an_allowed_origin_gets_cors_headers_on_every_kind_of_answer(cors):
    status, headers = _ask(cors + "/completions", "OPTIONS", **{"Access-Control-Request-Method": "POST",
                                                             "Access-Control-Request-Headers": "content-type"})
    assert status == 200 and headers["access-control-allow-origin"] == ALLOWED
    assert "POST" in headers["access-control-allow-methods"]
    for method, path, body in (("GET", "/models", b""),
                               ("POST", "/completions", b'{"model": "llama", "prompt": [1, 2], "max_tokens": 2}'),
                               ("POST", "/completions", b'{"model": "llama", "prompt": [1, 2], "max_tokens": 2, '
                                                        b'"stream": true}'),
                               ("POST", "/completions", b'{"model": "nope", "prompt": [1, 2]}')):
        status, headers = _ask(cors + path, method, body=body)
        assert status in (200, 404) and headers.get("access-control-allow-origin") == ALLOWED, (path, status)


def test_another_origin_gets_none(cors):
    status, headers = _ask(cors + "/models", origin="http://evil.example")
    assert status == 200 and "access-control-allow-origin" not in headers
    status, _ = _ask(cors + "/completions", "OPTIONS", origin="http://evil.example",
                     **{"Access-Control-Request-Method": "POST"})
    assert status == 400  # the preflight is refused


@pytest.mark.parametrize("origin, method, refused", [
    ("http://evil.example", "POST", "the origin 'http://evil.example' is not one this server allows"),
    (ALLOWED, "DELETE", "the method 'DELETE' is not allowed (only GET, HEAD, POST)"),
    ("http://evil.example", "PUT", "the origin 'http://evil.example' is not one this server allows"),
])
def test_a_refused_preflight_is_an_openai_error(cors, origin, method, refused):
    """Every other error of the server is OpenAI-style JSON; a refused preflight was starlette's
    plain text "Disallowed CORS origin"."""
    status, headers, body = _answer(cors + "/completions", "OPTIONS", origin=origin,
                                    **{"Access-Control-Request-Method": method})
    assert status == 400 and headers["content-type"] == "application/json"
    error = json.loads(body)["error"]
    assert error["type"] == "invalid_request_error" and error["param"] is None and error["code"] is None
    assert error["message"].startswith("CORS preflight refused: ") and refused in error["message"]
    assert "access-control-allow-methods" in headers  # the preflight's own headers stay
    assert ("access-control-allow-origin" in headers) == (origin == ALLOWED)


def test_an_allowed_preflight_is_still_starlettes(cors):
    status, headers, body = _answer(cors + "/completions", "OPTIONS", **{"Access-Control-Request-Method": "POST"})
    assert status == 200 and body == b"OK" and headers["access-control-allow-origin"] == ALLOWED


def test_without_the_option_no_answer_has_cors_headers():
    with _served([]) as url:
        status, headers = _ask(url + "/models")
        assert status == 200 and not any(name.startswith("access-control") for name in headers)


@pytest.mark.parametrize("origin", ["localhost:3000", "http://localhost:3000/app", "ftp://x", ""])
def test_a_malformed_origin_is_a_usage_error(capsys, origin):
    with pytest.raises(SystemExit) as stopped:
        server.main(["--plan", LLAMA, "--cors-origin", origin])
    assert stopped.value.code == 2
    assert "argument --cors-origin: must be '*' or an origin such as" in capsys.readouterr().err


def test_origins_are_kept_as_given():
    args = server.parser().parse_args(["--plan", LLAMA, "--cors-origin", "*", "--cors-origin", "https://a.b:8443"])
    assert args.cors_origin == ["*", "https://a.b:8443"]
