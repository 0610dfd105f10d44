"""A hand-built `Request`'s loop_counts given to the Python API are checked before it runs, as the
conductor checks them at admission: `loop_counts=None` (or a list, or a name that is not a string)
once raised inside the run loop, which failed every request in flight and closed the LLM."""
from __future__ import annotations

import pytest

from mstar import LLM, SamplingParams
from mstar.runtime.conductor.request import Request
from mstar.runtime.serve.api import SamplingError
from serve_harness import LLAMA, ROOT

COSMOS = ROOT / "generated" / "cosmos3.plan"


@pytest.mark.parametrize("plan, counts, words", [
    (LLAMA, None, r"loop_counts must map a loop's count param to its iterations .*got None"),
    (LLAMA, [("steps", 2)], "loop_counts must map a loop's count param"),
    (LLAMA, {5: 3}, "loop_counts names 5, which no loop of this plan counts by"),
    (COSMOS, {"num_image_step": 3}, "did you mean 'num_image_steps'"),
    (COSMOS, {"num_image_steps": 0}, r"loop_counts num_image_steps=0 is outside 1..100"),
])
def test_hand_built_loop_counts_are_refused_before_they_run(plan, counts, words):
    with LLM(plan, engine="sim") as llm:
        bad = Request(id="hand-counts", prompt_tokens=[1, 2, 3], max_tokens=2, loop_counts=counts)
        with pytest.raises(SamplingError, match=words):
            llm.generate([llm.request([1, 2], SamplingParams(max_tokens=2)), bad])
        assert llm.generate([1, 2], SamplingParams(max_tokens=2))[0].finish_reason in ("length", "stop")  # it lives


def test_a_hand_built_request_with_a_count_in_range_runs():
    with LLM(COSMOS, engine="sim") as llm:
        given = Request(id="hand-counted", prompt_tokens=[1, 2, 3], max_tokens=1, loop_counts={"num_image_steps": 2})
        assert not llm.generate([given])[0].finish_reason.startswith("error")
