"""The Python API under bad or careless use: a value of the wrong kind is a PromptError or
SamplingError before anything runs; one request the run loop cannot take (its id already in flight)
fails alone and the loop goes on; a request whose top_k passes any vocabulary runs beside the others
(it failed its whole step); `generate` that raises (Closed, an interrupt) leaves nothing
running; `close(timeout)` frees the pages of the requests it cuts; a plan whose default route takes
the request's audio refuses a request without it. Each of these once stopped the run loop for
every later call, hung a caller, or held KV pages."""
from __future__ import annotations

import asyncio
import itertools
import re
import threading
from pathlib import Path

import numpy as np
import pytest
import torch

from mstar import LLM, SamplingParams
from mstar.runtime.conductor.request import Request
from mstar.runtime.engine.sampling import SamplingError as EngineSamplingError
from mstar.runtime.engine.sampling import SamplingParams as EngineSampling
from mstar.runtime.serve.api import Overloaded, PromptError, SamplingError, SetupError
from serve_harness import LLAMA, ROOT, wait_until, write_tokenizer


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    with LLM(LLAMA, tokenizer=str(write_tokenizer(tmp_path_factory.mktemp("tok")))) as llm:
        yield llm


def _idle(llm) -> bool:
    return llm.loop.num_in_flight == 0 and all(in_use == 0 for in_use, _ in llm.engine.kv_pages().values())


@pytest.mark.parametrize("sampling, words", [
    (SamplingParams(stop=[1]), "stop must be a list of non-empty strings"),
    (SamplingParams(stop="the"), "stop must be a list"),
    (SamplingParams(top_k=float("inf")), "top_k must be an integer"),
    (SamplingParams(seed=float("inf")), "seed must be an integer"),
    (SamplingParams(seed=2**64), "seed must be a 64-bit integer"),
    (SamplingParams(max_tokens=True), "max_tokens must be an integer"),
    (SamplingParams(seed=10**5000), r"seed must be a 64-bit integer, got 1000.*\(5001 digits\)"),  # ValueError
    (SamplingParams(temperature=-10**5000), r"temperature must be a finite number, got -1000.*\(5001 digits\)"),
    (SamplingParams(max_tokens=4, min_tokens=10**5000), r"min_tokens must be in \[0, max_tokens \(4\)\]"),
    (SamplingParams(temperature="0.5"), "temperature must be a number"),
    (SamplingParams(stop_token_ids=[1.5]), "stop_token_ids"),
    (SamplingParams(route={"LLM": "prefill"}), "route must map partition names to lists of walk names"),
    (SamplingParams(guidance={"x": float("nan")}), "guidance"),
    (SamplingParams(guidance={"x": -1.0}), "guidance"),  # the torch engine refused it, the sim ran it
])
def test_a_sampling_value_of_the_wrong_kind_is_refused_before_it_runs(llm, sampling, words):
    with pytest.raises(SamplingError, match=words):
        llm.generate([1, 2], sampling)
    assert llm.generate([1, 2], SamplingParams(max_tokens=2))[0].finish_reason == "length"  # the loop lives
    with pytest.raises(SamplingError, match="sampling must be a SamplingParams"):
        llm.generate([1, 2], {"max_tokens": 3})


@pytest.mark.parametrize("prompts, words", [(None, "prompts must be"), (5, "prompts must be"),
                                            (b"hi", "prompts must be"), ([[1, True]], "non-negative integers"),
                                            ([1.0, 2.0], "a list of token ids")])
def test_a_prompt_of_the_wrong_kind_is_a_prompt_error(llm, prompts, words):
    with pytest.raises(PromptError, match=words):
        llm.generate(prompts)


def test_numpy_and_torch_token_ids_are_prompts(llm):
    expected = llm.generate([1, 2, 3], SamplingParams(max_tokens=3))[0].token_ids
    for prompt in (np.array([1, 2, 3]), torch.tensor([1, 2, 3]), [np.int64(1), 2, 3]):
        assert llm.generate(prompt, SamplingParams(max_tokens=3))[0].token_ids == expected


