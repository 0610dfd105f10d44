"""A real server on the CPU torch engine (tiny Llama, random weights, a word-level tokenizer),
talked to with the official `openai` client: completions from token ids and from text, chat,
streaming, and errors. Token ids are checked against the Python API on the same engine."""
from __future__ import annotations

import urllib.error
import urllib.request

import pytest

from mstar.runtime.serve.api import LLM, SamplingParams
from serve_harness import LLAMA, Gate, make_service, post_json, running, write_tokenizer

openai = pytest.importorskip("openai")


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    from mstar.runtime.serve.engine_setup import build_engine, load

    plan = load(LLAMA)
    gate = Gate(build_engine(plan, "torch"))
    llm = LLM(plan, engine=gate, tokenizer=str(write_tokenizer(tmp_path_factory.mktemp("tok"))))
    service = make_service(llm)
    with running(service) as url:
        yield service, gate, openai.OpenAI(base_url=url, api_key="none", max_retries=0)


def test_models_lists_the_plan_model(llama):
    service, _, client = llama
    models = client.models.list().data
    assert [m.id for m in models] == ["llama"]
    assert models[0].model_extra["serves"] == ["text"]


def test_a_model_is_retrieved_by_name(llama):
    _, _, client = llama
    assert client.models.retrieve("llama").id == "llama"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-4")


def test_completion_from_token_ids_matches_the_python_api(llama):
    service, _, client = llama
    answer = client.completions.create(model="llama", prompt=[1, 9, 10, 11], max_tokens=6)
    choice = answer.choices[0]
    expected = service.llm.generate([[1, 9, 10, 11]], SamplingParams(max_tokens=6))[0]
    assert choice.model_extra["token_ids"] == expected.token_ids and len(expected.token_ids) == 6
    assert choice.text == expected.text and choice.text  # the tokenizer decodes every id
    assert choice.finish_reason == "length"
    assert (answer.usage.prompt_tokens, answer.usage.completion_tokens, answer.usage.total_tokens) == (4, 6, 10)


def test_presence_and_frequency_penalties_reach_the_sampler(llama):
    """OpenAI's penalties (they were refused with 400): the answer is the Python API's with the same
    settings, and the penalty changes greedy tokens that repeat without it."""
    service, _, client = llama
    penalised = client.completions.create(model="llama", prompt=[1, 9, 10], max_tokens=24, presence_penalty=2.0,
                                          frequency_penalty=0.5)
    ids = penalised.choices[0].model_extra["token_ids"]
    plain, expected = service.llm.generate([[1, 9, 10]] * 2, [SamplingParams(max_tokens=24), SamplingParams(
        max_tokens=24, presence_penalty=2.0, frequency_penalty=0.5)])
    assert ids == expected.token_ids and ids != plain.token_ids
    assert len(set(ids)) == len(ids) and len(set(plain.token_ids)) < len(plain.token_ids)


def test_completion_from_text_tokenizes_it(llama):
    service, _, client = llama
    answer = client.completions.create(model="llama", prompt="hello world", max_tokens=3)
    assert answer.usage.prompt_tokens == 3  # <s> hello world
    expected = service.llm.generate([[1, 15, 16]], SamplingParams(max_tokens=3))[0]
    assert answer.choices[0].model_extra["token_ids"] == expected.token_ids


def test_text_that_is_not_valid_unicode_is_a_400(llama):
    """A JSON string may hold a lone surrogate (the escape \\ud800, which no client library sends,
    so the body is written by hand): the tokenizer's backend refused it with a bare TypeError, a 500;
    now a 400 naming it, and the server answers the next request."""
    import json

    _, _, client = llama
    for path, body in (("completions", '{"model": "llama", "prompt": "hello \\ud800 world", "max_tokens": 3}'),
                       ("chat/completions", '{"model": "llama", "max_tokens": 3, '
                                            '"messages": [{"role": "user", "content": "\\udfff"}]}')):
        request = urllib.request.Request(f"{client.base_url}{path}", data=body.encode("ascii"),
                                         headers={"Content-Type": "application/json"})
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(request, timeout=30)
        assert refused.value.code == 400
        assert "not valid Unicode" in json.loads(refused.value.read())["error"]["message"]
    assert client.completions.create(model="llama", prompt="hello world", max_tokens=3).usage.prompt_tokens == 3


