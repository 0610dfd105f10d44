"""Classifier-free guidance on BAGEL's three KV sequences (mstar/runtime/engine/runners/guidance.py), from
the spec's roles (`guidance cfg_text drops text scale=4.0`, `kv WALK reads/writes ...`): which
sequences a guided request's rows write and read, the velocity formula, and that guidance changes
the image while an unguided request keeps its first sequence only."""
from pathlib import Path

import pytest
import torch

from mstar.plan.io import load_plan
from mstar.runtime.serve.driver import Driver, Workload
from mstar.runtime.engine.torch_engine import TorchEngine
from mstar.runtime.engine.runners.guidance import GuidanceError, GuidanceParams, NodeGuidance, in_interval
from mstar.runtime.conductor.request import Request
from mstar.runtime.serve.workload import WorkloadError, parse_prompt_line

GENERATED = Path(__file__).resolve().parents[2] / "generated"
IMAGE_ROUTE = {"LLM": ["prefill_vit", "prefill_text", "image_gen"]}


def bagel():
    path = GENERATED / "bagel.plan"
    if not path.exists():
        pytest.skip(f"{path} not generated")
    return load_plan(str(path))


def run(requests, spy_reserve=None):
    plan = bagel()
    engine = TorchEngine(plan)
    if spy_reserve is not None:
        pool = engine.runners["LLM"].pool
        original = pool.reserve

        def reserve(key, num_new_tokens):
            spy_reserve.setdefault(key, 0)
            spy_reserve[key] += num_new_tokens
            return original(key, num_new_tokens)
        pool.reserve = reserve
    driver = Driver(plan, engine)
    driver.run(Workload(requests))
    records = driver.conductor.records
    assert all(r.finish_reason in ("stop", "length", "done") for r in records.values()), \
        {k: r.finish_reason for k, r in records.items()}
    return records


def image_of(record) -> torch.Tensor:
    images = [e.value for e in record.emissions if e.modality == "image"]
    assert len(images) == 1
    return torch.as_tensor(images[0])


def test_a_guided_request_writes_text_to_main_and_cfg_img_and_the_image_to_main_and_cfg_text():
    written: dict = {}
    run([Request(id="g", prompt_tokens=[1, 2, 3], max_tokens=4, route=IMAGE_ROUTE)], written)
    text, media = 3, written[("g", "cfg_text")]
    assert media > 0  # prefill_vit's image tokens
    assert written[("g", "cfg_img")] == text
    assert written[("g", "main")] == media + text


def test_an_unguided_request_keeps_main_only():
    written: dict = {}
    run([Request(id="t", prompt_tokens=[4, 5], max_tokens=4),  # text route: no image-flow walk
         Request(id="off", prompt_tokens=[1, 2], max_tokens=4, route={"LLM": ["prefill_text", "image_gen"]},
                 guidance={"cfg_text": 1.0, "cfg_img": 1.0})], written)
    assert {label for _, label in written} == {"main"}


def test_guidance_changes_the_image_and_scale_one_is_the_unguided_image():
    route = {"LLM": ["prefill_text", "image_gen"]}
    records = run([Request(id="guided", prompt_tokens=[1, 2, 3], max_tokens=4, route=route, seed=3),
                   Request(id="plain", prompt_tokens=[1, 2, 3], max_tokens=4, route=route, seed=3,
                           guidance={"cfg_text": 1.0})])
    guided, plain = image_of(records["guided"]), image_of(records["plain"])
    assert guided.shape == plain.shape and not torch.equal(guided, plain)
    alone = run([Request(id="plain", prompt_tokens=[1, 2, 3], max_tokens=4, route=route, seed=3,
                         guidance={"cfg_text": 1.0})])
    assert torch.equal(image_of(alone["plain"]), plain)  # batch-invariant beside a guided row


def test_a_guided_image_does_not_depend_on_its_neighbours():
    request = dict(prompt_tokens=[7, 8], max_tokens=4, route=IMAGE_ROUTE, seed=5, guidance={"cfg_img": 2.0})
    alone = run([Request(id="g", **request)])
    crowded = run([Request(id="g", **request), Request(id="n", prompt_tokens=[3, 4, 5], max_tokens=6),
                   Request(id="m", prompt_tokens=[9], max_tokens=4, route=IMAGE_ROUTE, seed=1)])
    assert torch.equal(image_of(alone["g"]), image_of(crowded["g"]))


def bagel_guidance() -> NodeGuidance:
    return NodeGuidance.of(next(n for n in bagel().nodes if n.name == "LLM"))


def combine(v_main, v_text, v_img, text_scale, img_scale):
    params = GuidanceParams({"cfg_text": text_scale, "cfg_img": img_scale})
    return bagel_guidance().combine({"main": v_main, "cfg_text": v_text, "cfg_img": v_img}, params)


