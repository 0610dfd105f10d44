"""A request that fails mid-run on its own input (a runner's `values.RequestInputError`, flagged
`RowResult.is_input_fault`) is the client's fault: a 400 `invalid_request_error`, or that type in
a stream's error event, counted once as `invalid`; any other failure of a row stays a 500
`server_error`. The runners' flag is tested on real runners (tests/engine/test_node_kinds.py);
here an engine wrapper fails the rows of chosen prompts as a runner would."""
from __future__ import annotations

import json
import urllib.request

import pytest

from mstar.runtime.serve.api import LLM
from mstar.runtime.step import RowResult
from serve_harness import LLAMA, Gate, make_service, running, write_tokenizer

openai = pytest.importorskip("openai")
OWN_INPUT, OTHER_FAULT = 30, 31  # a prompt's first token chooses how its rows fail


class FailingRows(Gate):
    """The rows of a request whose prompt starts with OWN_INPUT fail as a request's bad audio
    would; those starting with OTHER_FAULT as a value another node passed would."""

    def __init__(self, inner):
        super().__init__(inner)
        self.first_tokens: dict[str, int] = {}

    def add_request(self, request_id, spec):
        self.first_tokens[request_id] = spec.prompt_tokens[0]
        return super().add_request(request_id, spec)

    def wait(self, handle):
        result = super().wait(handle)
        for index, row in enumerate(result.rows):
            first = self.first_tokens.get(row.request_id)
            if first in (OWN_INPUT, OTHER_FAULT):
                result.rows[index] = RowResult(row.request_id, error="node LLM: the input cannot be taken",
                                               is_input_fault=first == OWN_INPUT)
        return result


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    from mstar.runtime.serve.engine_setup import build_engine, load

    plan = load(LLAMA)
    llm = LLM(plan, engine=FailingRows(build_engine(plan, "torch")),
              tokenizer=str(write_tokenizer(tmp_path_factory.mktemp("tok"))))
    service = make_service(llm)
    with running(service) as url:
        yield service, url, openai.OpenAI(base_url=url, api_key="none", max_retries=0)


def _outcomes(service) -> dict[str, float]:
    return {s.labels["outcome"]: s.value for s in service.metrics.requests.collect()[0].samples
            if s.name.endswith("_total")}


def test_a_request_failed_by_its_own_input_is_a_400_and_another_failure_a_500(served):
    service, _, client = served
    before = _outcomes(service)
    with pytest.raises(openai.BadRequestError) as bad:
        client.completions.create(model="llama", prompt=[OWN_INPUT, 9, 10], max_tokens=4)
    assert bad.value.status_code == 400 and "the input cannot be taken" in bad.value.message
    assert bad.value.body["type"] == "invalid_request_error"
    with pytest.raises(openai.InternalServerError) as internal:
        client.completions.create(model="llama", prompt=[OTHER_FAULT, 9, 10], max_tokens=4)
    assert internal.value.status_code == 500 and internal.value.body["type"] == "server_error"
    answer = client.completions.create(model="llama", prompt=[1, 9, 10], max_tokens=4)  # the others go on
    assert answer.choices[0].finish_reason == "length"
    after = _outcomes(service)
    assert after.get("invalid", 0) - before.get("invalid", 0) == 1  # counted once, not also as `error`
    assert after.get("error", 0) - before.get("error", 0) == 1


@pytest.mark.parametrize("first, kind", [(OWN_INPUT, "invalid_request_error"), (OTHER_FAULT, "server_error")])
def test_a_streamed_request_ends_with_the_error_type_of_its_cause(served, first, kind):
    _, url, _ = served
    body = json.dumps({"model": "llama", "prompt": [first, 9, 10], "max_tokens": 4, "stream": True}).encode()
    request = urllib.request.Request(f"{url}/completions", body, {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=30) as response:
        events = [line[len("data: "):] for line in response.read().decode().splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    error = json.loads(events[-2])["error"]
    assert error["type"] == kind and "the input cannot be taken" in error["message"]
