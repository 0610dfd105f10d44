"""The console scripts import their command inside a guard (mstar/cli/launch.py): a Ctrl-C while
the imports load is one line and exit 130, not a traceback."""
from __future__ import annotations

import signal

import pytest

from mstar.cli import launch


@pytest.mark.parametrize("script, name", [(launch.mstar, "mstar"), (launch.mstarc, "mstarc")])
def test_an_interrupt_while_the_command_loads_is_one_line(capsys, monkeypatch, script, name):
    def interrupted(module):
        raise KeyboardInterrupt

    monkeypatch.setattr(launch, "import_module", interrupted)
    assert script() == 128 + signal.SIGINT
    err = capsys.readouterr().err
    assert err == f"{name}: interrupted before the command started; nothing was written\n"


def test_the_scripts_run_their_commands(capsys, monkeypatch):
    monkeypatch.setattr("sys.argv", ["mstarc", "--version"])
    try:
        code = launch.mstarc()
    except SystemExit as done:
        code = done.code
    assert code in (0, None) and capsys.readouterr().out.startswith("mstarc ")


def test_an_interrupt_inside_an_mstarc_command_is_one_line_and_exit_130(capsys, monkeypatch):
    """It exited 1 with no output (KeyboardInterrupt was caught as an input error), or, when the
    interrupt struck inside a library's import (pydantic building a schema wraps it in its own
    error), as `mstarc: internal error (...)`."""
    import os

    from mstar.cli import mstarc

    def interrupted(args):
        raise KeyboardInterrupt

    def interrupted_inside_a_library(args):
        try:
            os.kill(os.getpid(), signal.SIGINT)  # Python's handler raises at the next bytecode
            signal.pthread_sigmask(signal.SIG_BLOCK, [])  # a call to let it land here
        except KeyboardInterrupt as error:
            raise RuntimeError("Error calling __set_name__ on 'Field' instance") from error
        raise AssertionError("no interrupt")

    for command in (interrupted, interrupted_inside_a_library):
        monkeypatch.setattr(mstarc, "cmd_check", command)
        assert mstarc.main(["check", "specs/llama.mw"]) == 128 + signal.SIGINT
        err = capsys.readouterr().err
        assert err == "mstarc: interrupted; a file it writes is replaced whole or not at all\n", err
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # put back


def test_an_interrupt_while_the_interpreter_exits_ends_it_by_sigint_without_a_traceback(tmp_path):
    """After `mstar run` said its last line, a Ctrl-C during the interpreter's exit (torch's
    finalizers, an exit callback here) raised KeyboardInterrupt there: its traceback on stderr."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    script = tmp_path / "exiting.py"
    script.write_text(
        "import os, signal, sys, time, weakref\n"
        "from mstar.cli import launch\n"
        "class Held: pass\n"
        "held = Held()\n"
        "def main():\n"
        "    weakref.finalize(held, lambda: (os.kill(os.getpid(), signal.SIGINT), time.sleep(1)))\n"
        "    return 0\n"
        "launch.import_module = lambda name: type('Command', (), {'main': staticmethod(main)})\n"
        "sys.exit(launch.mstar())\n")
    root = Path(__file__).resolve().parents[2]
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=60,
                          env={**os.environ, "PYTHONPATH": str(root)})
    assert "Traceback" not in done.stderr and "KeyboardInterrupt" not in done.stderr, done.stderr
    assert done.returncode == -signal.SIGINT
