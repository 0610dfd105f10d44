"""mstarc commands: exit codes (0 ok, 1 input errors, 2 usage), outputs, no tracebacks."""
import shutil
import subprocess
import sys
import xml.etree.ElementTree as ElementTree
from pathlib import Path

import pytest

from mstar.cli.mstarc import main

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture()
def repo(tmp_path):
    """A copy of specs/ and configs/ (llama and orpheus only) in a scratch repository."""
    (tmp_path / "specs").mkdir()
    (tmp_path / "configs").mkdir()
    for name in ("llama", "orpheus"):
        shutil.copy(ROOT / "specs" / f"{name}.mw", tmp_path / "specs")
    for config in ("llama", "orpheus", "orpheus_pd_disaggregated"):
        shutil.copy(ROOT / "configs" / f"{config}.yaml", tmp_path / "configs")
    return tmp_path


def test_compile_default_paths_and_explain(repo, capsys):
    assert main(["compile", str(repo / "specs" / "orpheus.mw")]) == 0
    plan = repo / "generated" / "orpheus.plan"
    assert plan.is_file() and (repo / "generated" / "orpheus_glue.py").is_file()
    capsys.readouterr()
    assert main(["explain", str(plan)]) == 0
    out = capsys.readouterr().out
    assert "LLM:mixed" in out and "decode_loop" in out and "worker rank 1" in out


def test_compile_twice_gives_identical_bytes(repo):
    spec, config = repo / "specs" / "orpheus.mw", repo / "configs" / "orpheus_pd_disaggregated.yaml"
    outputs = []
    for name in ("a", "b"):
        out = repo / name / "x.plan"
        assert main(["compile", str(spec), "--config", str(config), "-o", str(out)]) == 0
        outputs.append((out.read_bytes(), (repo / name / "x_glue.py").read_bytes()))
    assert outputs[0] == outputs[1]


def test_input_errors_exit_1_with_diagnostics(repo, capsys):
    assert main(["compile", str(repo / "specs" / "missing.mw")]) == 1
    assert "error[MW500]: spec file not found" in capsys.readouterr().err
    broken = repo / "specs" / "broken.mw"
    broken.write_text("model broken\nnode X kv {\n")
    assert main(["compile", str(broken)]) == 1
    err = capsys.readouterr().err
    assert "broken.mw:" in err and "error[MW0" in err and "Traceback" not in err
    assert main(["check", str(repo / "specs" / "llama.mw"), "--config", str(repo / "nope.yaml")]) == 1
    assert "error[MW301]" in capsys.readouterr().err
    # a spec whose default config does not exist
    (repo / "configs" / "llama.yaml").unlink()
    assert main(["check", str(repo / "specs" / "llama.mw")]) == 1
    assert "llama.yaml" in capsys.readouterr().err


@pytest.mark.parametrize("limit", ["MAX_PLAN_BYTES", "MAX_GLUE_BYTES"])
def test_an_output_past_what_the_runtime_reads_is_mw501_and_nothing_is_written(repo, capsys, monkeypatch, limit):
    """The plan and its glue must be within the sizes load_plan reads (mstar/files.py): a spec whose
    outputs would pass them is refused at compile time, not by `mstar run` afterwards. The limits are
    lowered here: a spec of 1 MiB that compiles to 16 MiB is large to build in a test."""
    from mstar.compiler import driver

    monkeypatch.setattr(driver, limit, 4096)
    assert main(["compile", str(repo / "specs" / "llama.mw")]) == 1
    err = capsys.readouterr().err
    assert "error[MW501]" in err and "past the 4,096 that `mstar run` reads" in err and "Traceback" not in err
    assert not (repo / "generated").exists()


def test_check_writes_nothing(repo, capsys):
    assert main(["check", str(repo / "specs" / "llama.mw")]) == 0
    assert "ok" in capsys.readouterr().out
    assert not (repo / "generated").exists()


def test_explain_refuses_stale_plan(repo, capsys):
    assert main(["compile", str(repo / "specs" / "llama.mw")]) == 0
    spec = repo / "specs" / "llama.mw"
    spec.write_text(spec.read_text() + "\n")
    assert main(["explain", str(repo / "generated" / "llama.plan")]) == 1
    err = capsys.readouterr().err
    assert "stale" in err and "mstarc compile" in err
    assert main(["explain", "--no-verify", str(repo / "generated" / "llama.plan")]) == 0


