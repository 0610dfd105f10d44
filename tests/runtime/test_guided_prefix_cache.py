"""A guided request on a node with a prefix cache claims no cached prefix there (conductor
`_claim_prefix`): its prompt row writes the guidance sequences too, which no cached page holds.
Before, the claim started the first sequence alone on the cached pages and the row fed only the
uncached tail, which the guidance sequence then held at positions 0.. (Cosmos3, guided by default:
a second identical text-to-image request came out a different image). An unguided request still
starts on the cache."""
from __future__ import annotations

import pytest
import torch
import yaml

from mstar.plan.io import load_plan
from mstar.runtime.conductor.request import Request
from mstar.runtime.engine.sim import SimEngine
from mstar.runtime.engine.torch_engine import TorchEngine
from mstar.runtime.serve.driver import Driver, Workload
from plan_variants import compiled
from runtime_plans import ROOT

ROUTE = {"Cosmos": ["prefill", "image_gen"]}
PROMPT = list(range(1, 41))  # two whole pages of 16 and a tail


@pytest.fixture(scope="module")
def cached_plan(tmp_path_factory):
    folder = tmp_path_factory.mktemp("cosmos3_cached")
    config = yaml.safe_load((ROOT / "configs" / "cosmos3.yaml").read_text())
    config["prefix_cache"] = True
    deployment = folder / "cosmos3.yaml"
    deployment.write_text(yaml.safe_dump(config))
    return load_plan(str(compiled(ROOT / "specs" / "cosmos3.mw", deployment, folder)), verify=False)


def _run(plan, engine, guidance):
    requests = [Request(id=f"img{i}", prompt_tokens=PROMPT, max_tokens=4, route=ROUTE, seed=3, guidance=guidance)
                for i in range(2)]
    driver = Driver(plan, engine)
    driver.run(Workload(requests, closed_concurrency=1))
    return [driver.conductor.records[r.id] for r in requests]


def _image(record):
    return torch.as_tensor(next(e.value for e in record.emissions if e.modality == "image"))


def test_a_guided_request_does_not_start_on_the_cache_and_its_image_is_the_same(cached_plan):
    first, second = _run(cached_plan, TorchEngine(cached_plan, dims="tiny"), {})  # the spec's uncond 7.0
    assert first.finish_reason == second.finish_reason == "stop"
    assert first.num_cached_tokens == second.num_cached_tokens == 0
    assert torch.equal(_image(first), _image(second))


def test_an_unguided_request_still_starts_on_the_cache(cached_plan):
    first, second = _run(cached_plan, TorchEngine(cached_plan, dims="tiny"), {"uncond": 1.0})
    assert first.num_cached_tokens == 0 and second.num_cached_tokens == 32
    assert torch.equal(_image(first), _image(second))


def test_the_sim_claims_as_the_torch_engine_does(cached_plan):
    guided = _run(cached_plan, SimEngine(cached_plan), {})
    unguided = _run(cached_plan, SimEngine(cached_plan), {"uncond": 1.0})
    assert [r.num_cached_tokens for r in guided] == [0, 0]
    assert [r.num_cached_tokens for r in unguided] == [0, 32]


def test_a_guidance_scale_that_makes_the_latents_non_finite_fails_its_request_alone():
    """BAGEL at a text guidance scale of 1e39 (finite, so admitted): the flow's latents came out NaN
    and the PNG garbage, ending `stop`; the image decoder now fails that request, naming why, and
    the request beside it makes its image."""
    plan = load_plan(ROOT / "generated" / "bagel.plan")
    route = {"LLM": ["prefill_text", "image_gen"]}
    requests = [Request(id="huge", prompt_tokens=[1], max_tokens=2, route=route, guidance={"cfg_text": 1e39}),
                Request(id="plain", prompt_tokens=[1], max_tokens=2, route=route)]
    driver = Driver(plan, TorchEngine(plan))
    driver.run(Workload(requests))
    huge, plain = driver.conductor.records["huge"], driver.conductor.records["plain"]
    assert "the flow's latents are not finite" in (huge.finish_reason or "")
    assert not any(e.modality == "image" for e in huge.emissions)
    assert plain.finish_reason == "stop" and any(e.modality == "image" for e in plain.emissions)
