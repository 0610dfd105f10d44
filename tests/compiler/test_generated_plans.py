"""The checked-in specs, configs and generated/: every pair compiles, and generated/ is current.

`test_generated_is_up_to_date` is what makes CI fail when someone edits a spec, a config, the
compiler or the glue templates without running `mstarc regen`.
"""
from pathlib import Path

import pytest

from mstar.compiler import regen
from mstar.compiler.driver import compile_spec
from mstar.lang.diagnostics import Diagnostics
from mstar.plan.io import load_plan

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = sorted((ROOT / "configs").glob("*.yaml"))


def _pair(config: Path) -> tuple[Path, Path]:
    diags = Diagnostics()
    pairs = dict((c, s) for s, c in regen.config_pairs(ROOT, diags))
    assert config in pairs, diags.render()
    return pairs[config], config


@pytest.mark.parametrize("config", CONFIGS, ids=lambda p: p.stem)
def test_every_config_compiles_and_is_deterministic(config, tmp_path):
    spec, config = _pair(config)
    texts = []
    for _ in range(2):
        diags = Diagnostics()
        result = compile_spec(spec, config, diags, tmp_path / f"{config.stem}.plan")
        assert result is not None, diags.render()
        assert not diags.items, diags.render()  # not even a warning in the checked-in pairs
        texts.append((result.plan_text, result.glue_text))
    assert texts[0] == texts[1]
    plan = result.plan
    assert plan.header.deployment == config.stem and plan.header.model == spec.stem
    placed = {pair for w in plan.workers for pair in w.placements}
    walks = {w.name: w for w in plan.walks}
    for walk in walks.values():
        for node in walk.nodes:
            assert f"{node}/{walk.name}" in placed  # every (node, walk) runs somewhere
    for worker in plan.workers:
        keys = {k.name: k for k in worker.keys}
        assert set(worker.walk_to_key) == set(worker.placements)
        for pair, key in worker.walk_to_key.items():
            assert pair.split("/")[1] in keys[key].walks
        for key in keys.values():
            assert [m.mask for m in key.mixtures] == list(range(1 << len(key.walks)))


def test_generated_is_up_to_date():
    diags = Diagnostics()
    expected = regen.expected_outputs(ROOT, diags)
    assert not diags.has_errors, diags.render()
    stale = regen.stale_files(ROOT, expected)
    assert not stale, "generated/ is stale, run `mstarc regen`: " + ", ".join(
        f"{s.path.relative_to(ROOT)} ({s.reason})" for s in stale
    )


@pytest.mark.parametrize("plan", sorted((ROOT / "generated").glob("*.plan")), ids=lambda p: p.stem)
def test_checked_in_plans_load_and_verify(plan):
    loaded = load_plan(plan)
    assert loaded.header.glue_path == f"{plan.stem}_glue.py"


def _compiled(config_name: str, tmp_path):
    spec, config = _pair(ROOT / "configs" / f"{config_name}.yaml")
    diags = Diagnostics()
    result = compile_spec(spec, config, diags, tmp_path / f"{config_name}.plan")
    assert result is not None, diags.render()
    return result.plan


def test_pd_disaggregated_configs_key_each_walk_on_its_worker(tmp_path):
    orpheus = _compiled("orpheus_pd_disaggregated", tmp_path)
    ranks = {w.rank: w.walk_to_key for w in orpheus.workers}
    assert ranks[0]["LLM/prefill"] == "LLM:prefill" and ranks[1] == {"LLM/decode": "LLM:decode"}
    colocated = _compiled("orpheus", tmp_path)
    assert colocated.workers[0].walk_to_key["LLM/prefill"] == "LLM:mixed"
    bagel = _compiled("bagel_pd_disaggregated", tmp_path)
    bagel_ranks = {w.rank: w.walk_to_key for w in bagel.workers}
    assert bagel_ranks[0]["LLM/prefill_text"] == "LLM:prefill_text"
    assert bagel_ranks[1]["LLM/decode"] == "LLM:decode"
