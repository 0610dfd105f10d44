"""A client that disconnects mid-stream cancels its request: its KV pages go back to the pool
(the pool's count returns to where it started) and the streams running beside it finish with
the tokens they get when they run alone. Then the online loop's own guarantees: it idles
without spinning, and a full admission queue refuses with 429."""
from __future__ import annotations

import threading
import time

import pytest

from mstar.runtime.serve.api import LLM, SamplingParams
from mstar.runtime.serve.engine_setup import build_engine, load
from serve_harness import LLAMA, Gate, make_service, running, wait_until

openai = pytest.importorskip("openai")


def _stream_ids(client, prompt, max_tokens):
    stream = client.completions.create(model="llama", prompt=prompt, max_tokens=max_tokens, stream=True)
    return [t for chunk in stream if chunk.choices for t in chunk.choices[0].model_extra["token_ids"]]


def test_a_disconnected_stream_frees_its_pages_and_the_others_finish_unchanged():
    llm = LLM(LLAMA)
    service = make_service(llm)
    prompts = [[1, 30, 31, 32], [1, 40, 41]]
    expected = [o.token_ids for o in llm.generate(prompts, SamplingParams(max_tokens=24))]
    start = llm.engine.kv_pages()
    assert all(in_use == 0 for in_use, _ in start.values())
    with running(service) as url:
        client = openai.OpenAI(base_url=url, api_key="none", max_retries=0)
        leaving = client.completions.create(model="llama", prompt=[1, 50, 51, 52, 53], max_tokens=2000, stream=True)
        chunks = iter(leaving)
        next(chunks)
        next(chunks)  # it is decoding now
        results: list = [None, None]

        def run(index):
            results[index] = _stream_ids(client, prompts[index], 24)

        threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
        for thread in threads:
            thread.start()
        assert wait_until(lambda: llm.loop.num_running == 3)
        assert any(in_use > 0 for in_use, _ in llm.engine.kv_pages().values())
        leaving.close()  # the client goes away mid-stream
        for thread in threads:
            thread.join(60)
        assert results == expected
        assert wait_until(lambda: llm.loop.num_in_flight == 0)
        assert llm.engine.kv_pages() == start
        outcomes = {s.labels["outcome"]: s.value for s in service.metrics.requests.collect()[0].samples
                    if s.name.endswith("_total")}
        assert outcomes.get("cancelled") == 1 and outcomes.get("length") == 4  # 2 here, 2 for `expected`


def test_the_loop_idles_without_spinning():
    plan = load(LLAMA)
    llm = LLM(plan, engine="sim", sim_pace=0)
    calls = []
    admit = llm.loop.admit
    llm.loop.admit = lambda conductor, now: (calls.append(now), admit(conductor, now))[1]  # type: ignore
    try:
        llm.generate([[1, 2, 3]], SamplingParams(max_tokens=4))
        before = len(calls)
        time.sleep(0.5)
        assert len(calls) - before <= 1  # blocked on the inbox, not polling
        assert llm.generate([[1, 2, 3]], SamplingParams(max_tokens=4))[0].finish_reason == "length"
    finally:
        llm.close(5)


def test_a_full_admission_queue_refuses_with_429():
    plan = load(LLAMA)
    plan = plan.model_copy(update={"deployment": plan.deployment.model_copy(update={"max_concurrent_requests": 1})})
    gate = Gate(build_engine(plan, "sim", sim_pace=0), limit=1)
    llm = LLM(plan, engine=gate, max_waiting=1)
    service = make_service(llm)
    with running(service) as url:
        client = openai.OpenAI(base_url=url, api_key="none", max_retries=0)
        answers: list = []
        threads = [threading.Thread(target=lambda: answers.append(
            client.completions.create(model="llama", prompt=[1, 2], max_tokens=3))) for _ in range(2)]
        for thread in threads:
            thread.start()
        assert gate.reached.wait(10) and wait_until(lambda: llm.loop.num_in_flight == 2)
        with pytest.raises(openai.RateLimitError) as caught:
            client.completions.create(model="llama", prompt=[1, 2], max_tokens=3)
        assert "retry later" in caught.value.message
        gate.release()
        for thread in threads:
            thread.join(30)
        assert [a.choices[0].finish_reason for a in answers] == ["length", "length"]
        assert client.completions.create(model="llama", prompt=[1, 2], max_tokens=3).usage.completion_tokens == 3