def test_combine_formula():
    v_main, v_text, v_img = torch.tensor([2.0, 0.0]), torch.tensor([1.0, 0.0]), torch.tensor([0.0, 1.0])
    # scales of 1 give back v_main
    assert torch.allclose(combine(v_main, v_text, v_img, 1.0, 1.0), v_main)
    # text guidance: 1 + 4 * (2 - 1) = 5 along x, renormed to |v_main| = 2
    assert torch.allclose(combine(v_main, v_text, v_img, 4.0, 1.0), torch.tensor([2.0, 0.0]))
    # a weak guidance below |v_main| is not scaled up
    small = combine(torch.tensor([1.0, 0.0]), torch.tensor([1.0, 0.0]), v_img, 4.0, 1.0)
    assert torch.allclose(small, torch.tensor([1.0, 0.0]))
    # image guidance pushes away from v_cfg_img, then renorms
    v = combine(v_main, v_main, v_img, 1.0, 2.0)  # v_img + 2 (v_main - v_img) = (4, -1)
    assert torch.allclose(v, torch.tensor([4.0, -1.0]) * 2.0 / torch.tensor([4.0, -1.0]).norm())


def test_interval_and_written_sequences():
    # noise level 1 - step/steps: 1.0 at step 0 (inside (0.4, 1.0]), 0.4 at step 6 (outside)
    assert in_interval(0, 10) and in_interval(5, 10) and not in_interval(6, 10) and not in_interval(9, 10)
    guidance = bagel_guidance()
    assert guidance.written("prefill_text", is_guided=True) == ("main", "cfg_img")
    assert guidance.written("prefill_vit", is_guided=True) == ("main", "cfg_text")
    assert guidance.written("prefill_text", is_guided=False) == ("main",)
    assert guidance.read("image_gen", is_guided=True) == ("main", "cfg_text", "cfg_img")
    assert guidance.defaults == (4.0, 1.0)
    # a row never writes a sequence whose guidance drops what it feeds (the spec's lines already
    # leave those out for BAGEL: the same sequences either way)
    assert guidance.written("prefill_text", is_guided=True, fed=frozenset({"text"})) == ("main", "cfg_img")
    assert guidance.written("prefill_vit", is_guided=True, fed=frozenset({"image", "audio"})) == ("main", "cfg_text")


def cosmos3():
    plan = load_plan(str(GENERATED / "cosmos3.plan"))
    return plan, NodeGuidance.of(next(node for node in plan.nodes if node.name == "dit"))


def test_a_sequence_that_drops_text_is_not_written_by_a_text_row():
    """Cosmos3's `uncond` drops text, and its text prefill says `writes main uncond`: the text went
    into both, so the unconditioned branch held the prompt and every scale gave the same image."""
    _, guidance = cosmos3()
    assert guidance.written("prefill", is_guided=True, fed=frozenset({"text"})) == ("main",)
    assert guidance.written("prefill", is_guided=True) == ("main", "uncond")  # (nothing fed: the spec's line)


def test_cosmos3s_guidance_scale_changes_the_image():
    plan, _ = cosmos3()
    route = {"Cosmos": ["prefill", "image_gen"]}
    images = {}
    for scale in (None, 1.0, 2.0, 7.0):
        driver = Driver(plan, TorchEngine(plan))
        guidance = {} if scale is None else {"uncond": scale}
        driver.run(Workload([Request(id="c", prompt_tokens=[1, 5, 9, 13, 17], max_tokens=1, route=route, seed=3,
                                     guidance=guidance)]))
        images[scale] = image_of(driver.conductor.records["c"])
    assert torch.equal(images[None], images[7.0])  # the spec's default scale
    assert not torch.equal(images[1.0], images[2.0]) and not torch.equal(images[2.0], images[7.0])


def test_bad_scales_are_refused():
    with pytest.raises(GuidanceError, match="guidance scale of cfg_text must be a number >= 0"):
        GuidanceParams.from_request({"guidance": {"cfg_text": -1}})
    with pytest.raises(WorkloadError, match="guidance scale of 'cfg_img' must be >= 0"):
        parse_prompt_line('{"id": "a", "prompt_tokens": [1], "max_tokens": 2, "guidance": {"cfg_img": -2}}', "p:1")
    request = parse_prompt_line('{"id": "a", "prompt_tokens": [1], "max_tokens": 2, "guidance": {"cfg_text": 2}}',
                                "p:1")
    assert request.guidance == {"cfg_text": 2.0}
    engine = TorchEngine(bagel())
    assert "must be a number" in engine.add_request("x", {"prompt_tokens": [1], "max_tokens": 2,
                                                          "guidance": {"cfg_text": "high"}})
    assert "'cfg_txt' is not a guidance label of the plan (labels: cfg_text, cfg_img)" in engine.add_request(
        "y", {"prompt_tokens": [1], "max_tokens": 2, "guidance": {"cfg_txt": 2.0}})


def test_a_guided_request_too_big_for_three_sequences_fails_alone():
    plan = bagel()
    engine = TorchEngine(plan, num_pages=3)
    runner = engine.runners["LLM"]
    page_size = runner.pool.page_size
    big = {"prompt_tokens": [1] * page_size, "max_tokens": page_size, "route": IMAGE_ROUTE}
    assert engine.add_request("plain", {**big, "route": {}}) is None
    reason = engine.add_request("guided", big)
    assert reason and "with guidance the request keeps 3 KV sequences" in reason
