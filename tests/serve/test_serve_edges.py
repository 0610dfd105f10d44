"""Behaviour a mutation audit found no test holding: usage's cached tokens with n choices, a
chat stream's last chunk, top_logprobs 20, -inf log-probabilities, multi-byte characters split
across tokens, chat's default max_tokens, and the body bound's edge (serve/http_stream.py,
http_schema.py, logprobs_format.py, text_stream.py, http_app.py, body_limit.py)."""
from __future__ import annotations

import asyncio
import json
import math
from types import SimpleNamespace

import pytest

from mstar.runtime.conductor.request import Request
from mstar.runtime.serve import http_stream as sse
from mstar.runtime.serve.api import LLM
from mstar.runtime.serve.body_limit import BodyLimit
from mstar.runtime.serve.http_schema import ApiError, ChatBody, CompletionBody
from mstar.runtime.serve.logprobs_format import LOWEST, Offsets, chat_logprobs, completion_logprobs
from mstar.runtime.serve.online import Delta
from mstar.runtime.serve.text_stream import TextStream
from mstar.runtime.step import MAX_LOGPROBS
from serve_harness import LLAMA, make_service, running, write_tokenizer


def _choice(request_id: str, prompt_index: int, prompt: list[int]) -> sse.Choice:
    return sse.Choice(Request(id=request_id, prompt_tokens=prompt, max_tokens=4), prompt_index)


def test_usage_counts_cached_tokens_once_a_prompt():
    """docs/serve.md: usage counts each prompt's tokens once, and the cached_tokens of its first choice."""
    choices = [_choice("a", 0, [1, 2, 3, 4]), _choice("b", 0, [1, 2, 3, 4]), _choice("c", 1, [5, 6])]
    finals = [Delta("a", finish_reason="length", num_output_tokens=3, num_cached_tokens=2),
              Delta("b", finish_reason="length", num_output_tokens=2, num_cached_tokens=4),
              Delta("c", finish_reason="stop", num_output_tokens=1, num_cached_tokens=1)]
    assert sse.usage(choices, finals) == {"prompt_tokens": 6, "completion_tokens": 6, "total_tokens": 12,
                                          "prompt_tokens_details": {"cached_tokens": 3}}


def test_a_chat_streams_last_chunk_without_text_has_an_empty_delta():
    """OpenAI's chat stream: the chunk with the finish reason carries `delta: {}` when it adds no text."""
    async def deltas():
        yield Delta("r", finish_reason="length", num_output_tokens=1)

    async def events():
        choices = [_choice("r", 0, [1, 2])]
        service = SimpleNamespace(model_name="m", id_tag="t", llm=SimpleNamespace(tokenizer=None))
        body = SimpleNamespace(include_usage=False)
        started = [(deltas(), Delta("r", token_ids=[7], text=" hi", num_output_tokens=1))]
        return [event async for event in sse.chat_events(service, choices, body, started)]

    found = asyncio.run(events())
    chunks = [json.loads(e.removeprefix("data: ")) for e in found if e != "data: [DONE]\n\n"]
    assert [c["choices"][0]["delta"] for c in chunks] == [{"role": "assistant", "content": ""},
                                                           {"content": " hi"}, {}]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"


def test_the_most_log_probabilities_openai_allows_are_taken():
    assert MAX_LOGPROBS == 20
    CompletionBody(model="m", prompt=[1], logprobs=MAX_LOGPROBS).prompt_values()
    ChatBody(model="m", messages=[{"role": "user", "content": "x"}], logprobs=True,
             top_logprobs=MAX_LOGPROBS).prompt_value()
    with pytest.raises(ApiError) as refused:
        CompletionBody(model="m", prompt=[1], logprobs=MAX_LOGPROBS + 1).prompt_values()
    assert refused.value.status == 400 and refused.value.param == "logprobs"


def test_minus_infinity_is_given_as_the_lowest_finite_logprob():
    found = [(-math.inf, ((5, -math.inf), (6, -1.5)))]
    completion = completion_logprobs(None, [5], found, Offsets())
    assert completion["token_logprobs"] == [LOWEST]
    assert completion["top_logprobs"] == [{"token_id:5": LOWEST, "token_id:6": -1.5}]
    chat = chat_logprobs(None, [5], found, Offsets())
    assert chat["content"][0]["logprob"] == LOWEST
    assert [t["logprob"] for t in chat["content"][0]["top_logprobs"]] == [LOWEST, -1.5]
    json.dumps([completion, chat], allow_nan=False)  # valid JSON: no -Infinity


def test_a_character_split_across_tokens_is_streamed_whole():
    """Byte-level tokens: "é" is two tokens; the text waits for the second (no U+FFFD)."""
    def decode(ids):
        return bytes(ids).decode("utf-8", errors="replace")

    stream = TextStream(decode)
    word = "aé€b".encode("utf-8")
    deltas = [stream.add([byte]) for byte in word] + [stream.finish()]
    assert "".join(deltas) == "aé€b" and not any("\ufffd" in d for d in deltas)


def test_a_chat_request_without_max_tokens_takes_all_the_room_the_prompt_leaves(tmp_path):
    """docs/serve.md: without max_tokens a chat request takes what max_seq_len leaves after the prompt
    (here 5 tokens, fewer than llama's walks make)."""
    openai = pytest.importorskip("openai")
    with LLM(LLAMA, engine="sim", tokenizer=str(write_tokenizer(tmp_path))) as llm, \
            running(make_service(llm)) as url:
        def messages(count):
            return {"messages": [{"role": "user", "content": "hello " * count}]}

        overhead = len(llm.prompt_tokens(messages(1))) - 1
        count = llm.plan.deployment.max_seq_len - 5 - overhead
        assert len(llm.prompt_tokens(messages(count))) == llm.plan.deployment.max_seq_len - 5
        client = openai.OpenAI(base_url=url, api_key="none", max_retries=0)
        answer = client.chat.completions.create(model="llama", **messages(count))
    assert answer.choices[0].finish_reason == "length" and answer.usage.completion_tokens == 5


@pytest.mark.parametrize("with_length", [True, False], ids=["content_length", "chunked"])
def test_a_body_of_exactly_the_bound_passes_and_one_byte_more_is_413(with_length):
    """body_limit.py: 413 for a body *larger than* the bound."""
    async def call(size):
        seen = []

        async def app(scope, receive, send):
            message = await receive()
            seen.append(len(message["body"]))
            await send({"type": "http.response.start", "status": 200, "headers": []})
            await send({"type": "http.response.body", "body": b""})

        sent = []
        headers = [(b"content-type", b"application/json")]
        if with_length:
            headers.append((b"content-length", str(size).encode()))
        scope = {"type": "http", "path": "/v1/completions", "headers": headers, "method": "POST"}

        async def receive():
            return {"type": "http.request", "body": b"x" * size, "more_body": False}

        async def send(message):
            sent.append(message)

        try:
            await BodyLimit(app, limit=100)(scope, receive, send)
        except Exception as error:  # the chunked refusal is an HTTPException the app's handler answers
            return getattr(error, "status_code", None)
        return next(m["status"] for m in sent if m["type"] == "http.response.start")

    assert asyncio.run(call(100)) == 200
    assert asyncio.run(call(101)) == 413
