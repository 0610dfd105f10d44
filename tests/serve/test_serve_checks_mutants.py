"""The server's request checks, from a mutation audit of serve/http_schema.py, serve/api.py's
request building, serve/prompt_format.py and serve/endpoints.py: each test here failed on a
mutant the other tests let through (a refusal dropped, a bound moved, a field read from the
wrong place). Real servers on the sim engine (Llama, Orpheus, BAGEL); what a client sees (status,
`param`, message words) or the `Request` the server built from the body."""
from __future__ import annotations

import json
import urllib.request
from types import SimpleNamespace
from typing import Any, Iterator

import pytest

from mstar.plan.schema import PromptFormatPlan
from mstar.runtime.serve.endpoints import Endpoints
from mstar.runtime.serve.api import LLM, PromptError, SamplingError, SamplingParams
from mstar.runtime.serve.http_schema import ApiError, CompletionBody, SpeechBody
from mstar.runtime.serve.prompt_format import PromptFormatError, format_prompt, prompt_format_of
from serve_harness import LLAMA, ORPHEUS, ROOT, make_service, post_json, running, write_tokenizer

BAGEL = str(ROOT / "generated" / "bagel.plan")


def _recording(llm: LLM) -> list[Any]:
    """The Requests `llm.request` builds from now on (the server's last step before the run loop)."""
    made: list[Any] = []
    inner = llm.request

    def request(*args: Any, **kwargs: Any) -> Any:
        made.append(inner(*args, **kwargs))
        return made[-1]

    llm.request = request  # type: ignore[method-assign]
    return made


def _served(plan: str, tmp_path_factory: Any) -> Iterator[tuple[str, list[Any], LLM]]:
    """A module fixture's server: `plan` on the sim engine with the word tokenizer, recording the
    Requests it builds; (its URL, those Requests, its LLM)."""
    llm = LLM(plan, engine="sim", tokenizer=str(write_tokenizer(tmp_path_factory.mktemp("tok"))))
    made = _recording(llm)
    with running(make_service(llm)) as url:
        yield url, made, llm


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    yield from _served(LLAMA, tmp_path_factory)


def _post(url: str, path: str, body: dict) -> tuple[int, dict]:
    return post_json(f"{url}{path}", json.dumps(body).encode())


def _completion(url: str, **fields: Any) -> tuple[int, dict]:
    return _post(url, "/completions", {"model": "llama", "prompt": [1, 9, 10], "max_tokens": 2, **fields})


# ------------------------------------------------------------ completions and chat: refusals


