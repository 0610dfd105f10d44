"""A request's own prompt media that the torch engine's media encoder cannot take as features
(an image of shape [3, H, W] where the encoder takes [n, feature width] rows) is refused when the
request arrives, naming what to give: it was admitted, took KV pages and failed at its encoder
step ("a float tensor of shape (3, 32, 32) (need [tokens, width])")."""
from __future__ import annotations

import pytest
import torch

from mstar import LLM, SamplingParams
from mstar.runtime.conductor.request import Request

from plan_files import ROOT

PI05 = ROOT / "generated" / "pi05.plan"


@pytest.fixture(scope="module")
def llm():
    with LLM(PI05) as llm:
        yield llm


@pytest.mark.parametrize("image", [torch.rand(3, 32, 32), torch.rand(16, 5), torch.rand(5000, 48), torch.rand(5)])
def test_media_the_encoder_cannot_take_are_refused_at_admission(llm, image):
    width = llm.engine.runners["vit_encoder"].model.dims.feature_dim
    good = llm.request([1, 2, 3], SamplingParams(max_tokens=3), {"image": torch.rand(16, width)})
    bad = llm.request([1, 2, 3], SamplingParams(max_tokens=3), {"image": image})
    outputs = llm.generate([good, bad])
    assert not outputs[0].finish_reason.startswith("error")
    assert outputs[1].finish_reason == (
        f"error: cannot run: node vit_encoder: the request's image media (shape {list(image.shape)}) are not "
        f"features this encoder takes: give a float array [n, {width}] of n <= 4096 feature rows")
    assert all(in_use == 0 for in_use, _ in llm.engine.kv_pages().values())


def test_features_the_encoder_takes_are_admitted(llm):
    width = llm.engine.runners["vit_encoder"].model.dims.feature_dim
    for features in (torch.rand(16, width), torch.rand(width)):
        request = Request(id=f"features-{features.dim()}", prompt_tokens=[1, 2], max_tokens=2,
                          media={"image": features})
        assert llm.engine.add_request(request.id, request) is None
        llm.engine.end_request(request.id)