def test_a_top_k_past_any_vocabulary_runs_beside_the_others(llm):
    prompts = [[1, 2 + i] for i in range(4)]
    alone = [o.token_ids for o in llm.generate(prompts, SamplingParams(max_tokens=6, temperature=0.8, seed=3))]
    bad = llm.request([1, 9], SamplingParams(max_tokens=6, temperature=0.8, top_k=10**30))
    outputs = llm.generate(prompts + [bad], SamplingParams(max_tokens=6, temperature=0.8, seed=3))
    assert [o.finish_reason for o in outputs] == ["length"] * 5
    assert [o.token_ids for o in outputs[:4]] == alone
    assert EngineSampling.from_request({"top_k": 10**30}).top_k == 2**31 - 1
    with pytest.raises(EngineSamplingError, match="seed must be an integer"):
        EngineSampling.from_request({"seed": "abc"})


def test_one_request_streamed_twice_refuses_the_second_alone(llm):
    request = llm.request([1, 2, 3], SamplingParams(max_tokens=20))

    async def one():
        return [delta async for delta in llm.stream(request)]

    async def both():
        return await asyncio.gather(one(), one(), return_exceptions=True)

    first, second = asyncio.run(both())
    assert first[-1].finish_reason == "length"
    assert isinstance(second, PromptError) and "already given to this LLM" in str(second)
    assert llm.loop.error is None and wait_until(lambda: _idle(llm))


def test_a_request_with_an_id_in_flight_fails_alone(llm):
    """A Request built by hand with the id of one in flight (the LLM cannot know it): the run loop
    fails it alone and goes on."""
    first = Request(id="mine", prompt_tokens=[1, 2, 3], max_tokens=20)
    twin = Request(id=first.id, prompt_tokens=[1, 2, 3], max_tokens=20)
    outputs = llm.generate([first, twin])
    assert {o.finish_reason for o in outputs} == {"length", f"error: request id {first.id!r} is already in flight"}
    assert llm.loop.error is None and wait_until(lambda: _idle(llm))
    # given again at once, the id's tombstone still in force: a clear error (its rows were dropped
    # as the ended request's, and it stalled); once the loop has moved on, the id is free again
    again = llm.generate(Request(id="mine", prompt_tokens=[1, 2, 3], max_tokens=3))[0].finish_reason
    assert again in ("length", "error: request id 'mine' belongs to a request that has just ended; give each "
                               "request an id of its own (llm.request(...) makes one)"), again


def test_ids_of_the_form_llm_request_gives_are_its_own(llm):
    """A copy of a request `llm.request` made, or a hand-built one with an id it hands out later:
    its run stalled, and so did the later plain generate() that got that id."""
    import copy

    made = llm.request([1, 2, 3], SamplingParams(max_tokens=3))
    assert llm.generate(made)[0].finish_reason == "length"
    for twin in (copy.copy(made), Request(id=f"req-{int(made.id.split('-')[1]) + 1}", prompt_tokens=[1], max_tokens=2)):
        with pytest.raises(PromptError, match=r"is of the form llm.request\(...\) gives its own requests"):
            llm.generate(twin)
    assert llm.generate([1, 2, 3], SamplingParams(max_tokens=3))[0].finish_reason == "length"