@pytest.mark.parametrize("fields, param, words", [
    ({"presence_penalty": 2.5}, "presence_penalty", "presence_penalty must be in [-2, 2], got 2.5"),
    ({"frequency_penalty": -2.01}, "frequency_penalty", "frequency_penalty must be in [-2, 2], got -2.01"),
    ({"logprobs": 21}, "logprobs", "logprobs must be between 0 and 20, got 21"),
    ({"logprobs": -1}, "logprobs", "logprobs must be between 0 and 20, got -1"),
    ({"top_logprobs": 2}, "top_logprobs", "top_logprobs is a chat completion field"),
    # vLLM's field, ignored before: the prompt's log-probabilities come with echo and logprobs here
    ({"prompt_logprobs": 1}, "prompt_logprobs", "a completion's prompt log-probabilities come with `echo: true`"),
    ({"prediction": {"type": "content", "content": "x"}}, "prediction", "prediction is not supported"),
    # a refused field is refused whatever its value but null (an empty list asks for tools too)
    ({"tools": []}, "tools", "tools is not supported"),
    ({"response_format": {"type": "json_object"}}, "response_format", "response_format is not supported"),
    ({"modalities": ["text", "audio"]}, "modalities", "modalities is not supported"),
    ({"stop": [5]}, "stop", "must be a string or a list of strings"),
    ({"n": 0}, "n", "n must be between 1 and 128, got 0"),
    ({"n": 129}, "n", "n must be between 1 and 128, got 129"),
    ({"prompt": [[1, 2]] * 5, "n": 26}, "prompt", "5 prompts x n 26 is 130 choices, more than the 128"),
    # vLLM's text fields at a value this server does not give (each was accepted and ignored)
    ({"include_stop_str_in_output": True}, "include_stop_str_in_output", "other than false is not supported"),
    ({"skip_special_tokens": False}, "skip_special_tokens", "other than true is not supported"),
    ({"spaces_between_special_tokens": False}, "spaces_between_special_tokens", "other than true"),
    ({"best_of": 1, "n": 2}, "best_of", "best_of must be at least n, got n=2 and best_of=1"),
    # more of vLLM's fields that change the answer (each was accepted and ignored: guided_json answered
    # free text, min_p sampled without its floor, add_special_tokens: false still began with BOS)
    ({"guided_json": {"type": "object"}}, "guided_json", "guided_json is not supported"),
    ({"guided_choice": ["yes", "no"]}, "guided_choice", "guided_choice is not supported"),
    ({"structured_outputs": {"regex": "a+"}}, "structured_outputs", "structured_outputs is not supported"),
    ({"truncate_prompt_tokens": 2}, "truncate_prompt_tokens", "truncate_prompt_tokens is not supported"),
    ({"allowed_token_ids": [5]}, "allowed_token_ids", "allowed_token_ids is not supported"),
    ({"bad_words": ["cat"]}, "bad_words", "bad_words is not supported"),
    ({"min_p": 0.1}, "min_p", "min_p other than 0 is not supported"),
    ({"use_beam_search": True}, "use_beam_search", "use_beam_search other than false"),
    ({"add_special_tokens": False}, "add_special_tokens", "add_special_tokens other than true"),
])
def test_a_completion_option_the_server_does_not_take_is_a_400(llama, fields, param, words):
    url, _, _ = llama
    status, error = _completion(url, **fields)
    assert status == 400 and error["param"] == param and words in error["message"], error
    assert error["type"] == "invalid_request_error"


@pytest.mark.parametrize("fields", [{"best_of": 1}, {"presence_penalty": 0}, {"frequency_penalty": 0.0},
                                    {"echo": None}, {"n": 1}, {"tools": None}, {"include_stop_str_in_output": False},
                                    {"skip_special_tokens": True}, {"spaces_between_special_tokens": None},
                                    {"min_p": 0.0}, {"use_beam_search": False}, {"add_special_tokens": True},
                                    {"guided_json": None}, {"return_tokens_as_token_ids": False},
                                    # OpenAI's defaults, plain text (a 400 before): another value is still refused
                                    {"response_format": {"type": "text"}}, {"modalities": ["text"]}])
def test_a_completion_option_at_its_neutral_value_is_taken(llama, fields):
    url, _, _ = llama
    status, answer = _completion(url, **fields)
    assert status == 200, answer


def test_a_completion_prompt_in_a_one_item_list_is_that_prompt(llama):
    url, made, _ = llama
    for prompt in ([[1, 9, 10]], ["hello world"]):
        status, answer = _completion(url, prompt=prompt)
        assert status == 200, answer
        assert made[-1].prompt_tokens in ([1, 9, 10], [1, 15, 16])
        assert answer["usage"]["prompt_tokens"] == 3


def test_a_completion_without_max_tokens_makes_openais_default_16(llama):
    url, made, _ = llama
    status, answer = _post(url, "/completions", {"model": "llama", "prompt": [1, 9, 10]})
    assert status == 200, answer
    assert made[-1].max_tokens == 16


def test_vllms_ignore_eos_and_min_tokens_reach_the_request(llama):
    url, made, _ = llama
    status, answer = _completion(url, ignore_eos=True, min_tokens=2)
    assert status == 200, answer
    assert made[-1].ignore_eos is True and made[-1].min_tokens == 2
    status, answer = _completion(url, ignore_eos=None, min_tokens=None)
    assert status == 200 and made[-1].ignore_eos is False and made[-1].min_tokens == 0
    status, error = _completion(url, min_tokens=3)  # past max_tokens (2)
    assert status == 400 and "min_tokens must be in [0, max_tokens (2)], got 3" in error["message"], error
    assert error["param"] == "min_tokens"


def test_a_completion_carries_its_stop_string_whole_and_its_stop_token_ids(llama):
    url, made, _ = llama
    status, answer = _completion(url, stop="hello world", stop_token_ids=[7, 8])
    assert status == 200, answer
    assert made[-1].stop_strings == ["hello world"] and made[-1].stop_tokens == [7, 8]


