"""A hand-built Request with an empty prompt, run through the Driver: where a walk of its route
feeds the request's text prompt to a node, both engines refuse it at admission (it fails alone, the
others finish), as the Python API and a prompts file refuse it before it is made. Before, it ran
on a zero embedding and finished "length" with made-up tokens. A node that makes its own prompt
(Whisper's decoder), a route that feeds no text prompt and a request that brings its media keep
running an empty prompt."""
import pytest

from mstar.runtime.conductor.request import Request
from mstar.runtime.engine.sim import SimEngine
from mstar.runtime.engine.torch_engine import TorchEngine
from mstar.runtime.serve.driver import Driver, Workload

from runtime_plans import generated

ENGINES = [SimEngine, TorchEngine]


def run(plan, engine_class, requests):
    driver = Driver(plan, engine_class(plan))
    driver.run(Workload(requests))
    return driver


@pytest.mark.parametrize("engine_class", ENGINES)
@pytest.mark.parametrize("name, walk, node", [("llama", "prefill", "LLM"), ("orpheus", "prefill", "LLM"),
                                              ("vjepa2_ac", "prefill_video_rollout", "rollout_predictor")])
def test_an_empty_prompt_fails_alone_at_admission(engine_class, name, walk, node):
    requests = [Request(id="a", prompt_tokens=[1, 2, 3], max_tokens=4),
                Request(id="empty", prompt_tokens=[], max_tokens=4),
                Request(id="b", prompt_tokens=[5], max_tokens=3)]
    driver = run(generated(name), engine_class, requests)
    records = driver.conductor.records
    empty = records["empty"]
    assert empty.is_refused and empty.num_output_tokens == 0 and empty.admit_s is not None
    assert empty.finish_reason == (f"error: cannot run: the prompt is empty, but walk {walk} feeds the request's text "
                                   f"prompt to node {node}: give at least one prompt token")
    for other in (records["a"], records["b"]):  # ran to their ends and sent the client something
        assert other.finish_reason in ("length", "stop") and other.emission_values, other.finish_reason
    assert not driver.engine.requests  # the refused one left nothing behind


@pytest.mark.parametrize("engine_class", ENGINES)
def test_whisper_starts_its_own_prompt_from_an_empty_one(engine_class):
    driver = run(generated("whisper"), engine_class, [Request(id="w", prompt_tokens=[], max_tokens=5)])
    records = driver.conductor.records
    assert records["w"].finish_reason in ("length", "stop") and records["w"].num_output_tokens > 0


@pytest.mark.parametrize("engine_class", ENGINES)
def test_a_route_that_feeds_no_text_prompt_takes_an_empty_one(engine_class):
    plan = generated("vjepa2_ac")
    (part,) = [p.name for p in plan.partitions]
    request = Request(id="v", prompt_tokens=[], max_tokens=4, route={part: ["prefill_video_encoder_only"]})
    record = run(plan, engine_class, [request]).conductor.records["v"]
    assert not record.is_refused and not record.finish_reason.startswith("error"), record.finish_reason


def test_a_request_with_media_may_leave_its_prompt_empty():
    """The Python API's rule (`LLM.request`: media with empty token ids): refused by neither engine."""
    plan = generated("bagel")
    request = Request(id="m", prompt_tokens=[], max_tokens=4, media={"image": object()})
    assert SimEngine(plan).add_request("m", request) is None
    assert SimEngine(plan).add_request("e", Request(id="e", prompt_tokens=[], max_tokens=4)) is not None