@pytest.mark.parametrize("fields, error, words", [
    ({"prompt_tokens": None}, PromptError, "prompt_tokens must be a non-empty list of token ids"),
    ({"prompt_tokens": [1.5, 2.0]}, PromptError, "prompt_tokens must be a non-empty list of token ids"),
    ({"id": 12345}, PromptError, "a request's id must be a non-empty string"),
    ({"route": None}, SamplingError, "route must map partition names to lists of walk names"),
    ({"max_tokens": None}, SamplingError, "max_tokens must be >= 1"),
    ({"temperature": float("nan")}, SamplingError, "temperature must be a finite number"),
    ({"top_p": 0.0}, SamplingError, "top_p must be in (0, 1]"),
    ({"logit_bias": [(5, 1.0, 2)]}, SamplingError, "logit_bias must be (token id, bias) pairs"),
    ({"prompt_tokens": [10**6]}, PromptError, "is outside the vocabulary"),
])
def test_a_request_built_by_hand_is_checked_as_the_apis_own(llm, fields, error, words):
    """A bad field of a hand-built Request reached the run loop: `prompt_tokens=None` left the batch
    waiting for ever (the loop died answering it), `route=None` failed every request in flight and
    closed the LLM, `id=12345` and `max_tokens=None` failed the good requests of its step."""
    bad = Request(**{"id": "hand", "prompt_tokens": [1, 2], "max_tokens": 4, **fields})
    with pytest.raises(error, match=re.escape(words)):
        llm.generate([[1, 2, 3], bad])
    with pytest.raises(error, match=re.escape(words)):
        asyncio.run(anext(llm.stream(bad)))
    assert llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2))[0].finish_reason == "length"
    assert llm.loop.error is None and wait_until(lambda: _idle(llm))


def test_a_route_of_the_wrong_kind_fails_alone_in_the_conductor(llm):
    """Past the API's checks (a Request changed after them), the conductor refuses it alone: it
    failed the run loop and every request in flight."""
    good = llm.request([1, 2, 3], SamplingParams(max_tokens=6))
    bad = llm.request([4, 5], SamplingParams(max_tokens=6))
    llm._check_given = lambda request: None  # as if the checks had passed
    bad.route = None
    outputs = llm.generate([good, bad])
    assert outputs[0].finish_reason == "length"
    assert outputs[1].finish_reason.startswith("error: the request's route cannot be read (TypeError")
    del llm._check_given
    assert llm.loop.error is None and wait_until(lambda: _idle(llm))


def test_a_finished_request_given_again_is_refused(llm):
    request = llm.request([1, 2], SamplingParams(max_tokens=3))
    assert llm.generate(request)[0].finish_reason == "length"
    with pytest.raises(PromptError, match=f"request id {request.id!r} was already given to this LLM"):
        llm.generate(request)
    with pytest.raises(PromptError, match="already given"):
        asyncio.run(anext(llm.stream(request)))
    again = llm.request([1, 2], SamplingParams(max_tokens=3))
    with pytest.raises(PromptError, match="already given"):  # twice in one batch: refused before anything runs
        llm.generate([again, again])
    assert llm.generate(again)[0].finish_reason == "length"


def test_a_request_made_by_one_llm_runs_on_another():
    """Request ids are unique in the process: one LLM's request did not reuse an id another LLM's
    run loop had spent (it stalled: `error: stalled: no row of the request can run`)."""
    with LLM(LLAMA, engine="sim") as a, LLM(LLAMA, engine="sim") as b:
        b.generate([1, 2, 3])
        assert b.generate(a.request([4, 5, 6], SamplingParams(max_tokens=3)))[0].finish_reason == "length"


def test_generate_that_raises_leaves_nothing_running(monkeypatch):
    with LLM(LLAMA) as llm:
        submit = llm.loop.submit
        calls = itertools.count()

        def interrupted(request, deliver):  # Ctrl-C while the batch is being submitted
            if next(calls) == 3:
                raise KeyboardInterrupt
            submit(request, deliver)

        monkeypatch.setattr(llm.loop, "submit", interrupted)
        with pytest.raises(KeyboardInterrupt):
            llm.generate([[1, 2]] * 5, SamplingParams(max_tokens=2000))
        assert wait_until(lambda: _idle(llm))  # the 3 submitted before the interrupt were cancelled