@pytest.mark.parametrize("fields, words", [
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs must be between 0 and 20, got 21"),
    ({"top_logprobs": 2}, "top_logprobs needs logprobs: true"),
    ({"logprobs": False, "top_logprobs": 2}, "top_logprobs needs logprobs: true"),
])
def test_a_chat_top_logprobs_out_of_range_or_alone_is_a_400(llama, fields, words):
    url, _, _ = llama
    status, error = _post(url, "/chat/completions", {"model": "llama", "messages": [{"role": "user", "content": "hi"}],
                                                     "max_tokens": 2, **fields})
    assert status == 400 and error["param"] == "top_logprobs" and words in error["message"], error


@pytest.mark.parametrize("fields, param", [({"echo": True}, "echo"), ({"prompt_logprobs": 2}, "prompt_logprobs")])
def test_vllms_chat_echo_and_prompt_logprobs_are_refused(llama, fields, param):
    """Each was ignored (a client asking for the echoed message got the reply alone)."""
    url, _, _ = llama
    status, error = _post(url, "/chat/completions", {"model": "llama", "messages": [{"role": "user", "content": "hi"}],
                                                     "max_tokens": 2, **fields})
    assert status == 400 and error["param"] == param and "not supported on chat completions" in error["message"]
    status, _ = _post(url, "/chat/completions", {"model": "llama", "messages": [{"role": "user", "content": "hi"}],
                                                 "max_tokens": 2, "echo": False})
    assert status == 200


@pytest.mark.parametrize("fields, param", [
    ({"best_of": 3}, "best_of"), ({"skip_special_tokens": False}, "skip_special_tokens"),
    # vLLM's chat fields that change the prompt or the answer, each accepted and ignored before (the
    # assistant's turn opened anyway, the checkpoint's template rendered instead of the one sent)
    ({"add_generation_prompt": False}, "add_generation_prompt"),
    ({"continue_final_message": True}, "continue_final_message"),
    ({"add_special_tokens": True}, "add_special_tokens"),
    ({"chat_template": "{{ messages[0]['content'] }}"}, "chat_template"),
    ({"chat_template_kwargs": {"enable_thinking": False}}, "chat_template_kwargs"),
    ({"guided_regex": "[a-z]+"}, "guided_regex"), ({"min_p": 0.05}, "min_p")])
