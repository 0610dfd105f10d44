"""The simulated engine budgets a guided request's guidance sequences as the torch engine does.

BAGEL's LLM keeps, for a request whose route reaches image_gen with a guidance scale above 1, two
more KV sequences (`cfg_text` drops the text and keeps the media, `cfg_img` drops the image and
keeps the text); the torch engine reserves their pages when the request starts
(`DecoderRunner._needed_pages`). The simulated engine reserved the request's own sequence alone, so
a what-if run started more guided requests at once than the GPU would, and under a small pool ran
one the torch engine refuses as "can never fit". The media tokens an encoder feeds stay unmodelled
in the simulator (0 here against the torch engine's tiny encoders' 8), so its budget is the torch
engine's less their pages.
"""
from __future__ import annotations

import pytest

from mstar.plan.io import load_plan
from mstar.runtime.conductor.request import Request
from mstar.runtime.engine.sim import SimEngine
from mstar.runtime.engine.torch_engine import TorchEngine

IMAGE_ROUTE = {"LLM": ["prefill_text", "image_gen"]}
PROMPT = list(range(1, 41))  # 40 tokens: with 8 max_tokens, 3 pages of 16


@pytest.fixture(scope="module")
def plan():
    return load_plan("generated/bagel.plan", verify=False)


def _budget(engine, request_id: str) -> int:
    pool = engine.pools["LLM"]
    return engine._budget_pages(pool, request_id)


def test_a_guided_request_budgets_its_guidance_sequences(plan):
    sim = SimEngine(plan, num_pages=64)
    guided = Request(id="g", prompt_tokens=PROMPT, max_tokens=8, route=IMAGE_ROUTE)
    plain = Request(id="p", prompt_tokens=PROMPT, max_tokens=8, route=IMAGE_ROUTE, guidance={"cfg_text": 1.0})
    text = Request(id="t", prompt_tokens=PROMPT, max_tokens=8)  # decode: no walk reads a guidance sequence
    for request in (guided, plain, text):
        assert sim.add_request(request.id, request) is None
    # its own 3 pages, 0 for cfg_text's media (not modelled), 3 for cfg_img's text
    assert (_budget(sim, "g"), _budget(sim, "p"), _budget(sim, "t")) == (6, 3, 3)
    torch_engine = TorchEngine(plan, num_pages=64)
    assert torch_engine.add_request("g", guided) is None
    runner = torch_engine.runners["LLM"]
    pages_for, media = runner.pool.pages_for, runner.num_media_tokens
    # the torch engine's budget: the same sequences, with the media tokens in its own and cfg_text's
    assert media > 0
    assert runner.start_budget_pages(torch_engine.requests["g"]) == pages_for(48 + media) + pages_for(media) + 3
    sim.end_request("g")
    assert "g" not in sim.pools["LLM"].guided


def test_a_guided_request_past_the_pool_is_refused_by_both(plan):
    guided = Request(id="g", prompt_tokens=PROMPT, max_tokens=8, route=IMAGE_ROUTE)
    reason = SimEngine(plan, num_pages=5).add_request("g", guided)
    assert reason is not None and reason.startswith("can never fit") and "guidance sequences" in reason
    assert TorchEngine(plan, num_pages=5).add_request("g", guided).startswith("cannot run: can never fit")
    plain = Request(id="p", prompt_tokens=PROMPT, max_tokens=8, route=IMAGE_ROUTE, guidance={"cfg_text": 1.0})
    assert SimEngine(plan, num_pages=5).add_request("p", plain) is None
