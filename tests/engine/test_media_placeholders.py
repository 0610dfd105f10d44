"""A request whose prompt cannot take its clip's states is refused when it arrives.

Qwen3-ASR's decoder replaces its prompt's audio placeholders by the encoder's states; a hand-built
request with another count of them (none, or the single one a front door would repeat) was admitted,
took its KV pages and failed at its first step. The engine (media_placeholders.py) and the Python
API (`LLM._check_given`) now refuse it up front; a clip past the encoder's bound too.
"""
from __future__ import annotations

import numpy as np
import pytest

from mstar import LLM
from mstar.plan.io import load_plan
from mstar.runtime.conductor.request import Request
from mstar.runtime.engine.models.qwen3_asr import num_states
from mstar.runtime.engine.torch_engine import TorchEngine
from mstar.runtime.serve.api import PromptError

PLAN = "generated/qwen3_asr.plan"
PLACEHOLDER = 151676  # the plan's media_token (the spec's <|audio_pad|>)


def clip(seconds: float) -> np.ndarray:
    return (0.1 * np.sin(np.arange(int(16000 * seconds)) / 10)).astype(np.float32)


def laid_out(audio: np.ndarray, extra: int = 0) -> list[int]:
    return [5] + [PLACEHOLDER] * (num_states(audio.shape[0]) + extra) + [6]


@pytest.fixture(scope="module")
def engine() -> TorchEngine:
    return TorchEngine(load_plan(PLAN))


@pytest.mark.parametrize("prompt, held", [([], 0), ([1, 2, 3], 0), ([5, PLACEHOLDER, 6], 1)])
def test_an_unlaid_prompt_is_refused_when_it_arrives(engine, prompt, held):
    audio = clip(1.0)
    reason = engine.add_request(f"r{held}-{len(prompt)}", Request(id="a", prompt_tokens=prompt, max_tokens=4,
                                                                  media={"audio": audio}))
    assert reason is not None and f"(token {PLACEHOLDER}) {held} times" in reason
    assert f"make {num_states(audio.shape[0])} states" in reason


def test_a_prompt_with_one_placeholder_too_many_is_refused(engine):
    audio = clip(1.0)
    reason = engine.add_request("over", Request(id="a", prompt_tokens=laid_out(audio, 1), max_tokens=4,
                                                media={"audio": audio}))
    assert reason is not None and "times" in reason


def test_a_laid_out_prompt_is_admitted(engine):
    audio = clip(1.0)
    assert engine.add_request("ok", Request(id="a", prompt_tokens=laid_out(audio), max_tokens=4,
                                            media={"audio": audio})) is None
    engine.end_request("ok")


def test_a_clip_past_the_encoders_bound_is_refused_when_it_arrives(engine):
    audio = clip(31.0)  # 30 s make the node's num_tokens=390 states
    reason = engine.add_request("long", Request(id="a", prompt_tokens=laid_out(audio), max_tokens=4,
                                                media={"audio": audio}))
    assert reason is not None and "31.00 s of audio gives" in reason and "num_tokens=390" in reason


def test_a_request_without_media_is_left_to_the_encoder(engine):
    # no clip: the encoder fails the request saying it needs one (the API refuses it earlier)
    assert engine.add_request("none", Request(id="a", prompt_tokens=[5, PLACEHOLDER, 6], max_tokens=4)) is None
    engine.end_request("none")


def test_the_python_api_refuses_a_hand_built_request_before_it_runs():
    audio = clip(1.0)
    with LLM(PLAN, engine="torch") as llm:
        with pytest.raises(PromptError, match="holds the audio placeholder .* 0 times"):
            llm.generate(Request(id="x", prompt_tokens=[], max_tokens=4, media={"audio": audio}))
        good = llm.generate(Request(id="y", prompt_tokens=laid_out(audio), max_tokens=4, media={"audio": audio}))
        assert good[0].finish_reason in ("length", "stop")
