"""The driver: pass order, stopping after a failing pass, default paths, the header."""
import shutil
from pathlib import Path

import pytest

from mstar.compiler.driver import compile_spec, default_config_path, default_plan_path, glue_path_for
from mstar.lang.diagnostics import Diagnostics
from mstar.plan.io import sha256_file

ROOT = Path(__file__).resolve().parents[2]


def _repo(tmp_path):
    (tmp_path / "specs").mkdir()
    (tmp_path / "configs").mkdir()
    shutil.copy(ROOT / "specs" / "llama.mw", tmp_path / "specs")
    shutil.copy(ROOT / "configs" / "llama.yaml", tmp_path / "configs")
    return tmp_path / "specs" / "llama.mw"


def test_default_paths():
    spec = Path("repo/specs/orpheus.mw")
    assert default_config_path(spec, "orpheus") == Path("repo/configs/orpheus.yaml")
    assert default_plan_path(spec, Path("repo/configs/orpheus_tp2.yaml")) == Path("repo/generated/orpheus_tp2.plan")
    assert glue_path_for(Path("g/orpheus_tp2.plan")) == Path("g/orpheus_tp2_glue.py")


def test_passes_run_in_order_and_header_records_inputs(tmp_path):
    spec = _repo(tmp_path)
    diags = Diagnostics()
    result = compile_spec(spec, None, diags)
    assert result is not None, diags.render()
    assert list(result.seconds_per_pass) == [
        "read", "parse", "resolve", "check_graph", "load_deployment", "check_deployment",
        "check_combine", "lower", "glue", "emit",
    ]
    assert result.plan_path == tmp_path / "generated" / "llama.plan"
    header = result.plan.header
    assert (header.spec_path, header.deployment_path, header.glue_path) == (
        "../specs/llama.mw", "../configs/llama.yaml", "llama_glue.py")
    assert header.hashes.spec == sha256_file(spec)
    assert header.hashes.deployment == sha256_file(tmp_path / "configs" / "llama.yaml")
    assert result.plan_text.startswith('{\n "_generated"')


def test_stops_after_the_pass_that_failed(tmp_path):
    spec = _repo(tmp_path)
    text = spec.read_text()
    # An unknown node is a resolve error (MW1xx): check_graph and later passes must not run.
    spec.write_text(text + "\nwalk extra { Ghost(x) -> y: client text }\n")
    diags = Diagnostics()
    assert compile_spec(spec, None, diags) is None
    codes = {d.code for d in diags.items if d.severity == "error"}
    assert codes and all(c.startswith("MW1") for c in codes), diags.render()


def test_deployment_errors_come_after_spec_checks(tmp_path):
    spec = _repo(tmp_path)
    config = tmp_path / "configs" / "llama.yaml"
    config.write_text(config.read_text() + "\nno_such_key: 1\n")
    diags = Diagnostics()
    assert compile_spec(spec, None, diags) is None
    assert [d.code for d in diags.items] == ["MW303"]
    assert "configs/llama.yaml:" in diags.render()


@pytest.mark.parametrize("old, new", [("max_seq_len:", "max_seq_length:"), ("  - node_names:", "  - node_name:")])
def test_a_misspelt_required_key_is_one_error_not_two(tmp_path, old, new):
    """A required key misspelt was reported twice: MW303 'unknown key ...; did you mean' and MW305
    'missing required key' for the key it names (a user's audit). The one error says both."""
    spec = _repo(tmp_path)
    config = tmp_path / "configs" / "llama.yaml"
    config.write_text(config.read_text().replace(old, new, 1))
    diags = Diagnostics()
    assert compile_spec(spec, None, diags) is None
    assert [d.code for d in diags.items] == ["MW303"], diags.render()
    assert f"did you mean '{old.strip(' -:')}'" in diags.render()
