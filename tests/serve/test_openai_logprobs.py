"""Log-probabilities and logit_bias through the server. Log-probabilities come in OpenAI's two
shapes: a completion's `logprobs: N` (parallel `tokens`, `token_logprobs`, `top_logprobs` of up to
N + 1 entries, `text_offset`) and a chat's `logprobs: true` with `top_logprobs: N` (`content`
entries with token, logprob, bytes and N alternatives). The numbers are the Python API's for the
same request (tests/engine/test_logprobs_parity.py holds those against transformers); a stream
carries each chunk's tokens'. A logit_bias reaches the engine from both endpoints. A completion's
`echo` puts the prompt before each choice's text, whole or streamed."""
from __future__ import annotations

import math

import pytest

from mstar.runtime.serve.api import SamplingParams
from serve_harness import llama_with_client

openai = pytest.importorskip("openai")

PROMPT = [1, 9, 10, 11]


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    with llama_with_client(tmp_path_factory.mktemp("tok")) as served:
        yield served


def _name(llm, before, token):
    """A token's name after the tokens before it: the text it adds there (the whole prefix decoded,
    where the server reads the last five tokens: the same for this tokenizer), its own where it
    adds none (a special token)."""
    decode = llm.tokenizer.decode
    return decode(list(before) + [token])[len(decode(list(before))):] or llm.tokenizer.token_text(token)


def _names(llm, before, ids):
    return [_name(llm, list(before) + list(ids[:i]), token) for i, token in enumerate(ids)]


def _api(llm, prompt, max_tokens, logprobs, **settings):
    return llm.generate([prompt], SamplingParams(max_tokens=max_tokens, logprobs=logprobs, **settings))[0]


def test_a_completions_logprobs_are_the_apis_in_openais_shape(llama):
    llm, client = llama
    answer = client.completions.create(model="llama", prompt=PROMPT, max_tokens=5, logprobs=3, temperature=1.0,
                                       seed=5)
    expected = _api(llm, PROMPT, 5, 3, temperature=1.0, seed=5)
    choice = answer.choices[0]
    assert choice.model_extra["token_ids"] == expected.token_ids
    logprobs = choice.logprobs
    assert logprobs.tokens == _names(llm, PROMPT, expected.token_ids)
    assert "".join(logprobs.tokens) == choice.text  # each token's name is what it adds to the text
    assert logprobs.token_logprobs == pytest.approx([own for own, _ in expected.logprobs])
    for i, (text, top, (own, alternatives)) in enumerate(zip(logprobs.tokens, logprobs.top_logprobs,
                                                              expected.logprobs)):
        before = PROMPT + expected.token_ids[:i]
        assert top == pytest.approx({**{_name(llm, before, t): v for t, v in alternatives}, text: own})
        assert 3 <= len(top) <= 4
    lengths = [len(text) for text in logprobs.tokens]
    assert logprobs.text_offset == [sum(lengths[:i]) for i in range(len(lengths))]
    assert all(value <= 0 for value in logprobs.token_logprobs)


def test_a_chats_logprobs_carry_the_alternatives_most_likely_first(llama):
    llm, client = llama
    messages = [{"role": "user", "content": "hello"}]
    answer = client.chat.completions.create(model="llama", messages=messages, max_tokens=4, logprobs=True,
                                            top_logprobs=2)
    prompt = llm.tokenizer.encode_chat(messages)
    expected = _api(llm, prompt, 4, 2)
    content = answer.choices[0].logprobs.content
    assert [entry.token for entry in content] == _names(llm, prompt, expected.token_ids)
    assert "".join(entry.token for entry in content) == answer.choices[0].message.content
    for i, (entry, (own, alternatives)) in enumerate(zip(content, expected.logprobs)):
        assert entry.logprob == pytest.approx(own)
        assert entry.bytes == list(entry.token.encode())
        assert [(top.token, top.logprob) for top in entry.top_logprobs] == pytest.approx(
            [(_name(llm, prompt + expected.token_ids[:i], t), v) for t, v in alternatives])
        assert entry.logprob == pytest.approx(entry.top_logprobs[0].logprob)  # greedy: the most likely
    plain = client.chat.completions.create(model="llama", messages=messages, max_tokens=4)
    assert plain.choices[0].logprobs is None
    assert plain.choices[0].message.content == answer.choices[0].message.content