def test_generate_feeds_a_batch_past_the_queue_as_room_frees():
    """More prompts than max_concurrent_requests + max_waiting: generate waits for room for its
    own requests (it refused them with Overloaded after submitting part of the batch)."""
    with LLM(LLAMA, engine="sim", sim_pace=0) as llm:
        assert llm.loop.max_in_flight is not None and llm.loop.max_in_flight < 2000
        prompts = [[1, 2, 3, i % 500 + 4, i // 500 + 4] for i in range(2000)]
        outputs = llm.generate(prompts, SamplingParams(max_tokens=4))
        assert [o.prompt_token_ids for o in outputs] == prompts
        assert all(o.finish_reason == "length" and len(o.token_ids) == 4 for o in outputs)
        assert wait_until(lambda: _idle(llm))


def test_a_stream_past_the_queue_is_overloaded_while_generate_waits():
    with LLM(LLAMA, engine="sim", sim_pace=1.0, max_waiting=0) as llm:
        cap = llm.plan.deployment.max_concurrent_requests
        outputs: list = []
        worker = threading.Thread(target=lambda: outputs.extend(
            llm.generate([[1, 2]] * (cap + 2), SamplingParams(max_tokens=5))))
        worker.start()
        assert wait_until(lambda: llm.loop.num_in_flight == cap)
        with pytest.raises(Overloaded):
            asyncio.run(anext(llm.stream([1, 2], SamplingParams(max_tokens=2))))
        worker.join(60)
        assert [o.finish_reason for o in outputs] == ["length"] * (cap + 2)


def test_close_with_a_timeout_frees_the_pages_of_what_it_cut():
    llm = LLM(LLAMA)
    engine = llm.engine
    outputs: list = []
    worker = threading.Thread(target=lambda: outputs.extend(llm.generate([1, 2], SamplingParams(max_tokens=2049))))
    worker.start()
    assert wait_until(lambda: any(in_use for in_use, _ in engine.kv_pages().values()))
    llm.close(0.2)
    worker.join(30)
    assert outputs and outputs[0].finish_reason == "error: the LLM stopped before the request finished"
    assert all(in_use == 0 for in_use, _ in engine.kv_pages().values())


def test_close_during_a_step_past_its_grace_frees_the_pages_once_the_step_returns():
    """A step that outlasts close's timeout and grace: close answers the client at once and the
    run loop's thread, once the step returns, ends the request in the conductor (the engine kept
    the request and its pages for good: a concurrency audit)."""
    llm = LLM(LLAMA, engine="sim", sim_pace=100.0)  # a 6,000-token prefill takes seconds of wall time
    engine = llm.engine
    outputs: list = []
    worker = threading.Thread(target=lambda: outputs.extend(llm.generate([7] * 6000, SamplingParams(max_tokens=4))))
    worker.start()
    assert wait_until(lambda: any(in_use for in_use, _ in engine.kv_pages().values()))
    llm.close(0.1)
    worker.join(30)
    assert outputs[0].finish_reason == "error: the LLM stopped while a step was still running"
    llm.loop._thread.join(60)  # the step returns; the thread ends what close cut off
    assert not llm.loop._thread.is_alive()
    assert all(in_use == 0 for in_use, _ in engine.kv_pages().values())
    assert not engine.inner.requests


def test_streams_of_threads_on_their_own_event_loops_register_their_loops_at_once():
    """Each thread's `asyncio.run` is a new event loop: registering one swept the closed loops while
    another thread added its own ("dictionary changed size during iteration", one stream in a few
    thousand; here forced by a loop whose `is_closed` is slow)."""
    import time

    class SlowLoop(asyncio.SelectorEventLoop):
        def is_closed(self):
            time.sleep(0.05)
            return super().is_closed()

    async def one(llm):
        async for _ in llm.stream([1, 2, 3], SamplingParams(max_tokens=1)):
            pass

    with LLM(LLAMA, engine="sim") as llm:
        slow = SlowLoop()
        slow.run_until_complete(one(llm))  # registered, and left open
        errors: list = []

        def run_one():
            try:
                asyncio.run(one(llm))
            except RuntimeError as error:
                errors.append(str(error))

        threads = [threading.Thread(target=run_one) for _ in range(2)]
        threads[0].start()
        time.sleep(0.01)
        threads[1].start()
        for thread in threads:
            thread.join(30)
        slow.close()
        assert errors == []


@pytest.mark.parametrize("plan, prompt", [("whisper", []), ("qwen3_asr", [151676])])  # its audio placeholder
def test_a_plan_that_transcribes_refuses_a_request_without_audio(plan, prompt):
    with LLM(str(ROOT / "generated" / f"{plan}.plan"), engine="sim") as llm:
        with pytest.raises(PromptError, match="default route takes the request's audio"):
            llm.generate([1, 2, 3])
        audio = {"audio": np.zeros(16000, dtype=np.float32)}
        request = llm.request(prompt, SamplingParams(max_tokens=4), media=audio)
        assert not llm.generate(request)[0].finish_reason.startswith("error")


@pytest.mark.parametrize("value, says", [
    (None, "got NoneType"),  # once transcribed seeded noise: the check looked for the key only
    ("speech.wav", "got str (read a WAV file with"),  # once failed its whole step (every request in it)
    (b"RIFF", "got bytes"), ([], "got shape [0]"), (np.float32(0.5), "got shape []"),
    (np.zeros((2, 8000), dtype=np.float32), "a 1-D array; got shape [2, 8000]"),
    (np.zeros(16000, dtype=np.int16), "samples as floats in [-1, 1], got int16"),
    ([0.0, float("nan")], "not a finite number"), ([True, False], "got bool"), ([{"a": 1}], "not an array"),
])
@pytest.mark.parametrize("plan, prompt", [("whisper", []), ("qwen3_asr", [151676])])
def test_a_media_value_the_request_cannot_carry_is_refused_before_it_runs(plan, prompt, value, says):
    with LLM(str(ROOT / "generated" / f"{plan}.plan"), engine="sim") as llm:
        with pytest.raises(PromptError, match=re.escape(says)) as refused:
            llm.request(prompt, SamplingParams(max_tokens=4), media={"audio": value})
        assert refused.value.param == "media"
        with pytest.raises(PromptError, match="media 'image': this plan takes no such prompt media"):
            llm.request(prompt, SamplingParams(max_tokens=4), media={"image": [0.5]})
        # a list of float samples is taken, as a float32 tensor
        taken = llm.request(prompt, SamplingParams(max_tokens=4), media={"audio": [0.0] * 1600})
        assert taken.media["audio"].dtype == torch.float32 and tuple(taken.media["audio"].shape) == (1600,)
        mono = llm.request(prompt, SamplingParams(max_tokens=4), media={"audio": torch.zeros(1, 1600)})
        assert tuple(mono.media["audio"].shape) == (1600,)  # torchaudio.load's mono shape


def test_a_bad_media_value_beside_good_requests_fails_nothing_that_ran():
    """On the torch engine a str path among good requests failed the whole step (TypeError)."""
    with LLM(str(ROOT / "generated" / "whisper.plan")) as llm:
        good = [llm.request([], SamplingParams(max_tokens=3), media={"audio": np.zeros(16000, np.float32)})
                for _ in range(2)]
        with pytest.raises(PromptError):
            llm.request([], SamplingParams(max_tokens=3), media={"audio": "speech.wav"})
        assert [o.finish_reason for o in llm.generate(good)] == ["length", "length"]


def test_requests_still_in_the_inbox_when_the_loop_ends_are_answered_and_counted():
    """The run loop gone with requests not yet taken from its inbox: each is answered with the
    reason and counted by the observer once, as the tracked ones are (the metrics' outcome count)."""
    from mstar.runtime.serve.online import Observer, OnlineLoop

    class Counting(Observer):
        def __init__(self):
            self.finished: list[str] = []

        def on_finish(self, finish_reason, is_refused=False, is_input_fault=False):
            self.finished.append(finish_reason)

    with LLM(LLAMA, engine="sim") as llm:
        observer = Counting()
        loop = OnlineLoop(llm.plan, llm.engine, observer=observer)  # never started: requests stay in its inbox
        answers: list = []
        for _ in range(3):
            loop.submit(llm.request([1, 2], SamplingParams(max_tokens=2)), answers.append)
        loop._fail_all("error: stopped")
    assert [a.finish_reason for a in answers] == ["error: stopped"] * 3
    assert observer.finished == ["error: stopped"] * 3 and loop.num_in_flight == 0


@pytest.mark.parametrize("arguments, says", [
    ({"engine": "sim", "seed": 1.5}, "seed must be an integer"),  # gave float token ids
    ({"engine": "sim", "seed": "x"}, "seed must be an integer"),  # failed every request
    ({"engine": "sim", "seed": 2**50}, "within +-2**43"),
    ({"engine": "sim", "sim_pace": float("inf")}, "pace must be a finite number"),  # failed every request
    ({"engine": "sim", "sim_pace": None}, "pace must be a finite number"),
    ({"engine": "sim", "sim_pace": np.float32("inf")}, "pace must be a finite number"),
    ({"engine": "sim", "kv_pages": "5"}, "kv pages must be a positive integer"),
    ({"engine": "sim", "kv_pages": True}, "kv pages must be a positive integer"),
    ({"engine": "sim", "kv_pages": 2.5}, "kv pages must be a positive integer"),  # a pool of 2.5 pages
    ({"engine": "sim", "tokenizer": 5}, "tokenizer must be a directory"),
    ({"engine": "sim", "weights": [None]}, "weights must be a list of checkpoint directories"),
    ({"engine": "sim", "device": "cuda"}, "device: options of the torch engine's model"),
    ({"engine": "sim", "dims": "spec"}, "dims: options of the torch engine's model"),
    ({"engine": "sim", "observer": 5}, "observer must be an mstar.runtime.serve.online.Observer"),
])
def test_a_constructor_argument_of_the_wrong_kind_is_a_setup_error(arguments, says):
    with pytest.raises(SetupError, match=re.escape(says)):
        LLM(LLAMA, **arguments)


@pytest.mark.parametrize("arguments", [
    {"engine": "sim", "kv_pages": -10**4000}, {"engine": "sim", "seed": 10**5000},
    {"engine": "sim", "weights": [10**5000]}, {"engine": "sim", "tokenizer": 10**5000},
])
def test_a_long_constructor_argument_is_echoed_clipped(arguments):
    """kv_pages=-10**4000 was echoed whole (4,000 digits) and a seed past 4,300 digits raised
    Python's int-to-str limit instead of the SetupError."""
    with pytest.raises(SetupError) as refused:
        LLM(LLAMA, **arguments)
    assert len(str(refused.value)) < 200


def test_an_observer_that_raises_is_logged_and_every_request_is_answered(caplog):
    """Its on_step raised on the run loop's thread, which stopped before it answered: generate never
    returned."""
    from mstar.runtime.serve.online import Observer

    class Raising(Observer):
        def on_step(self, key, mixture):
            raise RuntimeError("metrics store gone")

        def on_finish(self, finish_reason, is_refused=False, is_input_fault=False):
            raise RuntimeError("metrics store gone")

    with LLM(LLAMA, engine="sim", observer=Raising()) as llm:
        outputs = llm.generate([[1, 2, 3], [4, 5]], SamplingParams(max_tokens=4))
    assert [o.finish_reason for o in outputs] == ["length", "length"]
    raised = [r.getMessage() for r in caplog.records if "observer's" in r.getMessage()]
    assert len(raised) == 2 and all("metrics store gone" in m for m in raised)  # once a hook


def test_a_route_leaving_every_partition_out_and_a_set_of_prompts_are_refused():
    """The route ran nothing and ended `stop` with no output (mstar run refused it); a set has no
    order, so its outputs' order was undefined."""
    with LLM(LLAMA, engine="sim") as llm:
        with pytest.raises(SamplingError, match="route leaves every partition out") as refused:
            llm.generate([[1, 2, 3]], SamplingParams(route={"LLM": []}))
        assert refused.value.param == "route"
        with pytest.raises(PromptError, match="prompts must be a list .* got a set"):
            llm.generate({(1, 2), (3, 4)})
    with LLM(str(Path(LLAMA).parent / "qwen3_omni.plan"), engine="sim") as llm:  # Talker, Code2Wav: from streams
        with pytest.raises(SamplingError, match=r"every partition a request starts \(Thinker; Code2Wav, Talker start"):
            llm.generate([[1, 2, 3]], SamplingParams(route={"Thinker": []}))


def test_a_route_is_checked_for_the_media_it_takes_and_the_media_given():
    """A route given switched the missing-media check off (Whisper transcribed noise again; Qwen3-Omni's
    vision walk ran on seeded features), and media the route takes nowhere were dropped silently."""
    with LLM(str(ROOT / "generated" / "whisper.plan"), engine="sim") as llm:
        route = {"ASR": ["prefill", "decode"]}
        with pytest.raises(PromptError, match="this plan's route takes the request's audio") as refused:
            llm.request([50258], SamplingParams(max_tokens=4, route=route))
        assert refused.value.param == "media"
    omni = str(ROOT / "generated" / "qwen3_omni.plan")
    with LLM(omni, engine="sim") as llm:
        vision = {"Thinker": ["prefill_text", "prefill_vision", "thinker_decode"]}
        with pytest.raises(PromptError, match="route takes the request's image"):
            llm.request([5, 6, 7], SamplingParams(max_tokens=4, route=vision))
        frames = np.zeros((20, 16), dtype=np.float32)
        with pytest.raises(PromptError, match="default route takes no audio, which it brings"):
            llm.request([5, 6, 7], SamplingParams(max_tokens=4), media={"audio": frames})
        audio = {"Thinker": ["prefill_text", "prefill_audio", "thinker_decode"]}
        llm.request([5, 6, 7], SamplingParams(max_tokens=4, route=audio), media={"audio": frames})  # taken


@pytest.mark.parametrize("value, says", [
    (np.full(1600, 1e300), "not a finite number"),  # finite in float64, inf once the engines read float32
    (np.full(1600, 1e20, dtype=np.float32), "one is 1e+20"),  # its log-mel energies overflowed to NaN
    (torch.zeros(1600).to_sparse(), "a sparse tensor"),  # a NotImplementedError from the finite check
])
def test_waveform_values_past_full_scale_or_not_dense_are_refused(value, says):
    with LLM(str(ROOT / "generated" / "whisper.plan"), engine="sim") as llm:
        with pytest.raises(PromptError, match=re.escape(says)):
            llm.request([], SamplingParams(max_tokens=4), media={"audio": value})
        peak = np.full(1600, 1.5, dtype=np.float32)  # a float WAV may peak a little past full scale
        assert llm.request([], SamplingParams(max_tokens=4), media={"audio": peak}).media["audio"].shape[0] == 1600


def test_a_float_wav_far_past_full_scale_is_refused():
    """Samples of 1e30 passed the NaN-and-infinity check and transcribed as nothing, HTTP 200."""
    import struct

    from mstar.runtime.serve.wav import WavError, decode_wav

    def float_wav(samples) -> bytes:
        data = np.asarray(samples, dtype=np.float32).tobytes()
        fmt = struct.pack("<HHIIHH", 3, 1, 16000, 64000, 4, 32)
        return (b"RIFF" + struct.pack("<I", 4 + 8 + len(fmt) + 8 + len(data)) + b"WAVE" + b"fmt "
                + struct.pack("<I", len(fmt)) + fmt + b"data" + struct.pack("<I", len(data)) + data)

    with pytest.raises(WavError, match="float samples reach 1e\\+30"):
        decode_wav(float_wav([0.0, 1e30]), "upload x.wav")
    assert decode_wav(float_wav([0.0, 1.2, -1.5]), "upload x.wav").shape[0] == 3
