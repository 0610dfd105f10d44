"""vLLM's /tokenize and /detokenize: a prompt's ids are those a completion or chat request sends
(the chat template included), ids come back as the text the tokenizer gives; no tokenizer, ids
outside the vocabulary, an unknown model or a body with both or neither prompt kind are errors
naming the field."""
from __future__ import annotations

import json

import pytest

from mstar.runtime.serve.api import LLM
from serve_harness import LLAMA, llama_with_client, make_service, post_json, running

MESSAGES = [{"role": "user", "content": "hello world"}]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    with llama_with_client(tmp_path_factory.mktemp("tok")) as (llm, client):
        yield llm, str(client.base_url).removesuffix("/v1/").removesuffix("/v1")


def _post(base: str, path: str, body: dict) -> tuple[int, dict]:
    return post_json(base + path, json.dumps(body).encode())


def test_tokenize_gives_the_ids_a_request_sends(served):
    llm, base = served
    status, answer = _post(base, "/tokenize", {"model": "llama", "prompt": "the cat sat"})
    assert status == 200 and answer["tokens"] == llm.prompt_tokens("the cat sat") and answer["count"] == 4
    assert answer["max_model_len"] == llm.plan.deployment.max_seq_len
    status, chat = _post(base, "/tokenize", {"model": "llama", "messages": MESSAGES})
    assert status == 200 and chat["tokens"] == llm.tokenizer.encode_chat(MESSAGES)
    status, back = _post(base, "/detokenize", {"model": "llama", "tokens": answer["tokens"]})
    assert status == 200 and back["prompt"] == "the cat sat"


@pytest.mark.parametrize("path, body, code, param", [
    ("/tokenize", {"model": "llama"}, 400, "prompt"),
    ("/tokenize", {"model": "llama", "prompt": "a", "messages": MESSAGES}, 400, "prompt"),
    ("/tokenize", {"model": "gpt", "prompt": "a"}, 404, "model"),
    ("/tokenize", {"model": "llama", "prompt": "a", "voice": "leo"}, 400, "voice"),  # no prompt format here
    ("/tokenize", {"model": "llama", "messages": MESSAGES, "add_special_tokens": False}, 400, "add_special_tokens"),
    ("/detokenize", {"model": "llama", "tokens": [1, 200000]}, 400, "tokens"),
    ("/detokenize", {"model": "llama", "tokens": [-1]}, 400, "tokens"),
])
def test_bad_bodies_are_errors_naming_the_field(served, path, body, code, param):
    _, base = served
    status, error = _post(base, path, body)
    assert status == code and error["param"] == param, error


def test_without_a_tokenizer_both_are_a_400_saying_so():
    llm = LLM(LLAMA, engine="sim", sim_pace=0.0)
    with running(make_service(llm)) as url:
        base = url.removesuffix("/v1")
        for path, body in (("/tokenize", {"model": "llama", "prompt": "a"}),
                           ("/detokenize", {"model": "llama", "tokens": [1]})):
            status, error = _post(base, path, body)
            assert status == 400 and "needs a tokenizer" in error["message"], error
