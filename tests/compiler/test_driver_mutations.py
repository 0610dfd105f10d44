"""Whole-pipeline robustness: mutated specs and configs give a plan or diagnostics, never an
exception (the passes check; lowering and the glue must cope with whatever the checks accept)."""
import shutil
from pathlib import Path

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mstar.compiler.driver import compile_spec
from mstar.lang.diagnostics import Diagnostics

ROOT = Path(__file__).resolve().parents[2]
PAIRS = [("orpheus", "orpheus_pd_disaggregated"), ("qwen3_omni", "qwen3omni_thinker_tp2"),
         ("bagel", "bagel"), ("qwen3_5", "qwen3_5")]


@st.composite
def mutations(draw):
    spec, config = draw(st.sampled_from(PAIRS))
    target = draw(st.sampled_from(["spec", "config"]))
    path = ROOT / ("specs" if target == "spec" else "configs") / (f"{spec}.mw" if target == "spec" else f"{config}.yaml")
    lines = path.read_text().splitlines()
    for _ in range(draw(st.integers(1, 3))):
        if not lines:
            break
        i = draw(st.integers(0, len(lines) - 1))
        j = draw(st.integers(0, len(lines) - 1))
        op = draw(st.sampled_from(["delete", "duplicate", "swap"]))
        if op == "delete":
            del lines[i]
        elif op == "duplicate":
            lines.insert(j, lines[i])
        else:
            lines[i], lines[j] = lines[j], lines[i]
    return spec, config, target, "\n".join(lines) + "\n"


@settings(max_examples=40, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(case=mutations())
def test_mutated_inputs_never_raise(case, tmp_path_factory):
    spec, config, target, text = case
    repo = tmp_path_factory.mktemp("repo")
    (repo / "specs").mkdir()
    (repo / "configs").mkdir()
    shutil.copy(ROOT / "specs" / f"{spec}.mw", repo / "specs")
    shutil.copy(ROOT / "configs" / f"{config}.yaml", repo / "configs")
    path = repo / "specs" / f"{spec}.mw" if target == "spec" else repo / "configs" / f"{config}.yaml"
    path.write_text(text)
    diags = Diagnostics()
    result = compile_spec(repo / "specs" / f"{spec}.mw", repo / "configs" / f"{config}.yaml", diags)
    assert (result is None) == diags.has_errors
    diags.render()  # rendering never raises either
