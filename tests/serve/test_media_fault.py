"""A request's own media of a shape the stateless stand-in encoder cannot take (Qwen3-Omni's audio
feature frames 7 wide where the tiny dims take 16, one frame of 10 values, a 3-D array) is the
client's fault: the torch engine refuses the request when it arrives (`EncoderRunner.media_refusal`;
it failed at its encoder step, flagged `is_input_fault`), and the server answers it 400
`invalid_request_error`, counted once as `refused`; the requests beside it finish. Before that it
was a plain `InputError` (the deployment's fault): the Python API's delta unflagged and the server's 500.
Which inputs hold the request's own media is the plan's to say (`CallInfo.request_inputs`,
tests/engine/test_node_kinds.py has the plan where another node's value feeds the input)."""
from __future__ import annotations

import asyncio
import json
import threading
from typing import Any

import numpy as np
import pytest
from fastapi import Request as HttpRequest
from fastapi.responses import JSONResponse

from mstar import LLM, SamplingParams
from mstar.runtime.serve.http_app import build_app, collect
from serve_harness import ROOT, make_service, post_json, running

OMNI = str(ROOT / "generated" / "qwen3_omni.plan")
AUDIO_ROUTE = {"Thinker": ["prefill_text", "prefill_audio", "thinker_decode"]}  # the route that takes audio
BAD_SHAPES = [(10, 7), (10,), (2, 3, 16)]
SAYS = {shape: f"the request's audio media (shape {list(shape)}) are not features this encoder takes: give a float "
               "array [n, 16] of n <= 4096 feature rows" for shape in BAD_SHAPES}


def _request(llm: LLM, shape: tuple[int, ...]) -> Any:
    audio = np.zeros(shape, dtype=np.float32)
    return llm.request([5, 6, 7], SamplingParams(max_tokens=4, route=AUDIO_ROUTE), media={"audio": audio})


def test_bad_media_fails_its_request_alone_flagged_as_the_clients_through_the_python_api():
    with LLM(OMNI, engine="torch") as llm:
        shapes = [(10, 16)] + BAD_SHAPES + [(12, 16)]
        outputs = llm.generate([_request(llm, shape) for shape in shapes])
        assert outputs[0].finish_reason == outputs[-1].finish_reason == "length"  # the others finish
        for shape, output in zip(BAD_SHAPES, outputs[1:-1]):
            reason = output.finish_reason
            assert reason.startswith("error: cannot run: node audio_encoder: ") and SAYS[shape] in reason

        async def last_deltas():
            async def last(request):
                return [delta async for delta in llm.stream(request)][-1]
            return await asyncio.gather(*(last(_request(llm, shape)) for shape in [(10, 16)] + BAD_SHAPES))

        good, *bad = asyncio.run(last_deltas())
        assert good.finish_reason == "length" and not good.is_input_fault
        # refused when it arrives (it failed at its encoder step, flagged is_input_fault)
        assert all(delta.finish_reason.startswith("error: cannot run: ") and not delta.is_input_fault for delta in bad)


@pytest.fixture(scope="module")
def served():
    """A server of Qwen3-Omni on the torch engine. No endpoint carries audio feature frames (the
    transcription endpoint takes a waveform), so the app gets one more route, as the others build
    a request: the body's prompt and `audio` (nested lists) on the audio route, submitted to the
    server's run loop and collected by its `collect`, which answers a request failed on its own
    input 400 and any other failure 500."""
    llm = LLM(OMNI, engine="torch")
    service = make_service(llm)
    app = build_app(service)

    @app.post("/v1/test/audio_completions")
    async def audio_completions(http: HttpRequest) -> JSONResponse:
        body = await http.json()
        sampling = SamplingParams(max_tokens=body["max_tokens"], route=AUDIO_ROUTE)
        request = await service.request(body["prompt"], sampling, media={"audio": np.asarray(body["audio"],
                                                                                             dtype=np.float32)})
        stream, first = await service.start(request)
        deltas = await collect(stream, first)
        return JSONResponse({"finish_reason": deltas[-1].finish_reason,
                             "tokens": [t for d in deltas for t in d.token_ids]})

    with running(service, app) as url:
        yield service, url


def _outcomes(service) -> dict[str, float]:
    return {s.labels["outcome"]: s.value for s in service.metrics.requests.collect()[0].samples
            if s.name.endswith("_total")}


def test_bad_media_is_a_400_through_the_server_and_the_requests_beside_it_finish(served):
    service, url = served
    before = _outcomes(service)
    bodies = [{"prompt": [5, 6, 7], "max_tokens": 4, "audio": np.zeros(shape).tolist()}
              for shape in [(10, 16)] + BAD_SHAPES + [(12, 16)]]
    answers: list[Any] = [None] * (len(bodies) + 1)

    def post(index: int) -> None:
        if index == len(bodies):  # a text completion beside them, through the ordinary endpoint
            body = {"model": "qwen3_omni", "prompt": [5, 6, 7], "max_tokens": 4}
            answers[index] = post_json(f"{url}/completions", json.dumps(body).encode())
        else:
            answers[index] = post_json(f"{url}/test/audio_completions", json.dumps(bodies[index]).encode())

    threads = [threading.Thread(target=post, args=(index,)) for index in range(len(answers))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    (first, *bad, last, text) = answers
    assert first[0] == 200 and first[1]["finish_reason"] == "length" and len(first[1]["tokens"]) == 4
    assert last[0] == 200 and last[1]["finish_reason"] == "length"
    assert text[0] == 200 and text[1]["choices"][0]["finish_reason"] == "length"
    for shape, (status, error) in zip(BAD_SHAPES, bad):
        assert status == 400 and error["type"] == "invalid_request_error", (status, error)
        assert error["message"].startswith("cannot run: node audio_encoder: ") and SAYS[shape] in error["message"]
    after = _outcomes(service)
    # refused at admission, counted once each as `refused` (they failed mid-run, counted `invalid`)
    assert after.get("refused", 0) - before.get("refused", 0) == len(BAD_SHAPES)
    assert after.get("error", 0) == before.get("error", 0) and after.get("invalid", 0) == before.get("invalid", 0)
