"""The conventions both commands keep: --version, --log-level (stdlib logging to stderr), the
package metadata, and triton needed only by the GPU path and the tests.

The triton check runs `mstar run` on the CPU torch engine and `mstarc regen --check` in a child
process where `import triton` fails (sys.modules["triton"] = None), which is what an install
without the `gpu` and `test` extras looks like to Python.
"""
from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from mstar.cli.mstar import main as mstar_main
from mstar.cli.mstarc import main as mstarc_main
from mstar.plan.schema import SCHEMA_VERSION

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def _default_log_level():
    """Each test here may change the mstar logger's level; later tests get the default back."""
    yield
    from mstar.cli.common import setup_logging

    setup_logging("warning")


@pytest.mark.parametrize("main, prog", [(mstar_main, "mstar"), (mstarc_main, "mstarc")])
def test_version(main, prog, capsys):
    with pytest.raises(SystemExit) as stop:
        main(["--version"])
    out = capsys.readouterr().out
    assert stop.value.code == 0
    assert out.startswith(f"{prog} 0.") and f"plan schema {SCHEMA_VERSION}" in out


def test_log_level_debug_shows_the_compiler_passes(capsys):
    assert mstarc_main(["check", str(ROOT / "specs/llama.mw")]) == 0
    assert "DEBUG" not in capsys.readouterr().err  # warning by default
    assert mstarc_main(["--log-level", "debug", "check", str(ROOT / "specs/llama.mw")]) == 0
    err = capsys.readouterr().err
    assert "DEBUG mstar.compiler.driver: pass parse:" in err and "pass check_combine:" in err
    mstarc_main(["--log-level", "warning", "check", str(ROOT / "specs/llama.mw")])
    assert "DEBUG" not in capsys.readouterr().err  # the level is set again on every call


def test_log_level_anywhere_on_the_mstar_command_line(capsys):
    plan = str(ROOT / "generated/llama.plan")
    code = mstar_main(["run", "--plan", plan, "--engine", "sim", "--requests", "2", "--log-level", "INFO"])
    err = capsys.readouterr().err
    assert code == 0
    assert f"INFO mstar.plan.io: loaded plan {plan}: model llama" in err and "INFO mstar.cli.mstar: engine sim" in err


@pytest.mark.parametrize("main", [mstar_main, mstarc_main])
def test_bad_log_level_is_a_usage_error(main, capsys):
    with pytest.raises(SystemExit) as stop:
        main(["--log-level", "loud", "check"])
    assert stop.value.code == 2 and "invalid choice: 'loud'" in capsys.readouterr().err


def test_package_metadata():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert project["license"] == "Apache-2.0" and project["license-files"] == ["LICENSE"]
    assert "Apache License" in (ROOT / "LICENSE").read_text() and "Version 2.0" in (ROOT / "LICENSE").read_text()
    assert any(c.startswith("Programming Language :: Python :: 3.1") for c in project["classifiers"])
    names = {extra: {d.split(">")[0].split("=")[0].strip() for d in deps}
             for extra, deps in project["optional-dependencies"].items()}
    assert "triton" in names["gpu"] and "triton" in names["test"]
    assert not any(d.startswith("triton") for d in project["dependencies"])


def test_cpu_run_and_regen_need_no_triton():
    blocked = "import sys; sys.modules['triton'] = None; sys.argv[0] = 'x'; "
    run = blocked + ("from mstar.cli.mstar import main; "
                     "sys.exit(main(['run', '--plan', 'generated/llama.plan', '--requests', '2', '--output-len', '4', "
                     "'--no-progress']))")
    regen = blocked + "from mstar.cli.mstarc import main; sys.exit(main(['regen', '--check']))"
    for code in (run, regen):
        result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
        assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    imports = subprocess.run([sys.executable, "-c", blocked + "import mstar.runtime.engine.gpu.kernels as k; "
                              "print(k.triton)"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert imports.stdout.strip() == "None", imports.stderr[-2000:]


def test_a_command_with_its_own_log_level_gets_it_back():
    from mstar.cli.common import take_global_options

    argv = ["--log-level", "debug", "serve", "--plan", "p"]
    assert take_global_options(argv, "mstar", own_log_level=("serve",)) == ["serve", "--plan", "p", "--log-level",
                                                                             "debug"]
    assert take_global_options(argv, "mstar") == ["serve", "--plan", "p"]
    assert take_global_options(["serve", "--plan", "p"], "mstar", own_log_level=("serve",)) == ["serve", "--plan", "p"]
