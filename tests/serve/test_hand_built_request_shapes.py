"""A hand-built Request whose fields have the right values in other shapes runs as `llm.request`'s:
numpy integers as prompt token ids and a route's walks as a tuple. Before, both passed the API's
checks and failed the request on arrival (the engine could not take a list of numpy ints as a
prompt; a tuple of walks never matched a stage's list, so the route was refused as not taking a
stage it names)."""
import numpy as np
import pytest

from mstar import LLM
from mstar.runtime.conductor.request import Request

from serve_harness import ROOT


@pytest.fixture(scope="module")
def llm():
    with LLM(str(ROOT / "generated" / "llama.plan"), engine="torch") as made:
        yield made


def test_numpy_ids_and_a_tuple_route_run_as_plain_ones(llm):
    plain = llm.generate(Request(id="plain", prompt_tokens=[1, 2], max_tokens=3))[0]
    shaped = Request(id="shaped", prompt_tokens=[np.int64(1), np.int32(2)], max_tokens=3,
                     route={"LLM": ("prefill", "decode")})
    out = llm.generate(shaped)[0]
    assert plain.finish_reason == out.finish_reason == "length" and out.token_ids == plain.token_ids
    assert shaped.prompt_tokens == [1, 2] and all(type(t) is int for t in shaped.prompt_tokens)
    assert shaped.route == {"LLM": ["prefill", "decode"]}