@pytest.mark.parametrize("argv", [[], ["nonsense"], ["compile"], ["fmt", "x.mw", "--check", "--write"],
                                  ["graph", "x.mw"], ["bench", "--runs", "x"]])
def test_usage_errors_exit_2(argv):
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2


def test_fmt_check_and_write(repo, capsys):
    spec = repo / "specs" / "llama.mw"
    assert main(["fmt", "--write", str(spec)]) == 0
    assert main(["fmt", "--check", str(spec)]) == 0
    canonical = spec.read_text()
    spec.write_text(canonical.replace("\n", "\n\n", 3))
    assert main(["fmt", "--check", str(spec)]) == 1
    capsys.readouterr()
    assert main(["fmt", str(spec)]) == 0
    assert capsys.readouterr().out == canonical
    assert main(["fmt", str(repo / "specs" / "missing.mw")]) == 1


def test_fmt_drops_a_byte_order_mark(repo, capsys):
    """The canonical form has no BOM (the readers drop one): `--check` called a spec with one
    canonical, and `--write` kept it."""
    spec = repo / "specs" / "llama.mw"
    assert main(["fmt", "--write", str(spec)]) == 0
    canonical = spec.read_bytes()
    spec.write_bytes(b"\xef\xbb\xbf" + canonical)
    assert main(["fmt", "--check", str(spec)]) == 1
    assert main(["fmt", "--write", str(spec)]) == 0 and spec.read_bytes() == canonical
    spec.write_bytes(b"\xff\xfe" + canonical)
    assert main(["fmt", str(spec)]) == 1 and "is not UTF-8 text (byte 0)" in capsys.readouterr().err


def test_regen_check_write_and_orphans(repo, capsys):
    assert main(["regen", "--check", "--root", str(repo)]) == 1
    assert "stale: " in capsys.readouterr().err
    assert main(["regen", "--root", str(repo)]) == 0
    generated = sorted(p.name for p in (repo / "generated").iterdir())
    assert generated == ["llama.plan", "llama_glue.py", "orpheus.plan", "orpheus_glue.py",
                         "orpheus_pd_disaggregated.plan", "orpheus_pd_disaggregated_glue.py"]
    assert main(["regen", "--check", "--root", str(repo)]) == 0
    (repo / "generated" / "old.plan").write_text("{}")
    (repo / "configs" / "llama.yaml").write_text((repo / "configs" / "llama.yaml").read_text() + "\n# changed\n")
    capsys.readouterr()
    assert main(["regen", "--check", "--root", str(repo)]) == 1
    err = capsys.readouterr().err
    assert "old.plan (orphan)" in err and "llama.plan (differs)" in err
    assert main(["regen", "--root", str(repo)]) == 0
    assert not (repo / "generated" / "old.plan").exists()
    assert main(["regen", "--check", "--root", str(repo)]) == 0


def test_regen_reports_config_without_spec(repo, capsys):
    (repo / "configs" / "ghost.yaml").write_text("model: ghost\nmax_seq_len: 8\nnode_groups:\n  - node_names: [X]\n    "
                                                 "ranks: [0]\n")
    assert main(["regen", "--check", "--root", str(repo)]) == 1
    assert "names model 'ghost'" in capsys.readouterr().err


def test_graph_writes_svg(repo):
    out = repo / "pictures" / "orpheus.svg"
    assert main(["graph", str(repo / "specs" / "orpheus.mw"), "-o", str(out)]) == 0
    root = ElementTree.parse(out).getroot()
    text = " ".join(t.text or "" for t in root.iter("{http://www.w3.org/2000/svg}text"))
    for expected in ("walk prefill", "walk decode", "walk snac_chunk", "loop decode_loop",
                     "combine mixed = prefill + decode", "(loop-back)"):
        assert expected in text


def test_no_traceback_and_no_torch_in_a_real_process(repo):
    """The console entry point as a process: a broken input exits 1 without a traceback, and
    the compiler never imports torch (it would cost seconds per compile)."""
    code = ("import sys; from mstar.cli.mstarc import main; rc = main(sys.argv[1:]); "
            "assert 'torch' not in sys.modules and 'matplotlib' not in sys.modules, 'heavy import'; "
            "sys.exit(rc)")
    good = subprocess.run([sys.executable, "-c", code, "compile", str(repo / "specs" / "llama.mw")],
                          capture_output=True, text=True, cwd=ROOT)
    assert good.returncode == 0, good.stderr
    (repo / "specs" / "bad.mw").write_bytes(b"\xff\xfe model")
    bad = subprocess.run([sys.executable, "-m", "mstar.cli.mstarc", "compile", str(repo / "specs" / "bad.mw")],
                         capture_output=True, text=True, cwd=ROOT)
    assert bad.returncode == 1 and "Traceback" not in bad.stderr and "not UTF-8" in bad.stderr


