"""A client that leaves before its answer cancels its request: one waiting for a whole
(non-streaming) answer, and one still waiting for its first output (streaming or not). Before,
such a request ran to its max_tokens for nobody, holding its pages. And a text prompt is
tokenized off the event loop's thread, so a long one does not hold the other clients up."""
from __future__ import annotations

import http.client
import json
import socket
import threading

import pytest

from mstar.plan.io import load_plan
from mstar.runtime.serve.api import LLM
from mstar.runtime.serve.engine_setup import build_engine
from serve_harness import LLAMA, Gate, make_service, running, wait_until, write_tokenizer

MAX_TOKENS = 2000


def _leave_after(url: str, body: dict, gate: Gate) -> None:
    """Send `body`, wait until the engine is held at its gate (the request is in flight and cannot
    have ended), then close the connection without reading an answer."""
    host, port = url.removeprefix("http://").removesuffix("/v1").split(":")
    connection = http.client.HTTPConnection(host, int(port), timeout=30)
    path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    connection.request("POST", path, body=json.dumps(body), headers={"Content-Type": "application/json"})
    assert gate.reached.wait(10)
    connection.sock.shutdown(socket.SHUT_RDWR)
    connection.close()


def _outcomes(service) -> dict:
    return {s.labels["outcome"]: s.value for s in service.metrics.requests.collect()[0].samples
            if s.name.endswith("_total")}


@pytest.mark.parametrize("held_at_step, is_stream", [(3, False), (0, False), (0, True)],
                         ids=["whole_answer", "first_output", "first_output_streaming"])
def test_a_client_that_leaves_cancels_its_request(held_at_step, is_stream):
    plan = load_plan(LLAMA)
    gate = Gate(build_engine(plan, "sim", sim_pace=0), limit=held_at_step)
    llm = LLM(plan, engine=gate)
    service = make_service(llm)
    start = gate.kv_pages()
    with running(service) as url:
        body = {"model": "llama", "prompt": [1, 2, 3], "max_tokens": MAX_TOKENS, "stream": is_stream}
        _leave_after(url, body, gate)
        # the cancellation is in the loop's inbox before the engine goes on
        assert wait_until(lambda: llm.loop.num_in_flight == 0 or len(llm.loop._inbox) > 0)
        gate.release()
        assert wait_until(lambda: llm.loop.num_in_flight == 0)
        assert gate.num_steps < MAX_TOKENS  # it did not run to its end
        assert gate.kv_pages() == start
        assert _outcomes(service) == {"cancelled": 1}


def test_a_text_prompt_is_tokenized_off_the_event_loops_thread(tmp_path):
    plan = load_plan(LLAMA)
    llm = LLM(plan, engine="sim", sim_pace=0, tokenizer=str(write_tokenizer(tmp_path / "tok")))
    service = make_service(llm)
    threads: dict[str, int] = {}
    check_model, prompt_tokens = service.check_model, llm.prompt_tokens

    def checked(model):  # a handler's first call: on the event loop's thread
        threads["handler"] = threading.get_ident()
        return check_model(model)

    def tokenized(prompt):
        threads["tokenizer"] = threading.get_ident()
        return prompt_tokens(prompt)

    service.check_model, llm.prompt_tokens = checked, tokenized  # type: ignore[method-assign]
    with running(service) as url:
        import urllib.request

        body = json.dumps({"model": "llama", "prompt": "the cat sat", "max_tokens": 2}).encode()
        request = urllib.request.Request(f"{url}/completions", method="POST", data=body,
                                         headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=30) as answer:
            assert json.loads(answer.read())["usage"]["completion_tokens"] == 2
    assert threads["tokenizer"] != threads["handler"]
