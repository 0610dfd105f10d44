"""The simulated and the torch engine keep their KV pools the same way on the same steps (the
sim's what-ifs stay honest): the same prefix-cache hits and the same offload victims.

- every row's pages reserved before any row's are committed (a later row's reservation evicting a
  page an earlier row had just keyed made the engines cache different pages);
- a prompt chunk within its pages keys them (the sim's committed without tokens and stopped keying);
- a decode row whose token stayed on the device keys nothing (the torch engine keyed it);
- a request is moved to the host only where its pages come free (a prefix page a waiting request's
  claim shares does not).
"""
from __future__ import annotations

import pytest

from engine_plans import step
from mstar.plan.io import load_plan
from mstar.runtime.conductor.request import Request
from mstar.runtime.engine.sim import SimEngine
from mstar.runtime.engine.torch_engine import TorchEngine
from mstar.runtime.step import StepRow

T0, T1 = list(range(1, 17)), list(range(101, 117))  # one 16-token page each


@pytest.fixture(scope="module")
def plan():
    return load_plan("generated/llama_chunked.plan", verify=False)  # prefix cache, a host pool, pages of 16


def _engines(plan, num_pages: int, prompts: dict[str, list[int]], max_tokens: dict[str, int]):
    for engine in (SimEngine(plan, num_pages=num_pages), TorchEngine(plan, dims="tiny", num_pages=num_pages)):
        for request_id, prompt in prompts.items():
            assert engine.add_request(request_id, Request(id=request_id, prompt_tokens=prompt,
                                                          max_tokens=max_tokens[request_id])) is None
        yield engine


def _prefill(request_id: str, prompt: list[int], start: int = 0, num: int = 0) -> StepRow:
    num = num or len(prompt) - start
    return StepRow(request_id, "prefill", num, start, {"text_inputs": prompt}, chunk_start=start,
                   is_partial=start + num < len(prompt))


def _pool(engine):
    return engine.pools["LLM"].pages if isinstance(engine, SimEngine) else engine.runners["LLM"].pool


def test_rows_reserved_before_any_is_committed(plan):
    """X and Y write T0 in one step; Y's reservation evicts W's cached pages. Then Q takes the free
    pages; Z, starting with T0, finds it cached on both engines alike (16 tokens in the sim, 0 on
    torch, before)."""
    prompts = {"W": T0 + T1 + [200], "X": T0 + [201], "Y": T0 + [202], "Q": list(range(300, 320)), "Z": T0 + [203, 204]}
    max_tokens = {"W": 1, "X": 1, "Y": 15, "Q": 1, "Z": 1}
    found = []
    for engine in _engines(plan, 4, prompts, max_tokens):
        for ids, ended in ((["W"], "W"), (["X", "Y"], "X"), (["Q"], None)):
            rows = [_prefill(i, prompts[i]) for i in ids]
            assert engine.run_step(step(plan, "LLM", rows)).allocation_failed == []
            if ended is not None:
                engine.end_request(ended)
        found.append(engine.claim_prefix("Z", "LLM", prompts["Z"]))
    assert found[0] == found[1]


def test_prompt_chunks_within_a_page_key_it(plan):
    """A 40-token prompt fed in chunks of 5 (none adds a page until a page boundary): its two full
    pages are keyed on both engines, so the same prompt then finds 32 tokens cached."""
    prompt = list(range(1, 41))
    prompts, max_tokens = {"first": prompt, "second": prompt}, {"first": 2, "second": 2}
    for engine in _engines(plan, 16, prompts, max_tokens):
        for start in range(0, 40, 5):
            assert engine.run_step(step(plan, "LLM", [_prefill("first", prompt, start, 5)])).allocation_failed == []
        assert engine.claim_prefix("second", "LLM", prompt) == 32, type(engine).__name__


def test_a_token_kept_on_the_device_keys_no_page(plan):
    """A 15-token prompt then a decode row whose token looped back on the device (no input): the
    page it fills is not keyed on either engine (docs/runtime.md, "Prefix cache"), so the prompt
    and that token, then one more, find nothing cached (16 tokens on torch, before)."""
    prompt = list(range(1, 16))
    for engine in _engines(plan, 16, {"a": prompt}, {"a": 4}):
        first = engine.run_step(step(plan, "LLM", [_prefill("a", prompt)])).rows[0].outputs
        (token,) = first["new_token"]
        engine.run_step(step(plan, "LLM", [StepRow("a", "decode", 1, 15, {})]))
        assert _pool(engine).num_tokens(("a", "main")) == 16
        again = [*prompt, token, 7]
        assert engine.add_request("b", Request(id="b", prompt_tokens=again, max_tokens=1)) is None
        assert engine.claim_prefix("b", "LLM", again) == 0, type(engine).__name__


def test_no_request_moved_out_whose_pages_a_claim_shares(plan):
    """S holds 3 pages, 2 of them a prefix W's claim shares; N needs 4 with 3 free. Moving S out would
    free 1 page: N is refused either way, and S stays (both engines moved it to the host, before)."""
    prompts = {"S": T0 + T1 + [200], "W": T0 + T1 + [201], "N": list(range(300, 360))}
    for engine in _engines(plan, 6, prompts, {"S": 15, "W": 15, "N": 4}):
        engine.run_step(step(plan, "LLM", [_prefill("S", prompts["S"])]))
        assert engine.claim_prefix("W", "LLM", prompts["W"]) == 32
        result = engine.run_step(step(plan, "LLM", [_prefill("N", prompts["N"])]))
        offload = engine.pools["LLM"].offload if isinstance(engine, SimEngine) else engine.runners["LLM"].offload
        assert result.allocation_failed == ["N"] and not offload.offloaded, type(engine).__name__
