"""Several choices in one answer: OpenAI's `n`, and a completion's list of prompts (n choices a
prompt, in prompt order). Each choice is its own request and gives the tokens that request gives
through the Python API (choice j with seed + j); usage counts each prompt once; a stream
interleaves the choices by `index`; where one choice cannot start, none runs."""
from __future__ import annotations

import pytest

from mstar.runtime.serve.api import LLM, SamplingParams
from mstar.runtime.serve.engine_setup import build_engine, load
from serve_harness import LLAMA, Gate, llama_with_client, make_service, running, wait_until

openai = pytest.importorskip("openai")

SAMPLED = dict(temperature=1.0, top_k=50)


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    with llama_with_client(tmp_path_factory.mktemp("tok")) as served:
        yield served


def _alone(llm, prompt, max_tokens, seed):
    return llm.generate([prompt], SamplingParams(max_tokens=max_tokens, seed=seed, **SAMPLED))[0]


def test_n_choices_are_the_requests_of_seeds_seed_plus_j(llama):
    llm, client = llama
    answer = client.completions.create(model="llama", prompt=[1, 9, 10], max_tokens=5, n=3, seed=7,
                                       extra_body={"top_k": 50}, temperature=1.0)
    assert [c.index for c in answer.choices] == [0, 1, 2]
    expected = [_alone(llm, [1, 9, 10], 5, 7 + j).token_ids for j in range(3)]
    assert [c.model_extra["token_ids"] for c in answer.choices] == expected
    assert len({tuple(ids) for ids in expected}) > 1  # sampled with different seeds
    single = client.completions.create(model="llama", prompt=[1, 9, 10], max_tokens=5, seed=7,
                                       extra_body={"top_k": 50}, temperature=1.0)
    assert single.choices[0].model_extra["token_ids"] == expected[0]  # choice 0 is the n = 1 answer
    assert (answer.usage.prompt_tokens, answer.usage.completion_tokens, answer.usage.total_tokens) == (3, 15, 18)
    assert answer.id == f"cmpl-{answer.id.removeprefix('cmpl-')}"


def test_choices_without_a_seed_and_repeats_of_a_body_sample_apart(llama):
    """Without a seed each choice (and each repeat of the body) draws with a seed of its own: they
    all sampled with the sampler's seed 0 and came out the same."""
    _, client = llama
    body = dict(model="llama", prompt=[1, 9, 10], max_tokens=6, temperature=1.0)
    answer = client.completions.create(n=3, **body)
    again = client.completions.create(**body)
    found = [tuple(c.model_extra["token_ids"]) for c in answer.choices + again.choices]
    assert len(set(found)) == 4, found
    chat = client.chat.completions.create(model="llama", messages=[{"role": "user", "content": "hello"}],
                                          max_tokens=6, temperature=1.0, n=2)
    assert chat.choices[0].message.content != chat.choices[1].message.content


def test_a_list_of_prompts_gives_n_choices_a_prompt_in_prompt_order(llama):
    llm, client = llama
    prompts = [[1, 9, 10, 11], [1, 12]]
    answer = client.completions.create(model="llama", prompt=prompts, max_tokens=4, n=2, seed=3,
                                       extra_body={"top_k": 50}, temperature=1.0)
    assert [c.index for c in answer.choices] == [0, 1, 2, 3]
    expected = [_alone(llm, p, 4, 3 + j).token_ids for p in prompts for j in range(2)]
    assert [c.model_extra["token_ids"] for c in answer.choices] == expected
    assert (answer.usage.prompt_tokens, answer.usage.completion_tokens) == (4 + 2, 4 * 4)


def test_a_list_of_texts_is_tokenized_prompt_by_prompt(llama):
    llm, client = llama
    answer = client.completions.create(model="llama", prompt=["hello world", "the cat sat"], max_tokens=3)
    expected = [o.token_ids for o in llm.generate([[1, 15, 16], [1, 7, 8, 9]], SamplingParams(max_tokens=3))]
    assert [c.model_extra["token_ids"] for c in answer.choices] == expected
    # each choice's text reads after its prompt (a space before the first word here)
    texts = [_after(llm.tokenizer.decode, p, ids) for p, ids in zip([[1, 15, 16], [1, 7, 8, 9]], expected)]
    assert [c.text for c in answer.choices] == texts and all(t.startswith(" ") for t in texts)
    assert answer.usage.prompt_tokens == 3 + 4


