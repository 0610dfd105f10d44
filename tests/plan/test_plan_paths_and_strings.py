"""Plans and specs an audit of `mstarc` and plan loading found reaching an internal error or a plan
no run takes: a plan compiled through a symbolic link (its glue beside the link, named
"../lnk/x_glue.py": every run refused it), a lone-surrogate escape in a spec's string (`check`
said ok, `compile` raised UnicodeEncodeError) or in a plan's JSON, a header path the OS cannot name
(a raw OSError), and `mstarc bench --root` with a relative folder (a CalledProcessError)."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from mstar.cli.mstar import main as mstar_main
from mstar.cli.mstarc import main as mstarc_main
from mstar.plan.io import PlanError, content_hash, dump_plan, load_plan

ROOT = Path(__file__).resolve().parents[2]
LLAMA_SPEC, LLAMA_CONFIG = ROOT / "specs" / "llama.mw", ROOT / "configs" / "llama.yaml"


def test_a_plan_compiled_through_a_symlink_runs_by_either_path(tmp_path, capsys):
    (tmp_path / "other").mkdir()
    (tmp_path / "links").mkdir()
    real = tmp_path / "other" / "real.plan"
    real.write_text("")
    link = tmp_path / "links" / "x.plan"
    link.symlink_to(Path("..") / "other" / "real.plan")
    assert mstarc_main(["compile", str(LLAMA_SPEC), "--config", str(LLAMA_CONFIG), "-o", str(link)]) == 0
    assert link.is_symlink() and (tmp_path / "other" / "real_glue.py").is_file()
    assert load_plan(real).header.glue_path == "real_glue.py"
    for path in (link, real):
        assert mstar_main(["run", "--plan", str(path), "--engine", "sim", "--requests", "1", "--no-progress"]) == 0
    capsys.readouterr()


@pytest.mark.parametrize("escape, is_refused", [("\\ud800", True), ("\\udc00", True), ("\\ud83d\\ude00", False)])
def test_a_lone_surrogate_escape_in_a_spec_string_is_a_located_error(tmp_path, capsys, escape, is_refused):
    source = (ROOT / "specs" / "orpheus.mw").read_text()
    spec = tmp_path / "orpheus.mw"
    template = 'prompt_format "{voice}: {prompt}'
    spec.write_text(source.replace(template + '"', template + escape + '"'))
    config = ROOT / "configs" / "orpheus.yaml"
    for command in (["check"], ["compile", "-o", str(tmp_path / "o.plan")]):
        status = mstarc_main([command[0], str(spec), "--config", str(config), *command[1:]])
        err = capsys.readouterr().err
        assert "internal error" not in err
        if is_refused:
            assert status != 0 and "MW023" in err and "unpaired surrogate" in err and f"{spec}:15:" in err
        else:
            assert status == 0, err


def _rehashed_copy(tmp_path: Path, edit) -> Path:
    plan = load_plan(ROOT / "generated" / "orpheus.plan")
    edited = edit(plan)
    edited = edited.model_copy(update={"header": edited.header.model_copy(
        update={"content_sha256": content_hash(edited)})})
    path = tmp_path / "orpheus.plan"
    path.write_text(dump_plan(edited))
    shutil.copy(ROOT / "generated" / "orpheus_glue.py", tmp_path)
    return path


def test_a_plan_with_a_lone_surrogate_is_a_plan_error(tmp_path):
    path = tmp_path / "surrogate.plan"
    path.write_text((ROOT / "generated" / "orpheus.plan").read_text().replace(
        '"model": "orpheus"', '"model": "orpheus\\ud800"', 1))
    with pytest.raises(PlanError, match="unpaired surrogate"):
        load_plan(path)
    data = json.loads((ROOT / "generated" / "orpheus.plan").read_text())
    data["header"]["spec_path"] = "\ud800.mw"
    path.write_text(json.dumps(data))
    with pytest.raises(PlanError, match="unpaired surrogate"):
        load_plan(path)


def test_a_header_path_the_os_cannot_name_is_a_plan_error(tmp_path):
    path = _rehashed_copy(tmp_path, lambda plan: plan.model_copy(update={
        "header": plan.header.model_copy(update={"spec_path": "a" * 5000})}))
    with pytest.raises(PlanError, match="cannot read its spec file"):
        load_plan(path)
    assert load_plan(path, verify=False).header.model == "orpheus"


def test_mstarc_bench_takes_a_relative_root_and_names_the_configs_it_leaves_out(tmp_path, monkeypatch, capsys):
    root = tmp_path / "repo"
    (root / "specs").mkdir(parents=True)
    (root / "configs").mkdir()
    shutil.copy(LLAMA_SPEC, root / "specs")
    shutil.copy(LLAMA_CONFIG, root / "configs")
    (root / "configs" / "broken.yaml").write_text("model: nope\n")
    monkeypatch.chdir(tmp_path)
    assert mstarc_main(["bench", "--runs", "1", "--root", "repo", "--json"]) == 0
    captured = capsys.readouterr()
    assert [pair["config"] for pair in json.loads(captured.out)["pairs"]] == ["llama"]
    assert "broken.yaml" in captured.err and "left out" in captured.err and "internal error" not in captured.err
