"""A prompt that alone fills one round's sequence of a repeating partition (Whisper's long-form
windows: each round starts a new decoder sequence holding the prompt) is refused by both engines
and by the Python API before it runs. prompt + max_tokens may reach max_seq_len x rounds, so a
448-token Whisper prompt passed the API's check; the torch engine then failed it at admission and
the simulated engine ran it to its max_tokens."""
from __future__ import annotations

import numpy as np
import pytest

from mstar.plan.io import load_plan
from mstar.runtime.conductor.request import Request
from mstar.runtime.engine.sim import SimEngine
from mstar.runtime.engine.torch_engine import TorchEngine
from mstar.runtime.serve.api import LLM, PromptError, SamplingParams
from serve_harness import ROOT

WHISPER = str(ROOT / "generated" / "whisper.plan")
AUDIO = np.zeros(16000, dtype=np.float32)  # one second: one window


def _admits(engine, num_tokens: int):
    request = Request(id="r", prompt_tokens=[5] * num_tokens, max_tokens=4, media={"audio": AUDIO})
    return engine.add_request("r", request)


@pytest.mark.parametrize("engine", [SimEngine, TorchEngine])
def test_both_engines_refuse_a_prompt_that_fills_a_rounds_sequence(engine):
    plan = load_plan(WHISPER)
    length = plan.deployment.max_seq_len
    made = engine(plan)
    assert _admits(made, length - 1) is None
    made.end_request("r")
    refusal = _admits(made, length)
    assert refusal is not None and refusal.startswith("cannot run: node decoder:") and f"({length} tokens)" in refusal


def test_the_python_api_refuses_it_naming_the_prompt():
    with LLM(WHISPER, engine="sim", sim_pace=0) as llm:
        length = llm.plan.deployment.max_seq_len
        llm.request([5] * (length - 1), SamplingParams(max_tokens=4), media={"audio": AUDIO})
        with pytest.raises(PromptError) as refused:
            llm.request([5] * length, SamplingParams(max_tokens=4), media={"audio": AUDIO})
        assert refused.value.param == "prompt" and f"give at most {length - 1} prompt tokens" in str(refused.value)
        # prompt + max_tokens past one round's sequence is still taken: later rounds start anew
        llm.request([5] * 4, SamplingParams(max_tokens=length), media={"audio": AUDIO})
