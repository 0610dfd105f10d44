"""Servers without a tokenizer (the sim engine: every request here is refused before it runs).
Each endpoint's 400 for text says what works on that endpoint: token ids only where the body
takes them. The speech endpoint offered "or send the prompt as token ids", and a client that sent
`"input": [1, 2, 3]` then got "input: Input should be a valid string"."""
from __future__ import annotations

import json

import pytest

from mstar.runtime.serve.api import LLM
from serve_harness import LLAMA, ORPHEUS, ROOT, make_service, post_json, running

BAGEL = str(ROOT / "generated" / "bagel.plan")
ADD_ONE = "restart it and pass --weights DIR with a checkpoint directory that holds tokenizer.json, or --tokenizer DIR"


def _post(url: str, path: str, body: dict) -> tuple[int, dict]:
    return post_json(f"{url}/{path}", json.dumps(body).encode())


@pytest.fixture(scope="module")
def orpheus():
    service = make_service(LLM(ORPHEUS, engine="sim", sim_pace=0))
    assert service.llm.tokenizer is None
    with running(service) as url:
        yield url


def test_speech_without_a_tokenizer_says_how_to_add_one_not_token_ids(orpheus):
    status, error = _post(orpheus, "audio/speech", {"model": "orpheus", "input": "hi"})
    assert status == 400 and error["param"] == "input", error
    assert "speech takes its input as text (not token ids), which needs a tokenizer" in error["message"]
    assert ADD_ONE in error["message"]
    assert "send the prompt as token ids" not in error["message"]
    # token ids are indeed no speech input: the hint no longer leads here
    status, error = _post(orpheus, "audio/speech", {"model": "orpheus", "input": [1, 2, 3]})
    assert status == 400 and error["message"] == "input: Input should be a valid string"


def test_speech_checks_its_body_before_the_tokenizer(orpheus):
    status, error = _post(orpheus, "audio/speech", {"model": "orpheus", "input": "hi", "response_format": "mp3"})
    assert status == 400 and error["param"] == "response_format"


def test_text_endpoints_without_a_tokenizer():
    """Completions keep the hint (they take token ids, and answer them); chat points to them."""
    service = make_service(LLM(LLAMA, engine="sim", sim_pace=0))
    with running(service) as url:
        status, error = _post(url, "completions", {"model": "llama", "prompt": "hello", "max_tokens": 2})
        assert status == 400 and "or send the prompt as token ids" in error["message"], error
        status, answer = _post(url, "completions", {"model": "llama", "prompt": [1, 2], "max_tokens": 2})
        assert status == 200 and len(answer["choices"][0]["token_ids"]) == 2
        chat = {"model": "llama", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
        status, error = _post(url, "chat/completions", chat)
        assert status == 400 and error["param"] == "messages", error
        assert "chat messages need a tokenizer with a chat template" in error["message"]
        assert ADD_ONE in error["message"] and error["message"].endswith("as token ids to /v1/completions")


def test_images_without_a_tokenizer():
    service = make_service(LLM(BAGEL, engine="sim", sim_pace=0))
    with running(service) as url:
        status, error = _post(url, "images/generations", {"model": "bagel", "prompt": "a cat"})
    assert status == 400 and error["param"] == "prompt", error
    assert "image generation takes its prompt as text (not token ids)" in error["message"]
    assert ADD_ONE in error["message"] and "send the prompt as token ids" not in error["message"]