def test_chat_goes_through_the_chat_template(llama):
    service, _, client = llama
    messages = [{"role": "system", "content": "you are kind"}, {"role": "user", "content": "tell me a story"}]
    answer = client.chat.completions.create(model="llama", messages=messages, max_tokens=5)
    ids = service.llm.tokenizer.encode_chat(messages)
    expected = service.llm.generate([ids], SamplingParams(max_tokens=5))[0]
    assert answer.choices[0].message.role == "assistant"
    assert answer.choices[0].message.content == expected.text
    assert answer.usage.prompt_tokens == len(ids) and answer.usage.completion_tokens == 5


def test_streamed_deltas_arrive_before_the_request_ends(llama):
    """The engine is held after the prompt and two decode steps: the client reads its first
    deltas while the request cannot have ended, then the rest."""
    service, gate, client = llama
    expected = service.llm.generate([[1, 20, 21]], SamplingParams(max_tokens=8))[0]
    gate.opened.clear()
    gate.limit = gate.num_steps + 3
    stream = client.completions.create(model="llama", prompt=[1, 20, 21], max_tokens=8, stream=True)
    chunks = iter(stream)
    early = [next(chunks) for _ in range(3)]
    assert gate.reached.wait(10) and service.llm.loop.num_in_flight == 1  # still running
    assert all(c.choices[0].finish_reason is None for c in early)
    gate.release()
    rest = list(chunks)
    ids = [t for c in early + rest if c.choices for t in c.choices[0].model_extra["token_ids"]]
    assert ids == expected.token_ids
    assert len(early + rest) == 8  # one event per step's delta
    assert "".join(c.choices[0].text for c in early + rest) == expected.text
    assert rest[-1].choices[0].finish_reason == "length" and rest[-1].usage.completion_tokens == 8


