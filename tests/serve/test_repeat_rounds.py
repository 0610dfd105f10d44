"""One rule for how many rounds a node's walks may run (mstar/plan/rounds.py), read by both of its
users: the audio a request may bring (serve/audio_input.py: one window a round of the audio
nodes' partition) and the tokens a request may ask (serve/api.py: max_seq_len a round of the kv
nodes' partitions). A repeating partition that holds neither raises neither bound."""
from __future__ import annotations

import pytest

from mstar.plan.io import load_plan
from mstar.plan.rounds import max_rounds
from mstar.plan.schema import RepeatPlan
from mstar.runtime.serve.api import LLM, PromptError, SamplingParams
from mstar.runtime.serve.audio_input import audio_input_of
from serve_harness import ORPHEUS, ROOT

WHISPER = str(ROOT / "generated" / "whisper.plan")


def _with_repeat(plan, partition: str, num_rounds: int):
    """The plan with `partition` repeating up to `num_rounds` rounds."""
    partitions = [p.model_copy(update={"repeat": RepeatPlan(value="audio_left", max_rounds=num_rounds)})
                  if p.name == partition else p for p in plan.partitions]
    return plan.model_copy(update={"partitions": partitions})


def test_rounds_count_only_the_partitions_holding_the_nodes_walks():
    plan = _with_repeat(load_plan(ORPHEUS, verify=False), "SNAC", 3)  # the codec's partition, not the LLM's
    assert max_rounds(plan, ["snac_decoder"]) == 3
    assert max_rounds(plan, ["LLM"]) == 1
    assert max_rounds(plan, ["LLM", "snac_decoder"]) == 3
    whisper = load_plan(WHISPER, verify=False)  # `repeat while audio_left max=max_windows` (1000)
    assert max_rounds(whisper, ["decoder"]) == max_rounds(whisper, ["audio_encoder"]) == 1000


def test_the_api_bounds_a_request_by_the_kv_nodes_rounds():
    plan = _with_repeat(load_plan(ORPHEUS, verify=False), "SNAC", 3)
    # closed at the end: an open LLM's run loop keeps Python's automatic collector off for the
    # process (serve/collector.py), which a later test would find off
    with LLM(plan, engine="sim") as llm:
        assert llm.max_rounds == 1  # SNAC's rounds start no new LLM sequence
        max_seq_len = plan.deployment.max_seq_len
        with pytest.raises(PromptError, match=f"more than the plan's max_seq_len {max_seq_len}"):
            llm.request([1] * (max_seq_len - 2), SamplingParams(max_tokens=3))
    with LLM(load_plan(WHISPER, verify=False), engine="sim") as whisper:
        assert whisper.max_rounds == 1000
        audio = audio_input_of(whisper.plan)
        assert audio is not None and audio.max_samples == whisper.max_rounds * audio.window_samples