def test_streamed_choices_come_interleaved_by_index(llama):
    llm, client = llama
    whole = client.chat.completions.create(model="llama", messages=[{"role": "user", "content": "hello"}],
                                           max_tokens=6, n=3, seed=11, temperature=1.0)
    stream = client.chat.completions.create(model="llama", messages=[{"role": "user", "content": "hello"}],
                                            max_tokens=6, n=3, seed=11, temperature=1.0, stream=True,
                                            stream_options={"include_usage": True})
    chunks = list(stream)
    assert [c.index for c in chunks[0].choices] == [0, 1, 2]
    assert all(c.delta.role == "assistant" for c in chunks[0].choices)
    texts, ids, reasons = ["", "", ""], [[], [], []], [None, None, None]
    for chunk in chunks[1:]:
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
            ids[choice.index] += choice.model_extra["token_ids"]
            reasons[choice.index] = choice.finish_reason or reasons[choice.index]
    assert texts == [c.message.content for c in whole.choices]
    assert ids == [c.model_extra["token_ids"] for c in whole.choices]
    assert reasons == ["length"] * 3
    with_usage = [c for c in chunks if c.usage is not None]
    # its own chunk alone (it was also on the last choice's end: a client adding up usage counted 36)
    assert [c.usage.completion_tokens for c in with_usage] == [18]
    assert with_usage[-1].choices == [] and with_usage[-1].usage.prompt_tokens == whole.usage.prompt_tokens


def test_streamed_completions_of_two_prompts(llama):
    llm, client = llama
    prompts = [[1, 20, 21], [1, 22, 23, 24]]
    stream = client.completions.create(model="llama", prompt=prompts, max_tokens=5, stream=True)
    ids: dict[int, list[int]] = {0: [], 1: []}
    for chunk in stream:
        for choice in chunk.choices:
            ids[choice.index] += choice.model_extra["token_ids"]
    assert [ids[0], ids[1]] == [o.token_ids for o in llm.generate(prompts, SamplingParams(max_tokens=5))]


def test_a_bad_prompt_among_several_refuses_the_body_before_any_runs(llama):
    llm, client = llama
    with pytest.raises(openai.BadRequestError, match="vocabulary"):
        client.completions.create(model="llama", prompt=[[1, 2], [1, 200000]], max_tokens=2)
    with pytest.raises(openai.BadRequestError, match="seed"):  # choice 1's seed is past 64 bits
        client.completions.create(model="llama", prompt=[1, 2], max_tokens=2, n=2, seed=2**63 - 1)
    assert llm.loop.num_in_flight == 0


def test_choices_past_the_queue_are_a_429_and_leave_nothing_running():
    """Two choices where the loop has room for one: room for both is asked at once, so none runs
    (the first ran, its TTFT counted, and was cancelled: /metrics held a `cancelled` request and a
    TTFT sample for each 429 body), and the answer is the 429 a single request past the queue gets."""
    plan = load(LLAMA)
    plan = plan.model_copy(update={"deployment": plan.deployment.model_copy(update={"max_concurrent_requests": 1})})
    llm = LLM(plan, engine=Gate(build_engine(plan, "torch")), max_waiting=0)
    service = make_service(llm)
    start = llm.engine.kv_pages()
    with running(service) as url:
        client = openai.OpenAI(base_url=url, api_key="none", max_retries=0)
        with pytest.raises(openai.RateLimitError, match="these 2 would pass the most this server queues"):
            client.completions.create(model="llama", prompt=[1, 2, 3], max_tokens=50, n=2)
        assert wait_until(lambda: llm.loop.num_in_flight == 0)
        assert llm.engine.kv_pages() == start
        outcomes = {s.labels["outcome"]: s.value for s in service.metrics.requests.collect()[0].samples
                    if s.name.endswith("_total")}
        assert outcomes == {"overloaded": 1.0}, outcomes
        answer = client.completions.create(model="llama", prompt=[1, 2, 3], max_tokens=3)
        assert answer.choices[0].finish_reason == "length"


def test_a_client_leaving_a_stream_of_choices_cancels_every_choice(llama):
    llm, client = llama
    start = llm.engine.kv_pages()
    stream = client.completions.create(model="llama", prompt=[[1, 30, 31], [1, 32]], max_tokens=2000, n=2,
                                       stream=True)
    chunks = iter(stream)
    next(chunks)
    next(chunks)
    assert wait_until(lambda: llm.loop.num_running == 4)
    stream.close()
    assert wait_until(lambda: llm.loop.num_in_flight == 0)
    assert llm.engine.kv_pages() == start


class _Stream:
    """An LLM.stream stand-in: `deltas` then, unless the last is final, waits for ever; records
    whether it was left before its last delta (LLM.stream then cancels its request)."""

    def __init__(self, deltas):
        self.deltas = deltas
        self.left_early = False

    async def run(self):
        import asyncio

        try:
            for delta in self.deltas:
                yield delta
            await asyncio.Event().wait()
        finally:
            self.left_early = not self.deltas[-1].is_final


