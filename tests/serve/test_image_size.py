"""An image request's `size`: the server makes the plan's image decoder's size and says so. A
`size` no node of the image route makes is a 400 naming the size it makes (it was ignored, so a
client asking for 1024x1024 got a 32x32 image as if it were that one); that size, `auto` or none
is answered. The engines say their sizes in `EngineCaps.image_sizes` (the torch engine from the
image decoder's dims, the sim its placeholder's)."""
from __future__ import annotations

import base64
import io

import pytest

from mstar.plan.io import load_plan
from mstar.runtime.engine.sim import SimEngine
from mstar.runtime.engine.torch_engine import TorchEngine
from mstar.runtime.serve.api import LLM
from mstar.runtime.serve.endpoints import endpoints_of, image_size_problem
from serve_harness import ROOT, make_service, running

openai = pytest.importorskip("openai")
BAGEL = str(ROOT / "generated" / "bagel.plan")


def test_the_engines_say_the_size_of_the_images_they_make():
    plan = load_plan(BAGEL)
    endpoints = endpoints_of(plan)
    assert endpoints.image_nodes  # the route's image decoder
    # tiny dims: a 4x4 latent grid upscaled 8 times (models/image_decoder.py)
    assert {TorchEngine(plan).caps.image_sizes[n] for n in endpoints.image_nodes} == {(32, 32)}
    assert {SimEngine(plan).caps.image_sizes[n] for n in endpoints.image_nodes} == {(8, 8)}


def test_a_size_is_checked_only_where_every_image_node_is_known():
    endpoints = endpoints_of(load_plan(BAGEL))
    known = {node: (32, 32) for node in endpoints.image_nodes}
    for size in (None, "auto", "32x32"):
        assert image_size_problem(size, endpoints, known) is None
    assert "makes 32x32 images" in (image_size_problem("1024x1024", endpoints, known) or "")
    # another rank's node (ranks as processes): its size is not known here, so not checked
    assert image_size_problem("1024x1024", endpoints, {}) is None
    # a 10,000-character size is clipped in the message
    assert len(image_size_problem("9" * 10_000, endpoints, known) or "") < 400


@pytest.mark.parametrize("engine, side", [("torch", 32), ("sim", 8)])
def test_the_server_answers_its_own_size_and_refuses_another(tmp_path, engine, side):
    from matplotlib import image as mpimg

    from serve_harness import write_tokenizer

    llm = LLM(BAGEL, engine=engine, tokenizer=str(write_tokenizer(tmp_path / "tok")))
    with running(make_service(llm)) as url:
        client = openai.OpenAI(base_url=url, api_key="none", max_retries=0)
        with pytest.raises(openai.BadRequestError) as refused:
            client.images.generate(model="bagel", prompt="a cat", size="1024x1024")
        answer = client.images.generate(model="bagel", prompt="a cat", size=f"{side}x{side}")
        auto = client.images.generate(model="bagel", prompt="a cat", size="auto")
    error = refused.value.body
    assert isinstance(error, dict) and error["param"] == "size"
    assert f"makes {side}x{side} images" in error["message"]
    for image in (answer, auto):
        pixels = mpimg.imread(io.BytesIO(base64.b64decode(image.data[0].b64_json)), format="png")
        assert pixels.shape[:2] == (side, side)


def test_image_fields_the_server_does_not_take_are_refused_by_name(tmp_path):
    """An unknown field (`temperature`, `tools`, a typo) and `output_compression` were ignored;
    each is now a 400 naming it in `param`. `user` (the provider's abuse monitoring) is taken."""
    from serve_harness import write_tokenizer

    llm = LLM(BAGEL, engine="sim", tokenizer=str(write_tokenizer(tmp_path / "tok")))
    with running(make_service(llm)) as url:
        client = openai.OpenAI(base_url=url, api_key="none", max_retries=0)
        params = {}
        for extra in ({"temperature": 0.5}, {"tools": []}, {"sedd": 3}, {"x" * 5000: 1}):
            with pytest.raises(openai.BadRequestError) as refused:
                client.images.generate(model="bagel", prompt="a cat", extra_body=extra)
            params[next(iter(extra))[:20]] = refused.value.body
        with pytest.raises(openai.BadRequestError, match="png") as compression:
            client.images.generate(model="bagel", prompt="a cat", output_compression=50)
        taken = client.images.generate(model="bagel", prompt="a cat", user="someone")
    assert [body["param"] for body in list(params.values())[:3]] == ["temperature", "tools", "sedd"]
    assert len(params["x" * 20]["param"]) < 200 and len(params["x" * 20]["message"]) < 400
    assert isinstance(compression.value.body, dict) and compression.value.body["param"] == "output_compression"
    assert len(taken.data) == 1
