"""/v1/images/generations on the BAGEL plan (tiny random models on the CPU): the request takes
the plan's image-emitting route and comes back as a base64 PNG of the plan's image size."""
from __future__ import annotations

import base64
import io

import pytest

from mstar.runtime.serve.api import LLM
from serve_harness import ROOT, make_service, running

openai = pytest.importorskip("openai")
BAGEL = str(ROOT / "generated" / "bagel.plan")


def test_an_image_plan_answers_with_a_png(tmp_path):
    from matplotlib import image as mpimg

    from serve_harness import write_tokenizer

    llm = LLM(BAGEL, tokenizer=str(write_tokenizer(tmp_path / "tok")))
    service = make_service(llm)
    with running(service) as url:
        client = openai.OpenAI(base_url=url, api_key="none", max_retries=0)
        assert client.models.list().data[0].model_extra["serves"] == ["text", "images"]
        answer = client.images.generate(model="bagel", prompt="a cat on a mat", extra_body={"seed": 3})
        with pytest.raises(openai.BadRequestError, match="b64_json"):
            client.images.generate(model="bagel", prompt="a cat", response_format="url")
    assert len(answer.data) == 1
    png = base64.b64decode(answer.data[0].b64_json)
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    pixels = mpimg.imread(io.BytesIO(png), format="png")
    assert pixels.shape[:2] == (32, 32)  # the tiny image decoder's size


def test_the_sim_engine_answers_an_image_request_with_a_placeholder_png(tmp_path):
    """The sim engine's image outputs are small gray images (engine/sim.py), so a what-if server
    answers 200 with a PNG rather than failing to encode a token placeholder (it answered 500)."""
    from matplotlib import image as mpimg

    from serve_harness import write_tokenizer

    llm = LLM(BAGEL, engine="sim", tokenizer=str(write_tokenizer(tmp_path / "tok")))
    service = make_service(llm)
    with running(service) as url:
        client = openai.OpenAI(base_url=url, api_key="none", max_retries=0)
        answer = client.images.generate(model="bagel", prompt="a cat")
    pixels = mpimg.imread(io.BytesIO(base64.b64decode(answer.data[0].b64_json)), format="png")
    assert pixels.shape[:2] == (8, 8)


@pytest.fixture(scope="module")
def bagel_sim(tmp_path_factory):
    from serve_harness import write_tokenizer

    llm = LLM(BAGEL, engine="sim", tokenizer=str(write_tokenizer(tmp_path_factory.mktemp("tok"))))
    with running(make_service(llm)) as url:
        yield llm, url


def test_a_prompt_too_long_for_an_image_names_the_prompt(bagel_sim):
    """The images API has no max_tokens: a long prompt was refused as "the prompt (N tokens) +
    max_tokens (1024) is ...", `param: "max_tokens"`. Now it says what the client can change."""
    import json

    from serve_harness import post_json

    llm, url = bagel_sim
    limit = llm.plan.deployment.max_seq_len - 1024  # the image's 1024 tokens
    body = {"model": "bagel", "prompt": " ".join(["cat"] * limit)}  # + the tokenizer's <s>: one past
    status, error = post_json(f"{url}/images/generations", json.dumps(body).encode())
    assert status == 400 and error["param"] == "prompt", error
    assert "max_tokens" not in error["message"]
    assert error["message"].startswith(f"the prompt is {limit + 1} tokens, more than this plan takes: at most "
                                        f"{limit} tokens"), error
    assert "shorten the prompt" in error["message"]
    body["prompt"] = " ".join(["cat"] * (limit - 1))  # fits exactly
    status, answer = post_json(f"{url}/images/generations", json.dumps(body).encode())
    assert status == 200 and len(answer["data"]) == 1, answer


@pytest.mark.parametrize("output_format", ["jpeg", "webp", "gif"])
def test_an_output_format_other_than_png_is_refused(bagel_sim, output_format):
    """The answer is always a PNG: `output_format: "jpeg"` was ignored (a PNG came back as if it
    were a JPEG)."""
    _, url = bagel_sim
    client = openai.OpenAI(base_url=url, api_key="none", max_retries=0)
    with pytest.raises(openai.BadRequestError) as caught:
        client.images.generate(model="bagel", prompt="a cat", extra_body={"output_format": output_format})
    assert caught.value.body["param"] == "output_format"
    assert caught.value.body["message"] == f"output_format {output_format!r} is not supported: png (the only " \
                                        "format this server encodes)"
    answer = client.images.generate(model="bagel", prompt="a cat", extra_body={"output_format": "png"})
    assert base64.b64decode(answer.data[0].b64_json)[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("field, value", [("stream", True), ("partial_images", 2), ("background", "transparent")])
def test_a_stream_of_partial_images_or_a_transparent_background_is_refused(bagel_sim, field, value):
    """Each was ignored: a streaming client got a whole JSON answer it could not read as a stream,
    and a transparent background an opaque image. The values that ask nothing else still answer."""
    _, url = bagel_sim
    client = openai.OpenAI(base_url=url, api_key="none", max_retries=0)
    with pytest.raises(openai.BadRequestError) as caught:
        client.images.generate(model="bagel", prompt="a cat", extra_body={field: value})
    assert caught.value.body["param"] == field
    fine = {"stream": False, "partial_images": 0, "background": "opaque"}[field]
    answer = client.images.generate(model="bagel", prompt="a cat", extra_body={field: fine})
    assert base64.b64decode(answer.data[0].b64_json)[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("field, value, taken", [
    ("quality", "hd", "auto or standard"), ("quality", "high", "auto or standard"),
    ("style", "vivid", "leave it out"), ("moderation", "strict", "auto or low")])
def test_a_quality_style_or_moderation_the_server_does_not_make_is_refused(bagel_sim, field, value, taken):
    """Each was ignored: `quality: "hd"` or `style: "vivid"` got the plan's one image as if it
    were that one. A value asking for what the server does anyway still answers."""
    _, url = bagel_sim
    client = openai.OpenAI(base_url=url, api_key="none", max_retries=0)
    with pytest.raises(openai.BadRequestError) as caught:
        client.images.generate(model="bagel", prompt="a cat", extra_body={field: value})
    assert caught.value.body["param"] == field
    assert caught.value.body["message"].startswith(f"{field} {value!r} is not supported: {taken} (")


@pytest.mark.parametrize("fields", [{"quality": "auto"}, {"quality": "standard"}, {"moderation": "auto"},
                                    {"moderation": "low"}, {"style": None}])
def test_a_quality_or_moderation_that_asks_for_the_servers_image_answers(bagel_sim, fields):
    _, url = bagel_sim
    client = openai.OpenAI(base_url=url, api_key="none", max_retries=0)
    answer = client.images.generate(model="bagel", prompt="a cat", extra_body=fields)
    assert base64.b64decode(answer.data[0].b64_json)[:8] == b"\x89PNG\r\n\x1a\n"