def test_a_stream_carries_each_chunks_tokens_logprobs(llama):
    llm, client = llama
    whole = client.completions.create(model="llama", prompt=PROMPT, max_tokens=6, logprobs=1)
    chunks = list(client.completions.create(model="llama", prompt=PROMPT, max_tokens=6, logprobs=1, stream=True))
    tokens, values, offsets = [], [], []
    for chunk in chunks:
        for choice in chunk.choices:
            if choice.logprobs is not None:
                tokens += choice.logprobs.tokens
                values += choice.logprobs.token_logprobs
                offsets += choice.logprobs.text_offset
    assert tokens == whole.choices[0].logprobs.tokens
    assert values == pytest.approx(whole.choices[0].logprobs.token_logprobs)
    assert offsets == whole.choices[0].logprobs.text_offset
    messages = [{"role": "user", "content": "hello"}]
    stream = client.chat.completions.create(model="llama", messages=messages, max_tokens=5, logprobs=True,
                                            stream=True)
    content = [entry for chunk in stream for choice in chunk.choices if choice.logprobs is not None
               for entry in choice.logprobs.content]
    assert len(content) == 5 and all(entry.top_logprobs == [] for entry in content)
    assert all(math.isfinite(entry.logprob) for entry in content)


def test_n_choices_each_carry_their_own_logprobs(llama):
    llm, client = llama
    answer = client.completions.create(model="llama", prompt=PROMPT, max_tokens=3, n=2, seed=3, temperature=1.0,
                                       logprobs=0)
    for j, choice in enumerate(answer.choices):
        expected = _api(llm, PROMPT, 3, 0, temperature=1.0, seed=3 + j)
        assert choice.logprobs.token_logprobs == pytest.approx([own for own, _ in expected.logprobs])
        assert [len(top) for top in choice.logprobs.top_logprobs] == [1, 1, 1]  # the sampled token's own


def test_logit_bias_reaches_the_engine_on_both_endpoints(llama):
    _, client = llama
    answer = client.completions.create(model="llama", prompt=PROMPT, max_tokens=4, logit_bias={"42": 100})
    assert answer.choices[0].model_extra["token_ids"] == [42] * 4
    chat = client.chat.completions.create(model="llama", messages=[{"role": "user", "content": "hello"}],
                                          max_tokens=3, logit_bias={"17": 100}, temperature=1.0, seed=1)
    assert chat.choices[0].model_extra["token_ids"] == [17] * 3


@pytest.mark.parametrize("bias, words", [({"42": 101}, "logit_bias of token 42 must be a number in [-100, 100]"),
                                         ({"abc": 1}, "logit_bias token id must be an integer"),
                                         ({"200000": 1}, "logit_bias token id 200000 is outside the vocabulary"),
                                         ({"7": -100, "07": 100}, "logit_bias names token 7 twice")])
def test_a_bad_logit_bias_is_a_400_naming_it(llama, bias, words):
    """Each names `logit_bias` in `param` and no request id: a token outside the vocabulary was
    refused at the engine's admission ("request req-7 cannot run: node LLM: ...", param null; the id is no longer said),
    and one named twice ("7" and "07") took the later bias, lifting the ban silently."""
    _, client = llama
    with pytest.raises(openai.BadRequestError) as refused:
        client.completions.create(model="llama", prompt=PROMPT, max_tokens=2, logit_bias=bias, n=2)
    assert words in refused.value.message and "req-" not in refused.value.message
    assert isinstance(refused.value.body, dict) and refused.value.body["param"] == "logit_bias"