def test_cancelling_a_waiting_request_and_a_refused_one_end_them_alone():
    """A request cancelled while it waits for admission ends at the next step boundary without
    ever reaching the engine; one the engine refuses at admission ends with the reason; the
    running request is untouched."""
    plan = load(LLAMA)
    plan = plan.model_copy(update={"deployment": plan.deployment.model_copy(update={"max_concurrent_requests": 1})})
    gate = Gate(build_engine(plan, "sim", sim_pace=0, kv_pages=4), limit=2)
    added: list = []
    add_request = gate.add_request
    gate.add_request = lambda request_id, spec: (added.append(request_id), add_request(request_id, spec))[1]
    llm = LLM(plan, engine=gate)
    try:
        finals: list = []
        done = threading.Event()

        def deliver(delta):
            if delta.is_final:
                finals.append(delta)
                if len(finals) == 3:
                    done.set()

        running_one = llm.request([1, 2, 3], SamplingParams(max_tokens=5))
        waiting = llm.request([1, 2, 3], SamplingParams(max_tokens=5))
        too_big = llm.request([1] * 40, SamplingParams(max_tokens=40))  # 80 tokens: 5 pages of 16 > 4
        for request in (running_one, waiting, too_big):
            llm.loop.submit(request, deliver)
        assert gate.reached.wait(10) and llm.loop.num_waiting == 2  # the driver is inside a step
        llm.loop.cancel(waiting.id)
        gate.release()
        assert done.wait(10)
        by_id = {d.request_id: d for d in finals}
        assert finals[0].request_id == waiting.id and by_id[waiting.id].finish_reason == "cancelled"
        assert waiting.id not in added  # never admitted
        assert by_id[running_one.id].finish_reason == "length" and by_id[running_one.id].num_output_tokens == 5
        assert by_id[too_big.id].is_refused and "can never fit" in by_id[too_big.id].finish_reason
        assert llm.loop.num_in_flight == 0 and llm.engine.kv_pages() == {"LLM": (0, 4)}
    finally:
        llm.close(5)


def test_queue_depth_counts_waiting_requests_not_cancels_in_the_inbox():
    """`mstar_queue_depth` read the inbox's length, cancel messages and all: with one request
    running and two waiting, a cancel sent while the driver was inside a step made it 3 until the
    next step boundary. It counts the requests waiting for admission alone."""
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    plan = load(LLAMA)
    plan = plan.model_copy(update={"deployment": plan.deployment.model_copy(update={"max_concurrent_requests": 1})})
    gate = Gate(build_engine(plan, "sim", sim_pace=0), limit=1)
    llm = LLM(plan, engine=gate)

    def queue_depth(url):
        with urllib.request.urlopen(url.replace("/v1", "/metrics")) as response:
            text = response.read().decode()
        return next(s.value for f in text_string_to_metric_families(text) for s in f.samples
                    if s.name == "mstar_queue_depth")

    with running(make_service(llm)) as url:
        requests = [llm.request([1, 2, 3], SamplingParams(max_tokens=5)) for _ in range(3)]
        finals: list = []
        for request in requests:
            llm.loop.submit(request, lambda delta: finals.append(delta) if delta.is_final else None)
        assert gate.reached.wait(10)  # the first runs; the driver is inside a step, the others wait
        try:
            assert queue_depth(url) == 2
            llm.loop.cancel(requests[0].id)
            llm.loop.cancel(requests[1].id)
            assert queue_depth(url) == 2  # the cancels are in the inbox, not yet taken
        finally:
            gate.release()
        assert wait_until(lambda: len(finals) == 3)
        assert queue_depth(url) == 0
        assert sorted(d.finish_reason for d in finals) == ["cancelled", "cancelled", "length"]
