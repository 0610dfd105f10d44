"""MW408 judges each rank by the capture families its plan holds: the check's estimate per rank
(check_combine.worker_captures) is the plan's `capture_memory_bytes` for that worker.

Under a prefill/decode split no rank runs two walks of a combined walk, so lowering gives each
walk its own key and no rank holds the combined walk's family; the check once counted that family
on both ranks anyway, and refused a budget the plan fits (72 MiB estimated where 35 MiB is held)."""
from pathlib import Path

import pytest
from compiler_helpers import COLOCATED, PD_SPLIT, TP2, TTS_SPEC, blank_header, deployment_from, spec_from

from mstar.compiler import check_combine, lower, regen
from mstar.compiler.lower_keys import placed_combines
from mstar.compiler.driver import compile_spec
from mstar.lang.diagnostics import Diagnostics

ROOT = Path(__file__).resolve().parents[2]


def _estimates(spec, deployment) -> dict[int, int]:
    return {rank: sum(f.num_bytes for f in families)
            for rank, families in check_combine.worker_captures(spec, deployment).items()}


@pytest.mark.parametrize("config", [COLOCATED, PD_SPLIT, TP2], ids=["colocated", "pd_split", "tp2"])
def test_the_checked_estimate_is_what_each_worker_holds(config):
    spec, deployment = spec_from(TTS_SPEC), deployment_from(config)
    plan = lower.run(spec, deployment, blank_header())
    assert _estimates(spec, deployment) == {w.rank: w.capture_memory_bytes for w in plan.workers}


def test_a_pd_split_rank_holds_no_combined_family():
    spec, deployment = spec_from(TTS_SPEC), deployment_from(PD_SPLIT)
    names = {rank: sorted(f.name for f in families)
             for rank, families in check_combine.worker_captures(spec, deployment).items()}
    assert names == {0: ["LLM:prefill", "codec:chunk"], 1: ["LLM:decode"]}


def test_a_budget_the_pd_split_ranks_fit_passes():
    spec = spec_from(TTS_SPEC)
    held = max(w.capture_memory_bytes for w in lower.run(spec, deployment_from(PD_SPLIT), blank_header()).workers)
    budget_mb = held / 2**20 + 1  # room for what a rank holds, not for the combined family too
    diags = Diagnostics()
    check_combine.run(spec, deployment_from(PD_SPLIT + f"capture_memory_budget_mb: {budget_mb}\n"), diags)
    assert [d.code for d in diags.items] == []


def test_every_checked_in_config_is_judged_by_what_its_plan_holds(tmp_path):
    diags = Diagnostics()
    for spec_path, config_path in regen.config_pairs(ROOT, diags):
        result = compile_spec(spec_path, config_path, diags, tmp_path / f"{config_path.stem}.plan")
        assert result is not None, diags.render()
        assert _estimates(result.spec, result.deployment) == {
            w.rank: w.capture_memory_bytes for w in result.plan.workers}, config_path.name


def test_a_combined_key_exists_where_two_of_its_walks_run():
    llm = next(n for n in spec_from(TTS_SPEC).nodes if n.name == "LLM")
    assert [(c.name, members) for c, members in placed_combines(llm, ["decode", "prefill"])] == [
        ("mixed", ["prefill", "decode"])]  # the combine's order, not the worker's
    assert placed_combines(llm, ["decode"]) == []  # its partner runs on another rank


def test_a_combined_walk_without_a_cap_is_warned_of_only_where_its_mixed_steps_are_built():
    """MW436: TTS_SPEC's combine has no cap, so a mixed step takes prefill's 8 where decode alone takes
    32. Colocated, a rank builds those steps: warned. Under a prefill/decode split no rank does."""
    for config, codes in ((COLOCATED, ["MW436"]), (PD_SPLIT, [])):
        diags = Diagnostics()
        check_combine.run(spec_from(TTS_SPEC), deployment_from(config), diags)
        assert [d.code for d in diags.items] == codes, config
