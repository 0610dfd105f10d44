"""`bidirectional WALK ...`: rows of those walks attend to all of their own tokens (BAGEL's image
prefills); other walks stay causal."""
import shutil
from pathlib import Path

import torch

from mstar.compiler.driver import compile_spec
from mstar.compiler.emit import write_outputs
from mstar.lang.diagnostics import Diagnostics
from mstar.plan.io import load_plan
from mstar.runtime.engine.attention.torch_paged import Segment, paged_attention
from mstar.runtime.serve.driver import Driver, Workload
from mstar.runtime.engine.torch_engine import TorchEngine
from mstar.runtime.conductor.request import Request

ROOT = Path(__file__).resolve().parents[2]


def bagel_plan(tmp_path: Path, bidirectional: bool):
    """The BAGEL plan, compiled with or without its `bidirectional` line."""
    (tmp_path / "specs").mkdir(parents=True)
    (tmp_path / "configs").mkdir()
    text = (ROOT / "specs" / "bagel.mw").read_text()
    line = "    bidirectional prefill_vit prefill_vae image_gen\n"
    assert line in text
    (tmp_path / "specs" / "bagel.mw").write_text(text if bidirectional else text.replace(line, ""))
    shutil.copy(ROOT / "configs" / "bagel.yaml", tmp_path / "configs")
    diags = Diagnostics()
    result = compile_spec(tmp_path / "specs" / "bagel.mw", tmp_path / "configs" / "bagel.yaml", diags)
    assert result is not None, diags.render()
    write_outputs(result.plan_path, result.plan_text, result.glue_path, result.glue_text)
    return load_plan(str(result.plan_path))


def image(plan) -> torch.Tensor:
    driver = Driver(plan, TorchEngine(plan))
    driver.run(Workload([Request(id="i", prompt_tokens=[1, 2], max_tokens=4, seed=2, guidance={"cfg_text": 1.0},
                                 route={"LLM": ["prefill_vit", "prefill_text", "image_gen"]})]))
    record = driver.conductor.records["i"]
    assert record.finish_reason in ("stop", "done"), record.finish_reason
    return torch.as_tensor(next(e.value for e in record.emissions if e.modality == "image"))


def test_the_plan_lists_the_walks(tmp_path):
    plan = bagel_plan(tmp_path, bidirectional=True)
    assert next(n for n in plan.nodes if n.name == "LLM").bidirectional_walks == ["image_gen", "prefill_vae",
                                                                                    "prefill_vit"]


def test_bidirectional_image_prefill_changes_the_image(tmp_path):
    both = image(bagel_plan(tmp_path / "a", bidirectional=True))
    causal = image(bagel_plan(tmp_path / "b", bidirectional=False))
    assert both.shape == causal.shape and not torch.equal(both, causal)


def test_a_bidirectional_segment_sees_its_later_tokens():
    torch.manual_seed(0)
    q, k, v = torch.randn(3, 2, 8), torch.randn(3, 2, 8), torch.randn(3, 2, 8)
    outs = []
    for is_causal in (True, False):
        cache_k, cache_v = torch.zeros(8, 2, 8), torch.zeros(8, 2, 8)
        segment = Segment(0, 3, 0, torch.arange(3), is_causal=is_causal)
        outs.append(paged_attention(q, k, v, cache_k, cache_v, [segment], 8 ** -0.5))
    causal, full = outs
    assert torch.allclose(causal[0], v[0])  # the first token sees only itself when causal
    assert not torch.allclose(full[0], causal[0])  # and all three tokens when bidirectional
    assert torch.allclose(full[2], causal[2])  # the last token sees everything either way
