"""The Python API's life cycle: a stream closed early (contextlib.aclosing) cancels its request and
frees its KV pages at once, while the generator is still referenced; the documented errors import
from `mstar`; an LLM dropped without close() ends its run loop's thread; bad constructor arguments
are a SetupError."""
from __future__ import annotations

import asyncio
import contextlib
import gc

import pytest

import mstar
from mstar import LLM, SamplingParams
from mstar.runtime.serve import api, engine_setup, online
from mstar.runtime.serve.online import Observer
from serve_harness import LLAMA, wait_until, write_tokenizer


class Endings(Observer):
    def __init__(self):
        self.reasons: list[str] = []

    def on_finish(self, finish_reason, is_refused=False, is_input_fault=False):
        self.reasons.append(finish_reason)


def _pages_in_use(llm) -> int:
    return sum(in_use for in_use, _ in llm.engine.kv_pages().values())


def test_a_stream_closed_early_cancels_at_once_while_still_referenced():
    endings = Endings()
    with LLM(LLAMA, engine="sim", sim_pace=1.0, observer=endings) as llm:
        async def leave_after_two():
            seen = 0
            async with contextlib.aclosing(llm.stream([1] * 100, SamplingParams(max_tokens=2000))) as stream:
                async for _ in stream:
                    seen += 1
                    if seen == 2:
                        break
            assert wait_until(lambda: llm.loop.num_in_flight == 0 and _pages_in_use(llm) == 0, 2.0)
            return stream  # still referenced: the cancellation came from aclosing, not collection

        assert asyncio.run(leave_after_two()) is not None
        assert endings.reasons == ["cancelled"]


def test_the_documented_errors_import_from_mstar():
    from mstar import Closed, Overloaded, PromptError, SamplingError, SetupError

    assert (PromptError, SamplingError) == (api.PromptError, api.SamplingError)
    assert (Closed, Overloaded) == (online.Closed, online.Overloaded)
    assert SetupError is engine_setup.SetupError and issubclass(SetupError, ValueError)
    assert {"PromptError", "SamplingError", "Closed", "Overloaded", "SetupError"} <= set(mstar.__all__)


def test_an_llm_dropped_without_close_ends_its_run_loop():
    threads, finalizers = [], []
    for _ in range(3):
        llm = LLM(LLAMA, engine="sim")
        assert llm.generate([1, 2], SamplingParams(max_tokens=2))[0].finish_reason == "length"
        threads.append(llm.loop._thread)
        finalizers.append(llm._finalizer)
        del llm
    gc.collect()
    assert wait_until(lambda: not any(thread.is_alive() for thread in threads), 5.0)
    assert not any(finalizer.alive for finalizer in finalizers)  # nothing left for the interpreter's exit


def test_close_leaves_nothing_for_the_interpreters_exit():
    llm = LLM(LLAMA, engine="sim")
    llm.close()
    assert not llm._finalizer.alive and not llm.loop._thread.is_alive()


@pytest.mark.parametrize("plan, options, words", [
    (LLAMA, {"max_waiting": -1}, "max_waiting must be an integer >= 0, got -1"),
    (LLAMA, {"max_waiting": "x"}, "max_waiting must be an integer >= 0, got 'x'"),
    (LLAMA, {"max_waiting": True}, "max_waiting must be an integer"),
    (LLAMA, {"engine": None}, "engine must be 'torch', 'sim' or an engine object"),
    (None, {"engine": "sim"}, "plan must be a plan file path or a Plan, got NoneType"),
    (3, {"engine": "sim"}, "plan must be a plan file path or a Plan, got int"),
    (LLAMA, {"max_waiting": "w" * 10_000}, r"got 'wwww.*\.\.\. \(10000 characters\)$"),  # clipped, not whole
])
def test_a_bad_constructor_argument_is_a_setup_error(plan, options, words):
    with pytest.raises(mstar.SetupError, match=words):
        LLM(plan, **options)


def test_a_plan_path_may_be_a_path_object():
    from pathlib import Path

    with LLM(Path(LLAMA), engine="sim") as llm:
        assert llm.generate([1, 2], SamplingParams(max_tokens=2))[0].finish_reason == "length"


@pytest.mark.parametrize("timeout_s", [float("nan"), "5", -1, [1]])
def test_a_bad_close_timeout_is_refused_before_anything_closes(timeout_s):
    """nan, "5" and [1] raised from the thread join (ValueError, TypeError) after the LLM had
    stopped taking requests, its run loop left running; -1 was taken as 0."""
    llm = LLM(LLAMA, engine="sim")
    with pytest.raises(ValueError, match="timeout_s must be None or a number of seconds >= 0, got "):
        llm.close(timeout_s)
    assert llm.generate([1, 2], SamplingParams(max_tokens=2))[0].finish_reason == "length"  # still open
    llm.close()


@pytest.mark.parametrize("timeout_s", [float("inf"), 1e300])
def test_a_close_timeout_past_any_wait_waits_for_the_requests(timeout_s):
    """inf and 1e300 overflowed the thread join (OverflowError); each means: wait for them."""
    llm = LLM(LLAMA, engine="sim", sim_pace=0)
    llm.close(timeout_s)
    assert not llm.loop._thread.is_alive() and not llm._finalizer.alive


def test_empty_chat_messages_name_the_field(tmp_path):
    """The server's 400 for `"messages": []` had `param: null`."""
    tokenizer = str(write_tokenizer(tmp_path / "tokenizer"))
    with LLM(LLAMA, engine="sim", tokenizer=tokenizer) as llm, pytest.raises(mstar.PromptError) as refused:
        llm.request({"messages": []}, SamplingParams(max_tokens=2))
    assert refused.value.param == "messages"
