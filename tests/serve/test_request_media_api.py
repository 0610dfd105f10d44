"""A hand-built `Request`'s media given to the Python API are checked as `llm.request(prompt,
sampling, media)` checks them, a PromptError (param media) before anything runs, and become the
float32 tensors `request` makes: a file name reached the engine and failed in its step with a
TypeError; NaN, int16 PCM or 1e20 samples, `None`, a clip with no audio-taking route, or no clip
on a plan whose default route takes one ran without a word (on seeded noise, or on nothing)."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from mstar import LLM, SamplingParams
from mstar.runtime.conductor.request import Request
from mstar.runtime.serve.api import PromptError
from serve_harness import ROOT

WHISPER = ROOT / "generated" / "whisper.plan"
PI05 = ROOT / "generated" / "pi05.plan"


@pytest.fixture(scope="module")
def whisper():
    with LLM(WHISPER) as llm:
        yield llm


def _clip() -> torch.Tensor:
    return torch.rand(16000, generator=torch.Generator().manual_seed(0)) * 0.1


@pytest.mark.parametrize("media, words", [
    ({"audio": "speech.wav"}, "media 'audio': an array of numbers .* got str"),
    ({"audio": None}, "media 'audio': an array of numbers .* got NoneType"),
    ({"audio": torch.full((16000,), float("nan"))}, "not a finite number"),
    ({"audio": torch.full((16000,), 1e20)}, "samples as floats in \\[-1, 1\\]"),
    ({"audio": torch.randint(-100, 100, (16000,))}, "samples as floats in \\[-1, 1\\], got int64"),
    ({"audio": torch.rand(2, 16000)}, "one channel of 16 kHz samples"),
    ({"image": torch.rand(4, 8)}, "this plan takes no such prompt media"),
    ({}, "this plan's default route takes the request's audio"),
    ([0.1, 0.2], "media must map modalities to values"),  # (an AttributeError from the check itself)
])
def test_hand_built_media_are_refused_before_they_run(whisper, media, words):
    bad = Request(id="hand-media", prompt_tokens=[1, 2, 3], max_tokens=2, media=media)
    with pytest.raises(PromptError, match=words) as raised:
        whisper.generate([whisper.request([1, 2], SamplingParams(max_tokens=2), {"audio": _clip()}), bad])
    assert raised.value.param == "media"
    good = whisper.request([1, 2], SamplingParams(max_tokens=2), {"audio": _clip()})
    assert whisper.generate(good)[0].finish_reason == "length"  # the loop lives


def test_hand_built_media_run_as_the_tensors_request_makes(whisper):
    clip = _clip()
    made = whisper.generate(whisper.request([1, 2], SamplingParams(max_tokens=3), {"audio": clip}))[0]
    given = Request(id="hand-clip", prompt_tokens=[1, 2], max_tokens=3, media={"audio": clip.double().numpy()[None]})
    assert whisper.generate(given)[0].token_ids == made.token_ids
    assert given.media["audio"].dtype == torch.float32 and given.media["audio"].shape == (16000,)


def test_a_hand_built_clip_on_a_plan_without_audio_is_refused():
    with LLM(PI05, engine="sim") as llm:
        bad = Request(id="hand-audio", prompt_tokens=[1, 2], max_tokens=2,
                      media={"image": np.zeros((4, 48), np.float32), "audio": np.zeros(100, np.float32)})
        with pytest.raises(PromptError, match="media 'audio': this plan takes no such prompt media"):
            llm.generate(bad)