def test_streamed_chat_sends_the_role_then_content(llama):
    service, _, client = llama
    stream = client.chat.completions.create(model="llama", messages=[{"role": "user", "content": "hello"}],
                                            max_tokens=4, stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    ids = service.llm.tokenizer.encode_chat([{"role": "user", "content": "hello"}])
    assert content == service.llm.generate([ids], SamplingParams(max_tokens=4))[0].text
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 4


@pytest.mark.parametrize("call,status,words", [
    (dict(model="gpt-4", prompt=[1, 2]), 404, "does not exist"),
    (dict(model="llama", prompt=[1, 2], temperature=-1), 400, "temperature"),
    (dict(model="llama", prompt=[1, 2], top_p=1.5), 400, "top_p"),
    (dict(model="llama", prompt=[1, 2], max_tokens=0), 400, "max_tokens"),
    (dict(model="llama", prompt=[1, 2], n=200), 400, "n must be between 1 and 128"),
    (dict(model="llama", prompt=[1] * 8190, max_tokens=16), 400, "max_seq_len"),
    # past the decode loop's 2048 after the prefill's token: the answer would stop there ("length")
    (dict(model="llama", prompt=[1, 2], max_tokens=5000), 400, "at most 2049 output tokens"),
    (dict(model="llama", prompt=[1, 2], logprobs=21), 400, "logprobs must be between 0 and 20, got 21"),
    (dict(model="llama", prompt=[]), 400, "empty"),
    (dict(model="llama", prompt=[1, 200000]), 400, "vocabulary"),
    # OpenAI fields this server does not implement are refused by name (they were ignored: a 200)
    (dict(model="llama", prompt=[1, 2], extra_body={"tools": [{"type": "function"}]}), 400, "tools is not"),
    (dict(model="llama", prompt=[1, 2], extra_body={"response_format": {"type": "json_object"}}), 400,
     "response_format is not supported"),
])
def test_bad_requests_get_an_openai_error(llama, call, status, words):
    _, _, client = llama
    with pytest.raises(openai.APIStatusError) as caught:
        client.completions.create(**call)
    assert caught.value.status_code == status
    assert words in caught.value.message
    body = caught.value.body
    assert isinstance(body, dict) and {"message", "type"} <= set(body)  # the client unwraps "error"


def test_a_prompt_past_max_seq_len_names_max_tokens(llama):
    """As the Python API's PromptError does (the server answered `param: null`)."""
    _, _, client = llama
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(model="llama", prompt=[1] * 8190, max_tokens=16)
    assert caught.value.body["param"] == "max_tokens"


@pytest.mark.parametrize("extra, words", [
    ({"response_format": {"type": "json_object"}}, "response_format is not supported"),
    ({"tool_choice": "auto"}, "tool_choice is not supported"),
    ({"messages": [{"role": "user"}]}, "a user message needs its 'content'"),
    ({"messages": [{"content": "hi"}]}, "each message needs a 'role' string"),
    ({"messages": [{"role": "user", "content": [{"type": "text"}]}]}, "a text content part needs a 'text' string"),
])
def test_bad_chat_requests_name_what_is_wrong(llama, extra, words):
    _, _, client = llama
    call = {"model": "llama", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    fields = {name: value for name, value in extra.items() if name != "messages"}
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(**{**call, "messages": extra.get("messages", call["messages"])},
                                       extra_body=fields)
    assert words in caught.value.message


@pytest.mark.parametrize("field", ["max_completion_tokens", "max_tokens"])
@pytest.mark.parametrize("value, words, long_prompt", [
    (0, "{} must be >= 1, got 0", False),
    (5000, "{} 5000 is more than this plan makes", False),
    (16, "+ {} (16) is", True),  # past max_seq_len with the prompt
], ids=["below_one", "past_the_plan", "past_max_seq_len"])
def test_a_chat_token_limit_error_names_the_field_sent(llama, field, value, words, long_prompt):
    """A refused `max_completion_tokens` was named `max_tokens` (message and param), a field the
    client did not send."""
    import json

    content = "hello " * 8180 if long_prompt else "hi"  # 8,184 tokens framed: room, but not for 16
    body = {"model": "llama", "messages": [{"role": "user", "content": content}], field: value}
    status, error = _raw_post(llama[2], "chat/completions", json.dumps(body).encode())
    assert status == 400 and words.format(field) in error["message"], error
    assert error["param"] == field
    if field == "max_completion_tokens":
        assert "max_tokens" not in error["message"].replace("max_completion_tokens", "")


def test_an_endpoint_the_plan_does_not_serve_is_404_with_a_message(llama):
    _, _, client = llama
    with pytest.raises(openai.NotFoundError) as caught:
        client.audio.speech.create(model="llama", voice="x", input="hello")
    assert "does not serve speech (it serves: text)" in caught.value.message
    # whatever the body: the route validated it first, so a malformed one got a 400 here
    for path in ("audio/speech", "images/generations", "audio/transcriptions"):
        request = urllib.request.Request(f"{client.base_url}{path}", data=b'{"input": 5}',
                                         headers={"Content-Type": "application/json"})
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(request, timeout=30)
        assert refused.value.code == 404 and "does not serve" in refused.value.read().decode()


def _raw_post(client, path: str, data: bytes) -> tuple[int, dict]:
    return post_json(f"{client.base_url}{path}", data)


@pytest.mark.parametrize("path, body, param, words", [
    ("completions", {"prompt": []}, "prompt", "the prompt is empty"),
    ("completions", {"prompt": [-1]}, "prompt", "non-negative"),
    ("completions", {"prompt": [1] * 8192, "max_tokens": 1}, "prompt", "leaves no room to generate"),
    ("chat/completions", {"messages": [{"role": "user", "content": "hello " * 8190}]}, "messages",
     "leaves no room to generate"),
], ids=["empty", "negative_id", "no_room", "chat_no_room"])
def test_a_refused_prompt_names_the_bodys_prompt_field(llama, path, body, param, words):
    """An empty prompt or a negative id was a 400 with `param: null`, and a prompt with no room
    left blamed max_tokens, which no value of could fix (an audit)."""
    import json

    status, error = _raw_post(llama[2], path, json.dumps({"model": "llama", **body}).encode())
    assert status == 400 and error["param"] == param and words in error["message"], error


def test_a_seed_whose_choices_pass_64_bits_is_refused_as_sent(llama):
    """With n > 1, choice j samples with seed + j: a seed of 2**63 - 1 was refused as "seed must be
    a 64-bit integer, got 9223372036854775808", a number the client never sent."""
    import json

    body = {"model": "llama", "prompt": [1], "n": 2, "seed": 2**63 - 1, "temperature": 1, "max_tokens": 1}
    status, error = _raw_post(llama[2], "completions", json.dumps(body).encode())
    assert status == 400 and error["param"] == "seed", error
    assert error["message"].startswith(f"seed {2**63 - 1} with n 2: choice j samples with seed + j"), error
    status, _ = _raw_post(llama[2], "completions", json.dumps({**body, "n": 1}).encode())
    assert status == 200


@pytest.mark.parametrize("body, message, param", [
    # strict: a number as a string, a boolean as a number or as ids, a string as a boolean (they were coerced)
    (b'{"model": "llama", "prompt": [1, 2], "max_tokens": "5"}', "max_tokens: Input should be a valid integer",
     "max_tokens"),
    (b'{"model": "llama", "prompt": [1, 2], "max_tokens": true}', "max_tokens: Input should be a valid integer",
     "max_tokens"),
    (b'{"model": "llama", "prompt": [1, 2], "stream": "yes"}', "stream: Input should be a valid boolean", "stream"),
    # stream_options as strictly (a string there read as true: "no" sent the usage chunk)
    (b'{"model": "llama", "prompt": [1], "max_tokens": 2, "stream": true, "stream_options": {"include_usage": "no"}}',
     "stream_options.include_usage: Input should be a valid boolean", "stream_options.include_usage"),
    (b'{"model": "llama", "prompt": [1], "stream": true, "stream_options": {"include_usage": 1}}',
     "stream_options.include_usage: Input should be a valid boolean", "stream_options.include_usage"),
    (b'{"model": "llama", "prompt": [1], "stream": true, "stream_options": "include_usage"}',
     "stream_options: must be an object", "stream_options"),
    (b'{"model": "llama", "prompt": [1], "stream": true, "stream_options": [true]}',
     "stream_options: must be an object", "stream_options"),
    (b'{"model": "llama", "prompt": [true, false]}', "prompt: must be a string, a list of token ids", "prompt"),
    # one message a field, not the union's branch (it said "prompt.str" and "stop.str")
    (b'{"model": "llama", "prompt": [1, "a"]}', "prompt: must be a string, a list of token ids", "prompt"),
    (b'{"model": "llama", "prompt": [1, 2], "stop": 5}', "stop: must be a string or a list of strings", "stop"),
    # an empty stop string as sent (it read "stop must be a list of non-empty strings, got ['']")
    (b'{"model": "llama", "prompt": [1, 2], "stop": ""}', "stop: a stop string must not be empty (it would end "
     "every answer at once), got ''", "stop"),
    (b'{"model": "llama", "prompt": [1, 2], "stop": ["a", ""]}', "stop: a stop string must not be empty", "stop"),
    # the body itself (a JSON error's offset read as a field: "26: JSON decode error", param "26")
    (b'{"model": "llama", "prompt":', "the request body is not valid JSON", None),
    (b"", "the request body is missing", None),
    # FastAPI's "Input should be a valid dictionary or object to extract fields from" said neither
    (b"[1, 2]", "the request body must be a JSON object, got an array", None),
    (b'"hello"', "the request body must be a JSON object, got a string", None),
    # a value out of range names its field
    (b'{"model": "llama", "prompt": [1, 2], "temperature": -1}', "temperature must be >= 0", "temperature"),
    (b'{"model": "llama", "prompt": [1, 2], "max_tokens": 0}', "max_tokens must be >= 1", "max_tokens"),
    # values the sampler's float32 cannot hold (1e39 is inf there, 1e-300 is 0: each row's NaN
    # probabilities sampled token 0), and a stop string no decoded text holds
    (b'{"model": "llama", "prompt": [1, 2], "temperature": 1e39}', "temperature must be at most 10000",
     "temperature"),
    (b'{"model": "llama", "prompt": [1, 2], "temperature": 1, "repetition_penalty": 1e-300}',
     "repetition_penalty must be in [0.0001, 10000]", "repetition_penalty"),
    (b'{"model": "llama", "prompt": [1, 2], "stop": ["ok", "\\ud800"]}',
     "stop string 1 is not valid Unicode: surrogates not allowed", "stop"),
])
def test_a_bad_body_is_a_400_naming_its_field(llama, body, message, param):
    status, error = _raw_post(llama[2], "completions", body)
    assert status == 400 and error["message"].startswith(message), error
    assert error["param"] == param


def test_a_body_not_sent_as_json_says_to_send_it_so(llama):
    """curl's `-d` without `-H "Content-Type: application/json"` sends a form's content type, so
    FastAPI does not parse the body: the 400 said "Input should be a valid dictionary or object to
    extract fields from"."""
    import json

    body = b'{"model": "llama", "prompt": [1, 2], "max_tokens": 2}'
    request = urllib.request.Request(f"{llama[2].base_url}completions", data=body,
                                     headers={"Content-Type": "application/x-www-form-urlencoded"})
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(request, timeout=30)
    assert refused.value.code == 400
    assert "Content-Type: application/json" in json.loads(refused.value.read())["error"]["message"]


@pytest.mark.parametrize("path, body", [
    ("completions", b'{"model": "llama", "prompt": [1, 2], "max_tokens": 2, "stream": null, "echo": null}'),
    ("chat/completions", b'{"model": "llama", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, '
                         b'"stream": null}'),
], ids=["completions", "chat"])
def test_a_null_stream_or_echo_is_their_default(llama, path, body):
    """OpenAI's API takes null for these ("boolean or null", default false), as for the other
    optional fields here: they were a 400 ("Input should be a valid boolean")."""
    status, answer = _raw_post(llama[2], path, body)
    assert status == 200 and answer["usage"]["completion_tokens"] == 2, answer


def _stream_events(client, body: dict) -> list:
    import json

    request = urllib.request.Request(f"{client.base_url}completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=30) as answer:
        assert answer.status == 200
        lines = [line for line in answer.read().decode().splitlines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    return [json.loads(line[len("data: "):]) for line in lines[:-1]]


@pytest.mark.parametrize("stream", [False, None])
def test_stream_options_without_a_stream_are_refused(llama, stream):
    """OpenAI's and vLLM's rule (it was taken and ignored)."""
    import json

    body = {"model": "llama", "prompt": [1, 2], "max_tokens": 2, "stream_options": {"include_usage": True}}
    if stream is not None:
        body["stream"] = stream
    status, error = _raw_post(llama[2], "completions", json.dumps(body).encode())
    assert (status, error["param"]) == (400, "stream_options")
    assert "only allowed when stream is true" in error["message"]


@pytest.mark.parametrize("options, has_usage_chunk", [
    (None, False), ({}, False), ({"include_usage": None}, False), ({"include_usage": False}, False),
    ({"include_usage": True}, True),
    # other keys are ignored, as unknown fields of the body are (OpenAI's include_obfuscation, vLLM's own)
    ({"include_usage": True, "include_obfuscation": False}, True), ({"continuous_usage_stats": "x"}, False),
])
def test_include_usage_adds_the_usage_chunk_only_when_true(llama, options, has_usage_chunk):
    body = {"model": "llama", "prompt": [1, 2], "max_tokens": 2, "stream": True, "stream_options": options}
    chunks = _stream_events(llama[2], body)
    assert [c for c in chunks if c["choices"] == [] and "usage" in c] == ([chunks[-1]] if has_usage_chunk else [])
    # the usage once: in its own chunk when asked, else on the last choice's end (on both, a client
    # adding up usage chunk by chunk counted the request twice)
    assert [c["usage"]["completion_tokens"] for c in chunks if "usage" in c] == [2]


def test_a_chat_prompt_that_fills_the_sequence_says_so(llama):
    """Without max_tokens a chat request takes what max_seq_len leaves; a prompt that leaves
    nothing was refused as "max_tokens (1)", a value the client never sent."""
    import json

    body = {"model": "llama", "messages": [{"role": "user", "content": "hello " * 8200}]}
    status, error = _raw_post(llama[2], "chat/completions", json.dumps(body).encode())
    assert status == 400 and "leaves no room to generate" in error["message"] and "max_tokens" not in error["message"]


def test_a_chat_request_without_max_tokens_takes_no_more_than_the_plan_makes(llama, tmp_path):
    """max_seq_len leaves 8,000-odd tokens after a short prompt, more than llama's walks make
    (2049): the default is that, not a refusal of a value the client never sent (on the simulated
    engine, where 2049 steps take a moment)."""
    assert llama[0].default_tokens(8000) == 2049 and llama[0].default_tokens(16) == 16
    with LLM(LLAMA, engine="sim", tokenizer=str(write_tokenizer(tmp_path))) as llm, \
            running(make_service(llm)) as url:
        client = openai.OpenAI(base_url=url, api_key="none", max_retries=0)
        answer = client.chat.completions.create(model="llama", messages=[{"role": "user", "content": "hello"}])
    assert answer.choices[0].finish_reason == "length" and answer.usage.completion_tokens == 2049