def test_a_chat_option_the_server_does_not_take_is_a_400(llama, fields, param):
    """vLLM's chat `best_of` and text fields were accepted and ignored; at their neutral value they are taken."""
    url, _, _ = llama
    body = {"model": "llama", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    status, error = _post(url, "/chat/completions", {**body, **fields})
    assert status == 400 and error["param"] == param and "not supported" in error["message"], error
    status, _ = _post(url, "/chat/completions", {**body, "best_of": 1, "skip_special_tokens": True,
                                                 "add_generation_prompt": True, "continue_final_message": False,
                                                 "add_special_tokens": False, "chat_template": None, "min_p": 0})
    assert status == 200


@pytest.mark.parametrize("fields", [{"logprobs": False, "top_logprobs": 0}, {"logprobs": None, "top_logprobs": None}])
def test_a_chat_without_logprobs_asks_for_none(llama, fields):
    url, made, _ = llama
    status, answer = _post(url, "/chat/completions", {"model": "llama", "messages": [{"role": "user", "content": "hi"}],
                                                      "max_tokens": 2, **fields})
    assert status == 200, answer
    assert made[-1].logprobs is None and answer["choices"][0]["logprobs"] is None


def test_logprobs_and_logit_bias_on_the_simulated_engine_are_refused_saying_why(llama):
    """(tests/serve/test_openai_logprobs.py answers them on the torch engine)"""
    url, made, _ = llama
    status, error = _post(url, "/chat/completions", {"model": "llama", "messages": [{"role": "user", "content": "hi"}],
                                                     "max_tokens": 2, "logprobs": True, "top_logprobs": 3})
    assert status == 400 and "the simulated engine draws its tokens without any" in error["message"], error
    assert made[-1].logprobs == 3
    status, error = _completion(url, logit_bias={"5": 10})
    assert status == 400 and "the simulated engine draws its tokens without any" in error["message"], error
    assert made[-1].logit_bias == [(5, 10.0)]


def test_a_chat_max_completion_tokens_wins_over_max_tokens(llama):
    url, made, _ = llama
    status, answer = _post(url, "/chat/completions", {"model": "llama", "messages": [{"role": "user", "content": "hi"}],
                                                      "max_tokens": 5, "max_completion_tokens": 2})
    assert status == 200, answer
    assert made[-1].max_tokens == 2 and answer["usage"]["completion_tokens"] == 2


@pytest.mark.parametrize("messages, words", [
    ([{"content": "hi"}], "needs a 'role' string"),
    ([{"role": "developer"}], "a developer message needs its 'content'"),
    ([{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}], "only text content parts"),
    ([{"role": "user", "content": [{"type": "text", "text": 5}]}], "needs a 'text' string")])
def test_a_bad_chat_message_is_a_400_naming_messages(llama, messages, words):
    url, _, _ = llama
    status, error = _post(url, "/chat/completions", {"model": "llama", "messages": messages, "max_tokens": 2})
    assert status == 400 and error["param"] == "messages" and words in error["message"], error


def test_chat_content_parts_are_joined_without_a_separator(llama):
    url, made, llm = llama
    parts = [{"type": "text", "text": "hello "}, {"type": "text", "text": "world"}, {"type": "text", "text": "sea"}]
    status, answer = _post(url, "/chat/completions", {"model": "llama", "max_tokens": 2,
                                                      "messages": [{"role": "user", "content": parts}]})
    assert status == 200, answer
    assert made[-1].prompt_tokens == llm.prompt_tokens({"messages": [{"role": "user", "content": "hello worldsea"}]})


def test_an_assistant_message_without_content_is_empty_content(llama):
    url, made, llm = llama
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant"}]
    status, answer = _post(url, "/chat/completions", {"model": "llama", "max_tokens": 2, "messages": messages})
    assert status == 200, answer
    expected = llm.prompt_tokens({"messages": [messages[0], {"role": "assistant", "content": ""}]})
    assert made[-1].prompt_tokens == expected


# ------------------------------------------------------------ the body models directly


def test_completion_body_sampling_keeps_a_stop_string_whole():
    body = CompletionBody.model_validate({"model": "m", "prompt": [1], "stop": "ab", "stop_token_ids": [3]})
    sampling = body.sampling(4)
    assert sampling.stop == ["ab"] and sampling.stop_token_ids == [3] and sampling.max_tokens == 4


@pytest.mark.parametrize("prompt, prompts", [([[1], [2]], [[1], [2]]), (["a", "b"], ["a", "b"]), ([1, 2], [[1, 2]]),
                                             ("a", ["a"]), ([[1, 2]], [[1, 2]]), ([], [[]])])
def test_a_completion_body_gives_its_prompts_in_order(prompt, prompts):
    """A list of texts or of token-id lists is a prompt each (it was refused past one); token ids
    alone, or text, are one prompt; an empty list is one empty prompt (refused as such later)."""
    assert CompletionBody.model_validate({"model": "m", "prompt": prompt}).prompt_values() == prompts


def test_a_completion_body_of_too_many_choices_is_refused():
    body = CompletionBody.model_validate({"model": "m", "prompt": [[1]] * 65, "n": 2})
    with pytest.raises(ApiError) as refused:
        body.prompt_values()
    assert refused.value.status == 400 and refused.value.param == "prompt"
    assert len(CompletionBody.model_validate({"model": "m", "prompt": [[1]] * 64, "n": 2}).prompt_values()) == 64


def test_speech_body_prompt_gives_the_voice_to_the_format():
    body = SpeechBody.model_validate({"model": "m", "input": "hi", "voice": "leo"})
    assert body.prompt(["voice"]) == {"voice": "leo", "prompt": "hi"}


def test_speech_body_without_a_voice_gives_the_format_no_voice():
    """A plan whose speech has no prompt format takes a body without `voice` (no default voice)."""
    assert SpeechBody.model_validate({"model": "m", "input": "hi"}).prompt([]) == {"prompt": "hi"}


def test_a_voice_the_plan_does_not_take_says_how_a_client_sends_none():
    """OpenAI's client cannot leave `voice` out: on a plan with no voice field the 400 names the
    empty voice, which such a plan takes (the refusal alone left an SDK user no way through)."""
    for fields in ([], ["instructions"]):
        with pytest.raises(ApiError) as refused:
            SpeechBody.model_validate({"model": "m", "input": "hi", "voice": "alloy"}).prompt(fields)
        assert refused.value.status == 400 and refused.value.param == "voice"
        assert refused.value.message.endswith('a client that must name a voice may send "voice": ""'), refused.value
        assert SpeechBody.model_validate({"model": "m", "input": "hi", "voice": ""}).prompt(fields) == {"prompt": "hi"}
    with pytest.raises(ApiError) as refused:  # a plan that takes a voice says nothing of an empty one
        SpeechBody.model_validate({"model": "m", "input": "hi", "voice": "a", "n": 2}).prompt(["voice"])
    assert refused.value.param == "n" and '"voice": ""' not in refused.value.message


# ------------------------------------------------------------ speech


@pytest.fixture(scope="module")
def orpheus(tmp_path_factory):
    yield from _served(ORPHEUS, tmp_path_factory)


@pytest.mark.parametrize("fields, param, words", [
    ({"speed": 2.0}, "speed", "speed other than 1.0"),
    ({"input": ""}, "input", "must not be empty"),
])
def test_a_speech_request_the_server_cannot_make_is_a_400(orpheus, fields, param, words):
    url, _, _ = orpheus
    body = {"model": "orpheus", "voice": "tara", "input": "hi", "max_tokens": 14, **fields}
    status, error = _post(url, "/audio/speech", body)
    assert status == 400 and error["param"] == param and words in error["message"], error


def test_speech_frames_the_voice_the_client_names(orpheus):
    url, made, llm = orpheus
    body = {"model": "orpheus", "voice": "cat", "input": "hello world", "max_tokens": 14}
    request = urllib.request.Request(f"{url}/audio/speech", headers={"Content-Type": "application/json"},
                                     data=json.dumps(body).encode())
    with urllib.request.urlopen(request, timeout=30) as answer:
        assert answer.status == 200 and answer.read()[:4] == b"RIFF"
    assert made[-1].prompt_tokens == llm.prompt_tokens({"prompt": "hello world", "voice": "cat"})
    assert made[-1].prompt_tokens != llm.prompt_tokens({"prompt": "hello world"})  # the default voice


# ------------------------------------------------------------ images


@pytest.fixture(scope="module")
def bagel(tmp_path_factory):
    for url, _, _ in _served(BAGEL, tmp_path_factory):
        yield url


@pytest.mark.parametrize("fields, param, words", [
    ({"n": 0}, "n", "n must be 1"),
    ({"output_compression": 0}, "output_compression", "png"),
    ({"prompt": ""}, "prompt", "must not be empty"),
])
def test_an_image_request_the_server_cannot_make_is_a_400(bagel, fields, param, words):
    status, error = _post(bagel, "/images/generations", {"model": "bagel", "prompt": "a cat", **fields})
    assert status == 400 and error["param"] == param and words in error["message"], error


# ------------------------------------------------------------ the Python API's request building


@pytest.fixture(scope="module")
def bare_llama():
    """Llama on the sim engine without a tokenizer."""
    llm = LLM(LLAMA, engine="sim")
    yield llm
    llm.close(5)


@pytest.mark.parametrize("prompt", [{"prompt": "hi"}, {"messages": [{"role": "user", "content": "hi"}]}])
def test_a_dict_prompt_without_a_tokenizer_is_a_prompt_error(bare_llama, prompt):
    with pytest.raises(PromptError, match="needs a tokenizer"):
        bare_llama.prompt_tokens(prompt)


def test_stop_strings_without_a_tokenizer_are_a_sampling_error(bare_llama):
    with pytest.raises(SamplingError, match="stop strings need a tokenizer"):
        bare_llama.request([1, 2], SamplingParams(max_tokens=2, stop=["x"]))


@pytest.mark.parametrize("prompt, words", [
    ([1, -1], "non-negative"), ([True, 2], "non-negative"), (frozenset({1, 2}), "a prompt is text"),
    ({"prompt": 5}, "must be a string"), ("", "empty"), ({"prompt": ""}, "empty"),
    ({"prompt": "hello", "messages": []}, "'messages'"), ({"messages": []}, "non-empty list"),
    ({"messages": [{"role": "user", "content": 5}]}, "string 'content'"),
])
def test_a_bad_prompt_is_a_prompt_error(llama, prompt, words):
    _, _, llm = llama
    with pytest.raises(PromptError, match=words):
        llm.prompt_tokens(prompt)


def test_the_token_limit_is_max_seq_len_inclusive(llama):
    _, _, llm = llama
    limit, _ = llm.token_limit()
    assert limit == llm.plan.deployment.max_seq_len
    assert len(llm.request([1] * (limit - 1), SamplingParams(max_tokens=1)).prompt_tokens) == limit - 1
    with pytest.raises(PromptError) as refused:
        llm.request([1] * (limit - 1), SamplingParams(max_tokens=2))
    assert refused.value.param == "max_tokens"  # room for one token: max_tokens is what to change
    with pytest.raises(PromptError) as refused:
        llm.request([1] * limit, SamplingParams(max_tokens=1))
    assert refused.value.param == "prompt"  # no room at all: the prompt is


def test_a_request_carries_every_sampling_value(llama):
    _, _, llm = llama
    request = llm.request([1, 9, 10], SamplingParams(max_tokens=3, temperature=0.7, top_k=5, top_p=0.9, seed=11,
                                                     repetition_penalty=1.2, stop=["cat"], stop_token_ids=[7]))
    assert (request.max_tokens, request.temperature, request.top_k, request.top_p, request.seed,
            request.repetition_penalty) == (3, 0.7, 5, 0.9, 11, 1.2)
    assert request.stop_strings == ["cat"] and request.stop_tokens == [7]


def test_media_that_is_not_a_dict_is_a_prompt_error(llama):
    _, _, llm = llama
    with pytest.raises(PromptError, match="media must map modalities"):
        llm.request([1], SamplingParams(max_tokens=2), media=[1])  # type: ignore[arg-type]


def test_sampling_that_is_not_sampling_params_is_a_sampling_error(llama):
    _, _, llm = llama
    with pytest.raises(SamplingError, match="must be a SamplingParams"):
        llm.request([1], {"max_tokens": 2})  # type: ignore[arg-type]


@pytest.mark.parametrize("fields, words", [
    ({"seed": 1.5}, "seed must be an integer"), ({"repetition_penalty": "1.1"}, "repetition_penalty must be a number"),
    ({"top_p": True}, "top_p must be a number"), ({"stop_token_ids": [-1]}, "stop_token_ids"),
    ({"stop": [""]}, "stop must be a list of non-empty strings"), ({"stop": ["x"] * 65}, "stop"),
    ({"guidance": {"text": float("inf")}}, "guidance"), ({"guidance": {"text": -0.5}}, "guidance"),
    ({"top_p": 1.5}, "top_p"), ({"max_tokens": 0}, "max_tokens"),
])
def test_sampling_values_out_of_kind_or_range_are_refused(fields, words):
    with pytest.raises(SamplingError, match=words) as refused:
        SamplingParams(**fields).check()
    assert refused.value.param == next(iter(fields))


def test_sampling_values_at_their_bounds_are_taken():
    SamplingParams(max_tokens=1, guidance={"text": 0.0}, top_p=1.0, temperature=0.0, top_k=0,
                   stop_token_ids=[0]).check()


def test_a_sampling_error_about_no_field_names_none():
    assert SamplingError("sampling must be a SamplingParams, got dict").param is None


def test_a_format_plan_takes_no_chat_messages(orpheus):
    _, _, llm = orpheus
    with pytest.raises(PromptError, match="takes no chat messages"):
        llm.prompt_tokens({"messages": [{"role": "user", "content": "hi"}]})


# ------------------------------------------------------------ prompt formats


FORM = PromptFormatPlan(template="{voice}: {prompt}", before=[3], after=[4, 5], fields=["voice"],
                        defaults={"voice": "cat"})


class _Words:
    def encode(self, text: str) -> list[int]:
        return [len(word) for word in text.split()]


def test_a_prompt_format_frames_the_text_with_the_requests_value_else_the_default():
    assert format_prompt(FORM, _Words(), "hello", {"voice": "dogs"}) == [3, 5, 5, 4, 5]
    assert format_prompt(FORM, _Words(), "hello", {}) == [3, 4, 5, 4, 5]


@pytest.mark.parametrize("form, text, values, words", [
    (FORM, "hello", {"voice": ""}, "non-empty text"), (FORM, "hello", {"voice": 5}, "non-empty text"),
    (FORM, "hello", {"voice": "a\ud800"}, "not valid Unicode"), (FORM, "a\ud800", {}, "the text is not valid Unicode"),
    (PromptFormatPlan(template="{voice}: {prompt}", fields=["voice"]), "hello", {}, "needs 'voice'"),
])
def test_a_prompt_format_refuses_what_it_cannot_frame(form, text, values, words):
    with pytest.raises(PromptFormatError, match=words):
        format_prompt(form, _Words(), text, values)


def _node(prompt_format: Any, engine: str = "kv", prompt: str = "text", role: str = "tokens") -> Any:
    return SimpleNamespace(engine=engine, prompt_format=prompt_format,
                           input_roles=[SimpleNamespace(prompt=prompt, role=role)])


def test_the_prompt_format_is_the_text_prompt_kv_nodes():
    other = PromptFormatPlan(template="{prompt}!")
    assert prompt_format_of(SimpleNamespace(nodes=[_node(other, engine="module"), _node(FORM)])) == FORM
    assert prompt_format_of(SimpleNamespace(nodes=[_node(other, prompt="audio"), _node(FORM)])) == FORM
    assert prompt_format_of(SimpleNamespace(nodes=[_node(FORM), _node(FORM)])) == FORM
    assert prompt_format_of(SimpleNamespace(nodes=[_node(None)])) is None
    with pytest.raises(PromptFormatError, match="different prompt formats"):
        prompt_format_of(SimpleNamespace(nodes=[_node(FORM), _node(other)]))


# ------------------------------------------------------------ endpoints and bounds


def test_speech_and_images_need_a_text_prompt():
    endpoints = Endpoints(frozenset({"audio"}), frozenset({"audio", "image", "text"}), takes_waveform=True)
    assert not endpoints.can_speech and not endpoints.can_images and endpoints.names() == ["transcription"]
    endpoints = Endpoints(frozenset({"text"}), frozenset({"audio", "image"}))
    assert endpoints.can_speech and endpoints.can_images and not endpoints.can_transcribe


def test_a_repeating_plans_bound_is_named_with_its_rounds():
    from mstar.plan.io import load_plan

    with LLM(load_plan(str(ROOT / "generated" / "whisper.plan"), verify=False), engine="sim") as whisper:
        limit, bound = whisper.token_limit()
        length = whisper.plan.deployment.max_seq_len
        assert (limit, bound) == (length * 1000, f"max_seq_len {length} x 1000 rounds")


def test_a_loops_exit_to_the_client_is_a_client_emission():
    from mstar.runtime.serve.endpoints import _client_edges

    to_client = SimpleNamespace(dest_kind="client", modality="audio")
    walk = SimpleNamespace(calls=[SimpleNamespace(edges=[SimpleNamespace(dest_kind="node", modality=None)])],
                           loops=[SimpleNamespace(exits=[SimpleNamespace(edge=to_client), SimpleNamespace(edge=None)])])
    assert list(_client_edges(walk)) == [to_client]


def test_the_python_api_lays_an_audio_prompt_out_around_its_states():
    """`LLM.request` with audio on a plan whose prompt holds audio placeholders (Qwen3-ASR) puts one
    placeholder per audio state where the prompt holds one (the HTTP transcription route and `mstar
    run` lay it out themselves, so their tests passed without this step; the mutation audit's A56)."""
    import numpy as np

    with LLM(str(ROOT / "generated" / "qwen3_asr.plan"), engine="sim") as asr:
        layout = asr.audio_layout
        samples = np.zeros(16000 * 3, dtype=np.float32)
        count = layout.num_states(samples.shape[0])
        assert count > 1
        request = asr.request([7, layout.placeholder, 8], SamplingParams(max_tokens=4), media={"audio": samples})
        assert request.prompt_tokens == [7] + [layout.placeholder] * count + [8]