def test_output_folder_and_unwritable_output(repo, capsys):
    out_dir = repo / "out"
    out_dir.mkdir()
    assert main(["compile", str(repo / "specs" / "llama.mw"), "-o", str(out_dir)]) == 0
    assert (out_dir / "llama.plan").is_file() and (out_dir / "llama_glue.py").is_file()
    blocker = repo / "blocker"
    blocker.write_text("a file, not a folder")
    assert main(["compile", str(repo / "specs" / "llama.mw"), "-o", str(blocker / "x.plan")]) == 1
    assert "mstarc: cannot write" in capsys.readouterr().err


@pytest.mark.parametrize("output", ["generated/llama_glue.py", "x.txt", "plan", ""])
def test_a_plan_path_ends_in_plan(repo, capsys, output):
    """`-o generated/llama_glue.py` wrote a plan over llama's glue, then llama_glue_glue.py beside it;
    `-o x.txt` a plan regen never sees. Refused as usage errors, nothing written."""
    (repo / "generated").mkdir()
    glue = repo / "generated" / "llama_glue.py"
    glue.write_text("# the glue\n")
    before = sorted(p.name for p in repo.rglob("*"))
    target = str(repo / output) if output else ""
    try:
        status = main(["compile", str(repo / "specs" / "llama.mw"), "-o", target])
    except SystemExit as stopped:  # argparse's usage error: an empty -o
        status = stopped.code
    assert status == 2
    err = capsys.readouterr().err
    # an empty -o is path_arg's usage error (it said "-o needs a plan path (NAME.plan) or a directory")
    assert ("does not end in .plan" in err or "argument -o/--output: needs a path, got an empty one" in err) and \
        "Traceback" not in err
    assert sorted(p.name for p in repo.rglob("*")) == before and glue.read_text() == "# the glue\n"


def test_init_plan_out_ends_in_plan(repo, capsys):
    """Checked before init writes the spec and the deployment."""
    checkpoint = repo / "ckpt"
    checkpoint.mkdir()
    (checkpoint / "config.json").write_text('{"architectures": ["LlamaForCausalLM"]}')
    outputs = ["-o", str(repo / "s.mw"), "--config-out", str(repo / "c.yaml"), "--plan-out", str(repo / "p.txt")]
    assert main(["init", "--from-checkpoint", str(checkpoint), *outputs]) == 2
    assert "--plan-out" in capsys.readouterr().err
    assert not any((repo / name).exists() for name in ("s.mw", "c.yaml", "p.txt"))


@pytest.mark.parametrize("command, replaced", [
    (["compile", "{spec}", "--config", "{config}", "-o", "{spec}"], "spec"),  # the plan over its own spec
    (["compile", "{spec}", "--config", "{config}", "-o", "{config}"], "config"),  # ... over the deployment
    (["compile", "{spec}", "--config", "{config}", "-o", "{link}"], "spec"),  # ... through a link to it
    (["graph", "{spec}", "-o", "{spec}"], "spec"),  # the picture over the spec
], ids=["plan_over_spec", "plan_over_config", "plan_over_a_link_to_the_spec", "svg_over_spec"])
def test_an_output_that_is_an_input_is_refused_and_nothing_is_written(repo, capsys, command, replaced):
    """Each exited 0 having replaced the input (a spec named x.plan or x.svg)."""
    suffix = ".svg" if command[0] == "graph" else ".plan"
    spec, config, link = repo / "specs" / f"same{suffix}", repo / "configs" / "same.plan", repo / "link.plan"
    shutil.copy(repo / "specs" / "llama.mw", spec)
    shutil.copy(repo / "configs" / "llama.yaml", config)
    link.symlink_to(spec if replaced == "spec" else config)
    before = {p: p.read_bytes() for p in (spec, config)}
    assert main([a.format(spec=spec, config=config, link=link) for a in command]) == 2
    err = capsys.readouterr().err
    assert "writing it would replace that input" in err and "Traceback" not in err
    assert {p: p.read_bytes() for p in (spec, config)} == before


