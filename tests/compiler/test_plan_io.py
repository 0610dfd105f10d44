"""dump_plan / load_plan: canonical text, refusal of stale, tampered or truncated plans."""
import json
import textwrap
from pathlib import Path

import pytest
from compiler_helpers import COLOCATED, TTS_SPEC, deployment_from, spec_from

from mstar.compiler import emit, lower
from mstar.plan.io import PlanError, dump_plan, load_plan, sha256_bytes
from mstar.plan.schema import COMPILER_VERSION, GENERATED_MARKER, SCHEMA_VERSION, Hashes, Header

GLUE = "# generated glue (test)\n"


@pytest.fixture()
def plan_file(tmp_path):
    """A repository-like tree: specs/tts.mw, configs/tts.yaml, generated/tts.plan + glue."""
    spec_text, config_text = textwrap.dedent(TTS_SPEC), textwrap.dedent(COLOCATED)
    for rel, text in (("specs/tts.mw", spec_text), ("configs/tts.yaml", config_text),
                      ("generated/tts_glue.py", GLUE)):
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    header = Header(
        compiler_version=COMPILER_VERSION, model="tts", deployment="tts",
        spec_path="../specs/tts.mw", deployment_path="../configs/tts.yaml", glue_path="tts_glue.py",
        hashes=Hashes(spec=sha256_bytes(spec_text.encode()), deployment=sha256_bytes(config_text.encode()), glue=""),
    )
    plan = emit.finish(lower.run(spec_from(TTS_SPEC), deployment_from(COLOCATED), header), GLUE)
    path = tmp_path / "generated" / "tts.plan"
    path.write_text(dump_plan(plan))
    return path


def test_round_trip_and_canonical_text(plan_file):
    text = plan_file.read_text()
    plan = load_plan(plan_file)
    assert dump_plan(plan) == text  # canonical: load + dump gives the same bytes
    assert text.startswith('{\n "_generated": ') and text.endswith("}\n")
    assert json.loads(text)["_generated"] == GENERATED_MARKER
    assert plan.header.hashes.glue == sha256_bytes(GLUE.encode())


def test_stale_spec_is_refused_with_recompile_command(plan_file):
    spec = plan_file.parent.parent / "specs" / "tts.mw"
    spec.write_text(spec.read_text() + "\n# edited\n")
    with pytest.raises(PlanError, match=r"stale: its spec file .*tts\.mw changed.*mstarc compile .*tts\.mw --config "
                                        r".*tts\.yaml -o .*tts\.plan"):
        load_plan(plan_file)
    load_plan(plan_file, verify=False)  # hashes of inputs are only checked with verify


def test_stale_deployment_and_glue(plan_file):
    glue = plan_file.with_name("tts_glue.py")
    glue.write_text(GLUE + "x = 1\n")
    with pytest.raises(PlanError, match="its glue file"):
        load_plan(plan_file)
    glue.unlink()
    with pytest.raises(PlanError, match="cannot read its glue file"):
        load_plan(plan_file)
    glue.write_text(GLUE)
    config = plan_file.parent.parent / "configs" / "tts.yaml"
    config.write_text(config.read_text().replace("4096", "8192"))
    with pytest.raises(PlanError, match="its deployment file"):
        load_plan(plan_file)


def test_hand_edit_is_refused(plan_file):
    text = plan_file.read_text()
    plan_file.write_text(text.replace('"cap": 32', '"cap": 33', 1))
    with pytest.raises(PlanError, match="edited after it was compiled"):
        load_plan(plan_file)


@pytest.mark.parametrize("cut", [2, 100, 5000])  # cut 1 only drops the final newline
def test_truncated_plan(plan_file, cut):
    text = plan_file.read_text()
    plan_file.write_text(text[: len(text) - cut])
    with pytest.raises(PlanError, match="not valid JSON"):
        load_plan(plan_file)


def test_schema_violation_and_versions(plan_file):
    data = json.loads(plan_file.read_text())
    data["workers"][0]["keys"][0]["mixtures"][1]["attention"] = "sideways"
    plan_file.write_text(json.dumps(data))
    with pytest.raises(PlanError, match=r"does not match the plan schema[\s\S]*attention"):
        load_plan(plan_file)
    data["header"]["schema_version"] = 99
    plan_file.write_text(json.dumps(data))
    with pytest.raises(PlanError, match="schema version 99"):
        load_plan(plan_file)
    data["header"]["schema_version"] = SCHEMA_VERSION
    data["header"]["compiler_version"] = "0.0.1"
    plan_file.write_text(json.dumps(data))
    with pytest.raises(PlanError, match="written by mstarc '0.0.1'"):
        load_plan(plan_file)


@pytest.mark.parametrize("text", ["", "[]", "{}", '{"header": 3}', "\xff\xfe"])
def test_not_a_plan(tmp_path, text):
    path = tmp_path / "x.plan"
    path.write_text(text, encoding="latin-1")
    with pytest.raises(PlanError):
        load_plan(path)


def test_missing_plan(tmp_path):
    with pytest.raises(PlanError, match="does not exist"):
        load_plan(tmp_path / "nope.plan")
    with pytest.raises(PlanError, match="cannot read"):
        load_plan(tmp_path)  # a directory


def test_plan_package_imports_neither_language_nor_compiler():
    import subprocess
    import sys

    code = ("import sys, mstar.plan.io, mstar.plan.explain; "
            "bad = [m for m in sys.modules if m.startswith(('mstar.lang', 'mstar.compiler', 'torch'))]; "
            "print(bad); sys.exit(1 if bad else 0)")
    root = Path(__file__).resolve().parents[2]
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=root)
    assert result.returncode == 0, result.stdout + result.stderr


def test_input_paths(plan_file):
    from mstar.plan.io import input_paths

    paths = input_paths(plan_file, load_plan(plan_file))
    assert paths["glue"] == plan_file.with_name("tts_glue.py")
    assert paths["spec"].resolve() == (plan_file.parent.parent / "specs" / "tts.mw").resolve()


def test_a_moved_plan_says_so_and_names_no_input_that_is_not_there(plan_file, tmp_path):
    """A plan copied away from its spec and deployment (its header's paths are relative to its own
    directory) is refused with why, and the recompile hint keeps SPEC and CONFIG as placeholders
    rather than paths that do not exist; a plan in place names them."""
    moved = tmp_path / "elsewhere" / "deeper" / "tts.plan"
    moved.parent.mkdir(parents=True)
    moved.write_text(plan_file.read_text())
    (moved.parent / "tts_glue.py").write_text(GLUE)
    with pytest.raises(PlanError, match=r"cannot read its spec file .*moved or copied away.*"
                                        r"recompile: mstarc compile SPEC --config CONFIG -o .*tts\.plan$"):
        load_plan(moved)
    spec = plan_file.parent.parent / "specs" / "tts.mw"
    spec.write_text(spec.read_text() + "\n# edited\n")
    with pytest.raises(PlanError, match=r"mstarc compile \S*specs/tts\.mw --config \S*configs/tts\.yaml"):
        load_plan(plan_file)