def test_echo_puts_the_prompt_before_each_choices_text(llama):
    llm, client = llama
    plain = client.completions.create(model="llama", prompt="hello world", max_tokens=3)
    echoed = client.completions.create(model="llama", prompt="hello world", max_tokens=3, echo=True, n=2, seed=1,
                                       temperature=1.0)
    assert all(c.text.startswith("hello world") for c in echoed.choices)
    greedy = client.completions.create(model="llama", prompt="hello world", max_tokens=3, echo=True)
    assert greedy.choices[0].text == "hello world" + plain.choices[0].text
    assert greedy.usage.completion_tokens == plain.usage.completion_tokens  # the prompt is not output
    ids = client.completions.create(model="llama", prompt=[1, 9, 10], max_tokens=2, echo=True)
    assert ids.choices[0].text.startswith(llm.tokenizer.decode([1, 9, 10]))
    stream = list(client.completions.create(model="llama", prompt="hello world", max_tokens=3, echo=True,
                                            stream=True))
    assert "".join(c.choices[0].text for c in stream if c.choices) == greedy.choices[0].text


def test_echo_with_logprobs_covers_the_prompts_tokens_then_the_completions(llama):
    """OpenAI's legacy shape for a loglikelihood: the prompt's tokens first (the first with null),
    each with the API's prompt log-probabilities, then the completion's; a stream carries the
    prompt's on its first chunk."""
    llm, client = llama
    answer = client.completions.create(model="llama", prompt=PROMPT, max_tokens=2, logprobs=1, echo=True)
    expected = llm.generate([PROMPT], SamplingParams(max_tokens=2, logprobs=1, prompt_logprobs=1))[0]
    logprobs = answer.choices[0].logprobs
    ids = PROMPT + expected.token_ids
    assert logprobs.tokens == _names(llm, [], ids)  # from the text's start: the prompt is echoed
    assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None
    entries = expected.prompt_logprobs[1:] + expected.logprobs
    assert logprobs.token_logprobs[1:] == pytest.approx([own for own, _ in entries])
    for i, (text, top, (own, alternatives)) in enumerate(zip(logprobs.tokens[1:], logprobs.top_logprobs[1:],
                                                              entries), start=1):
        assert top == pytest.approx({**{_name(llm, ids[:i], t): v for t, v in alternatives}, text: own})
    lengths = [len(text) for text in logprobs.tokens]
    assert logprobs.text_offset == [sum(lengths[:i]) for i in range(len(lengths))]
    stream = list(client.completions.create(model="llama", prompt=PROMPT, max_tokens=2, logprobs=1, echo=True,
                                            stream=True))
    chunks = [c.choices[0].logprobs for c in stream if c.choices and c.choices[0].logprobs]
    assert [t for chunk in chunks for t in chunk.tokens] == logprobs.tokens
    assert [v for chunk in chunks for v in chunk.token_logprobs] == pytest.approx(logprobs.token_logprobs)