@pytest.mark.parametrize("is_streamed", [False, True])
def test_a_failed_choice_cancels_the_choices_still_running_at_once(is_streamed):
    """Choice 0 never ends; choice 1 fails: the answer is choice 1's error, without waiting for
    choice 0, whose stream is left (its request cancelled)."""
    import asyncio

    from types import SimpleNamespace

    from mstar.runtime.conductor.request import Request
    from mstar.runtime.serve import http_stream as sse
    from mstar.runtime.serve.http_app import collect_all
    from mstar.runtime.serve.http_schema import ApiError
    from mstar.runtime.serve.online import Delta

    running = _Stream([Delta("a", [5], "x")])
    failing = _Stream([Delta("b", [6], "y"), Delta("b", finish_reason="error: the step failed")])

    async def answer():
        streams = [running.run(), failing.run()]
        started = [(s, await s.__anext__()) for s in streams]
        if not is_streamed:
            return await asyncio.wait_for(collect_all(started), 5)
        choices = [sse.Choice(Request(id=name, prompt_tokens=[1], max_tokens=1)) for name in "ab"]
        service, body = SimpleNamespace(model_name="m", id_tag="t"), SimpleNamespace(include_usage=False)
        return [event async for event in sse.completion_events(service, choices, body, started)]

    if is_streamed:
        events = asyncio.run(answer())
        assert '"the step failed"' in events[-2] and events[-1] == "data: [DONE]\n\n"
    else:
        with pytest.raises(ApiError, match="the step failed"):
            asyncio.run(answer())
    assert running.left_early and not failing.left_early


def test_a_handler_cancelled_while_its_choices_start_leaves_none_running():
    """The handler's task cancelled (the server going down) while it waits for its choices' first
    deltas: each stream's wait is cancelled and the stream closed, so its request is cancelled."""
    import asyncio

    from mstar.runtime.serve.http_app import _first_deltas

    left = []

    async def never_first(name):
        try:
            await asyncio.Event().wait()
            yield None
        finally:
            left.append(name)

    async def handler():
        waiting = asyncio.ensure_future(_first_deltas([never_first("a"), never_first("b")]))
        await asyncio.sleep(0.01)
        waiting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiting

    asyncio.run(handler())
    assert sorted(left) == ["a", "b"]


def _after(decode, prompt, ids):
    """The text a completion adds to its prompt's: the whole decoded, the prompt's own taken off."""
    return decode(prompt + ids)[len(decode(prompt)):]


def test_a_body_refused_for_one_of_its_prompts_counts_its_others_refused():
    """Two prompts, one that can never fit the pool: the body's answer is the refusal, and the other
    prompt, started and then cancelled, counted `cancelled` (a request nobody asked to cancel)."""
    plan = load(LLAMA)
    pools = [pool.model_copy(update={"num_pages": 4}) for pool in plan.deployment.kv_pools]
    plan = plan.model_copy(update={"deployment": plan.deployment.model_copy(update={"kv_pools": pools})})
    llm = LLM(plan, engine=Gate(build_engine(plan, "sim", sim_pace=0), limit=1), max_waiting=4)
    service = make_service(llm)
    with running(service) as url:
        client = openai.OpenAI(base_url=url, api_key="none", max_retries=0)
        with pytest.raises(openai.BadRequestError, match="can never fit"):
            client.completions.create(model="llama", prompt=[[1, 2, 3], [1] + [5] * 300], max_tokens=20)
        llm.engine.release()
        assert wait_until(lambda: llm.loop.num_in_flight == 0)
        outcomes = {s.labels["outcome"]: s.value for s in service.metrics.requests.collect()[0].samples
                    if s.name.endswith("_total")}
    assert outcomes == {"refused": 2.0}, outcomes


def test_response_ids_carry_the_servers_own_tag(tmp_path):
    """Request ids count from req-0 in every process, and response ids were `cmpl-` + the request's
    id: a restarted server answered `cmpl-req-0` again. Each server now draws a tag of its own; a
    stream's chunks all carry the one id."""
    from serve_harness import write_tokenizer

    llm = LLM(LLAMA, tokenizer=str(write_tokenizer(tmp_path)))
    service = make_service(llm)
    assert service.id_tag != make_service(llm).id_tag
    with running(service) as url:
        client = openai.OpenAI(base_url=url, api_key="none", max_retries=0)
        answer = client.completions.create(model="llama", prompt=[1, 9, 10], max_tokens=2)
        assert answer.id.startswith(f"cmpl-{service.id_tag}-req-")
        chunks = list(client.chat.completions.create(model="llama", messages=[{"role": "user", "content": "hi"}],
                                                     max_tokens=3, stream=True))
        assert len({chunk.id for chunk in chunks}) == 1 and chunks[0].id.startswith(f"chatcmpl-{service.id_tag}-req-")