def test_init_never_writes_over_a_checkpoint_file(repo, capsys):
    """`--config-out CK/config.json --force` replaced the checkpoint's config.json with the
    deployment; the next init from there failed. Init's own kinds (.mw, .yaml, .plan) may be
    replaced there with --force."""
    checkpoint = repo / "ckpt"
    checkpoint.mkdir()
    config = '{"architectures": ["LlamaForCausalLM"]}'
    (checkpoint / "config.json").write_text(config)
    outputs = ["-o", str(checkpoint / "t.mw"), "--config-out", str(checkpoint / "config.json"), "--force"]
    assert main(["init", "--from-checkpoint", str(checkpoint), *outputs]) == 2
    assert "is a file of the checkpoint" in capsys.readouterr().err
    assert (checkpoint / "config.json").read_text() == config and not (checkpoint / "t.mw").exists()


def test_bench_json_smoke(repo, capsys):
    import json

    for extra in ("orpheus.yaml", "orpheus_pd_disaggregated.yaml"):
        (repo / "configs" / extra).unlink()
    (repo / "specs" / "orpheus.mw").unlink()
    assert main(["bench", "--json", "--runs", "1", "--root", str(repo)]) == 0
    report = json.loads(capsys.readouterr().out)
    (pair,) = report["pairs"]
    assert pair["config"] == "llama" and pair["process_s"] > 0 and pair["own_work_s"] > 0
    assert "lower" in pair["own_work_per_pass_s"]


def test_regen_outside_a_repository(tmp_path, capsys):
    assert main(["regen", "--check", "--root", str(tmp_path)]) == 1
    assert "no configs/ and no specs/" in capsys.readouterr().err


def test_a_spec_named_from_its_own_folder_finds_the_repository(repo, monkeypatch, capsys):
    """`mstarc compile llama.mw` run inside specs/ takes ../configs/llama.yaml and writes
    ../generated/ (the default paths took `.` for the folder above the spec's: the deployment was
    not found, and the plan went to specs/generated/)."""
    monkeypatch.chdir(repo / "specs")
    assert main(["check", "llama.mw"]) == 0
    assert main(["compile", "llama.mw"]) == 0
    assert (repo / "generated" / "llama.plan").is_file() and not (repo / "specs" / "generated").exists()


def test_a_leading_byte_order_mark_is_dropped(repo, capsys):
    """docs/limits.md: a spec saved with a BOM compiles as without it (check, compile and graph
    refused it with MW001 while fmt took it)."""
    spec = repo / "specs" / "llama.mw"
    spec.write_bytes(b"\xef\xbb\xbf" + spec.read_bytes())
    assert main(["check", str(spec)]) == 0
    assert main(["graph", str(spec), "-o", str(repo / "llama.svg")]) == 0


@pytest.mark.parametrize("command", ["schema -o /dev/stdout", "explain generated/qwen3_omni.plan"])
def test_a_reader_that_goes_away_is_not_an_error(repo, command):
    """`mstarc schema -o /dev/stdout | head -1` was an internal error, `mstarc explain ... | head -1`
    exit 1 without a word: the closed pipe ends either quietly, exit 0."""
    line = f"{sys.executable} -m mstar.cli.mstarc {command} | head -1"
    done = subprocess.run(["bash", "-o", "pipefail", "-c", line], capture_output=True, text=True, cwd=ROOT)
    assert done.returncode == 0 and done.stdout.strip() and "internal error" not in done.stderr


def test_graph_names_a_dot_file_svg(repo):
    assert main(["graph", str(repo / "specs" / "llama.mw"), "-o", str(repo / ".svg")]) == 0
    assert (repo / ".svg").read_text().lstrip().startswith("<")


def test_schema_output_path(repo, capsys):
    with pytest.raises(SystemExit) as stopped:  # path_arg's usage error; it said "schema -o needs a file path"
        main(["schema", "-o", ""])
    assert stopped.value.code == 2 and "argument -o/--output: needs a path, got an empty one" in capsys.readouterr().err
    assert main(["schema", "-o", str(repo / "new" / "folder" / "schema.json")]) == 0
    assert (repo / "new" / "folder" / "schema.json").read_text().startswith("{")