def test_echo_with_logprobs_gives_each_prompt_and_choice_its_own(llama):
    """Two prompts, two choices each: every choice's logprobs start with its own prompt's tokens,
    whole and streamed (each choice's first chunk)."""
    llm, client = llama
    prompts = [PROMPT, [1, 5, 7]]
    answer = client.completions.create(model="llama", prompt=prompts, max_tokens=2, logprobs=0, echo=True, n=2,
                                       temperature=1.0, seed=4)
    stream = list(client.completions.create(model="llama", prompt=prompts, max_tokens=2, logprobs=0, echo=True,
                                            n=2, temperature=1.0, seed=4, stream=True))
    assert len(answer.choices) == 4
    for choice in answer.choices:
        prompt = prompts[choice.index // 2]
        tokens = choice.logprobs.tokens
        assert tokens[:len(prompt)] == _names(llm, [], prompt)
        assert len(tokens) == len(prompt) + len(choice.model_extra["token_ids"])
        assert choice.logprobs.token_logprobs[0] is None
        assert all(value is not None for value in choice.logprobs.token_logprobs[1:])
        streamed = [t for chunk in stream for c in chunk.choices if c.index == choice.index and c.logprobs
                    for t in c.logprobs.tokens]
        assert streamed[:len(prompt)] == tokens[:len(prompt)]


def test_echo_with_max_tokens_zero_answers_the_prompt_alone(llama):
    """`max_tokens: 0` with `echo` (what prompt-scoring clients send, vLLM's answer): the prompt's
    text and its tokens' log-probabilities, no completion token, none counted, whole and streamed;
    without `echo` it is still refused."""
    llm, client = llama
    answer = client.completions.create(model="llama", prompt=PROMPT, max_tokens=0, logprobs=2, echo=True)
    expected = llm.generate([PROMPT], SamplingParams(max_tokens=1, prompt_logprobs=2))[0]
    choice = answer.choices[0]
    assert choice.text == llm.tokenizer.decode(PROMPT) and choice.model_extra["token_ids"] == []
    assert choice.finish_reason == "length"
    assert choice.logprobs.tokens == _names(llm, [], PROMPT)
    assert choice.logprobs.token_logprobs[0] is None
    assert choice.logprobs.token_logprobs[1:] == pytest.approx([own for own, _ in expected.prompt_logprobs[1:]])
    assert (answer.usage.prompt_tokens, answer.usage.completion_tokens) == (len(PROMPT), 0)
    stream = list(client.completions.create(model="llama", prompt=PROMPT, max_tokens=0, logprobs=2, echo=True,
                                            stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in stream if c.choices) == choice.text
    streamed = [c.choices[0].logprobs for c in stream if c.choices and c.choices[0].logprobs]
    assert [t for chunk in streamed for t in chunk.tokens] == choice.logprobs.tokens
    assert stream[-1].usage.completion_tokens == 0
    text = client.completions.create(model="llama", prompt="hello world", max_tokens=0, echo=True)
    assert text.choices[0].text == "hello world" and text.usage.completion_tokens == 0
    # the hidden token a stop token: the answer still ends `length` (it said `stop`)
    first = llm.generate([PROMPT], SamplingParams(max_tokens=1, temperature=0))[0].token_ids[0]
    hidden = client.completions.create(model="llama", prompt=PROMPT, max_tokens=0, echo=True, temperature=0,
                                       extra_body={"stop_token_ids": [first]})
    assert hidden.choices[0].finish_reason == "length"
    streamed = list(client.completions.create(model="llama", prompt=PROMPT, max_tokens=0, echo=True, temperature=0,
                                              stream=True, extra_body={"stop_token_ids": [first]}))
    assert [c.choices[0].finish_reason for c in streamed if c.choices][-1] == "length"
    with pytest.raises(openai.BadRequestError, match="max_tokens must be >= 1"):
        client.completions.create(model="llama", prompt=PROMPT, max_tokens=0)
    # a prompt filling max_seq_len has no room for the token its request samples: refused by its
    # length (it was told of a `max_tokens (1)` the client never sent)
    longest = llm.plan.deployment.max_seq_len
    with pytest.raises(openai.BadRequestError) as refused:
        client.completions.create(model="llama", prompt=[5] * longest, max_tokens=0, echo=True)
    assert f"the prompt is {longest} tokens, more than this plan takes: at most {longest - 1}" in refused.value.message
    assert isinstance(refused.value.body, dict) and refused.value.body["param"] == "prompt"
    alone = client.completions.create(model="llama", prompt=[5] * (longest - 1), max_tokens=0, echo=True)
    assert alone.usage.prompt_tokens == longest - 1 and alone.choices[0].model_extra["token_ids"] == []
