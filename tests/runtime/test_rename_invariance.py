"""A name is for people: renaming consistently every name an author chooses changes no output and no step.

For each spec of specs/ and its deployments in configs/, the spec is parsed, every author-chosen name
(model, params, nodes, inputs, outputs, walks, loops, combined walks, partitions, KV sequence labels,
guidance labels) renamed through one mapping whose new names sort in the reverse order (renaming.py),
formatted back, and the deployment renamed by its structure; both pairs are compiled. Then:
- on the CPU torch engine (tiny dims, the same seeds; the deployments the end-to-end tests run), the
  requests (their routes and guidance labels renamed too) give identical tokens, identical WAV and
  PNG bytes and identical step compositions;
- on the sim engine, every deployment gives identical step compositions.
A step composition is (worker, key position, mixture mask, rows, padded batch, token bucket, and per
row: request, walk position, tokens, context): positions, never names.
`test_a_name_dependent_runtime_fails_the_check` puts back the old rule (the prompt goes to an input
*named* text_inputs) and shows the check catches it.
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
import yaml

from mstar.compiler.driver import compile_spec
from mstar.lang.diagnostics import Diagnostics
from mstar.lang.fmt import format_spec
from mstar.lang.parser import parse
from mstar.runtime.conductor.partition_state import PartitionState
from mstar.runtime.conductor.request import Request
from mstar.runtime.conductor.tables import OUTSIDE, PROMPT
from mstar.runtime.engine.sim import SimEngine
from mstar.runtime.engine.torch_engine import TorchEngine
from mstar.runtime.serve.driver import Driver, Workload
from mstar.runtime.serve.media import write_png, write_wav
from renaming import rename_deployment, rename_spec

ROOT = Path(__file__).resolve().parents[2]


def _config_pairs() -> list[tuple[str, str]]:
    """(spec, deployment) for every deployment in configs/ (its `model` names the spec)."""
    pairs = []
    for path in sorted((ROOT / "configs").glob("*.yaml")):
        model = yaml.safe_load(path.read_text(encoding="utf-8"))["model"]
        pairs.append((model, path.stem))
    return pairs


def compile_pair(tmp: Path, spec_name: str, config_name: str, is_renamed: bool):
    """The plan of (spec, deployment), renamed or not, and the name mapping ({} when not)."""
    text = (ROOT / "specs" / f"{spec_name}.mw").read_text(encoding="utf-8")
    config = yaml.safe_load((ROOT / "configs" / f"{config_name}.yaml").read_text(encoding="utf-8"))
    mapping: dict[str, str] = {}
    if is_renamed:
        diags = Diagnostics()
        spec = parse(text, f"{spec_name}.mw", diags)
        assert spec is not None, diags.render()
        spec, mapping = rename_spec(spec)
        text = format_spec(spec)
        config = rename_deployment(config, mapping)
    folder = tmp / ("renamed" if is_renamed else "original")
    (folder / "specs").mkdir(parents=True, exist_ok=True)
    (folder / "configs").mkdir(exist_ok=True)
    spec_path = folder / "specs" / f"{mapping.get(spec_name, spec_name)}.mw"
    spec_path.write_text(text, encoding="utf-8")
    config_path = folder / "configs" / f"{config_name}.yaml"
    config_path.write_text(yaml.safe_dump(config), encoding="utf-8")
    diags = Diagnostics()
    result = compile_spec(spec_path, config_path, diags)
    assert result is not None, diags.render()
    return result.plan, mapping


def run(plan, engine, requests: list[Request]):
    """(per-request outcome, step compositions) of one run (module docstring)."""
    keys = {w.rank: [k.name for k in w.keys] for w in plan.workers}
    walks = [w.name for w in plan.walks]
    steps = []
    launch = engine.launch

    def record(step):
        rows = tuple((r.request_id, walks.index(r.walk), r.num_tokens, r.context_len) for r in step.rows)
        steps.append((step.worker, keys[step.worker].index(step.key), step.mask, len(step.rows),
                      step.padded_batch, step.token_bucket, rows))
        return launch(step)

    engine.launch = record
    driver = Driver(plan, engine)
    driver.run(Workload(requests))
    outcome = {rid: (record.finish_reason, record.num_output_tokens, record.emissions)
               for rid, record in driver.conductor.records.items()}
    return outcome, steps


def renamed_requests(requests: list[Request], mapping: dict[str, str]) -> list[Request]:
    def name(value: str) -> str:
        return mapping.get(value, value)

    return [Request(**{**vars(r), "route": {name(p): [name(w) for w in ws] for p, ws in r.route.items()},
                       "guidance": {name(label): scale for label, scale in r.guidance.items()},
                       "loop_counts": {name(param): count for param, count in r.loop_counts.items()}})
            for r in requests]


def media_bytes(tmp: Path, emissions) -> list:
    """Tokens as lists; audio as the WAV bytes and images as the PNG bytes `mstar run --out` writes."""
    values = [tuple(e.value) if isinstance(e.value, list) else None for e in emissions if e.modality == "text"]
    audio = [e.value for e in emissions if e.modality == "audio"]
    if audio:
        write_wav(tmp / "out.wav", audio)
        values.append((tmp / "out.wav").read_bytes())
    for image in (e.value for e in emissions if e.modality == "image"):
        write_png(tmp / "out.png", image)
        values.append((tmp / "out.png").read_bytes())
    return values


def assert_same(tmp: Path, first, second) -> None:
    (outcome_a, steps_a), (outcome_b, steps_b) = first, second
    assert steps_a == steps_b, "step compositions differ"
    assert outcome_a.keys() == outcome_b.keys()
    for rid in outcome_a:
        (reason_a, count_a, emissions_a), (reason_b, count_b, emissions_b) = outcome_a[rid], outcome_b[rid]
        assert (reason_a, count_a) == (reason_b, count_b), rid
        assert media_bytes(tmp, emissions_a) == media_bytes(tmp, emissions_b), f"request {rid}: outputs differ"


IMAGE_ROUTE = {"LLM": ["prefill_vit", "prefill_text", "image_gen"]}
TORCH_CASES = {
    "llama": [Request(id="a", prompt_tokens=[5, 6, 7], max_tokens=5),
              Request(id="b", prompt_tokens=[9, 3], max_tokens=4, temperature=0.9, seed=11)],
    "qwen3_5": [Request(id="a", prompt_tokens=[5, 6, 7], max_tokens=4, temperature=0.7, seed=3)],
    "orpheus": [Request(id="a", prompt_tokens=[128259, 5, 6], max_tokens=20),
                Request(id="b", prompt_tokens=[128259, 9], max_tokens=14, temperature=0.8, seed=2)],
    "bagel": [Request(id="img", prompt_tokens=[1, 2, 3], max_tokens=3, route=IMAGE_ROUTE, seed=4,
                      guidance={"cfg_img": 2.0}),
              Request(id="txt", prompt_tokens=[4, 5], max_tokens=3)],
    "qwen3_omni": [Request(id="r", prompt_tokens=[1, 2, 3], max_tokens=2, temperature=0.6, seed=5)],
    # frames from the Talker's depth model (the code predictor), sampled
    "qwen3_tts": [Request(id="t", prompt_tokens=[1, 2, 3], max_tokens=12, temperature=0.9, seed=3)],
    # the generation tower (a sub-model) denoises; guided by the unconditioned sequence
    "cosmos3": [Request(id="c", prompt_tokens=[1, 2], max_tokens=2, route={"Cosmos": ["prefill", "image_gen"]},
                        loop_counts={"num_image_steps": 3}, seed=2)],
    # the cross-attention pool is found by the plan's cross_kv source, not by an input's name
    "whisper": [Request(id="w", prompt_tokens=[], max_tokens=6,
                        media={"audio": torch.linspace(-0.5, 0.5, 24000)}),
                Request(id="v", prompt_tokens=[], max_tokens=5, temperature=0.8, seed=7)],
}


def torch_runs(tmp: Path, name: str):
    plan, _ = compile_pair(tmp, name, name, is_renamed=False)
    renamed_plan, mapping = compile_pair(tmp, name, name, is_renamed=True)
    assert {n.name for n in renamed_plan.nodes}.isdisjoint({n.name for n in plan.nodes})  # really renamed
    original = run(plan, TorchEngine(plan, seed=1), TORCH_CASES[name])
    renamed = run(renamed_plan, TorchEngine(renamed_plan, seed=1), renamed_requests(TORCH_CASES[name], mapping))
    return original, renamed


@pytest.mark.parametrize("name", sorted(TORCH_CASES))
def test_renaming_changes_no_output_and_no_step_on_the_torch_engine(tmp_path, name):
    original, renamed = torch_runs(tmp_path, name)
    assert any(e.modality for _, _, emissions in original[0].values() for e in emissions)
    assert_same(tmp_path, original, renamed)


def sim_requests() -> list[Request]:
    return [Request(id=f"s{i}", prompt_tokens=[1 + i] * (3 + 5 * i), max_tokens=4 + 3 * i) for i in range(6)]


@pytest.mark.parametrize("spec_name, config_name", _config_pairs())
def test_renaming_changes_no_step_on_the_sim_engine(tmp_path, spec_name, config_name):
    plan, _ = compile_pair(tmp_path, spec_name, config_name, is_renamed=False)
    renamed_plan, _ = compile_pair(tmp_path, spec_name, config_name, is_renamed=True)
    original = run(plan, SimEngine(plan), sim_requests())
    renamed = run(renamed_plan, SimEngine(renamed_plan), sim_requests())
    assert original[1], "no step ran"
    assert original[1] == renamed[1], "step compositions differ"


def test_a_name_dependent_runtime_fails_the_check(tmp_path, monkeypatch):
    """The old rule back: the prompt goes to an input named `text_inputs`, whatever its role."""
    take = PartitionState.take

    def take_by_name(self, name, source):
        return take(self, name, PROMPT if name == "text_inputs" else (OUTSIDE if source == PROMPT else source))

    monkeypatch.setattr(PartitionState, "take", take_by_name)
    original, renamed = torch_runs(tmp_path, "llama")
    with pytest.raises(AssertionError):
        assert_same(tmp_path, original, renamed)
