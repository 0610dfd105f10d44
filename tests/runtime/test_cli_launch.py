"""The console scripts import their command inside a guard (mstar/cli/launch.py): a Ctrl-C while
the imports load is one line and exit 130, not a traceback."""
from __future__ import annotations

import signal

import pytest

from mstar.cli import launch

pytestmark = pytest.mark.usefixtures("ordinary_signals")  # conftest.py: signals not inherited ignored


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


def test_an_interrupt_between_the_command_and_its_exit_ends_by_sigint_without_a_traceback(tmp_path):
    """After the command returned (its outcome said) and before `exit_by_signals` took over, a
    Ctrl-C was a KeyboardInterrupt outside every guard: a traceback after `mstar run`'s last line."""
    import subprocess
    import sys

    script = tmp_path / "late.py"
    script.write_text(
        "import os, signal\n"
        "from mstar.cli import launch\n"
        "def command():\n"
        "    print('the outcome', flush=True)\n"
        "    return 0\n"
        "def late():\n"
        "    os.kill(os.getpid(), signal.SIGINT)  # Python's handler raises at the next bytecode\n"
        "    signal.pthread_sigmask(signal.SIG_BLOCK, [])\n"
        "launch.exit_by_signals = late\n"
        "launch.finish(command)\n")
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert done.returncode == -signal.SIGINT and done.stdout == "the outcome\n", done
    assert "Traceback" not in done.stderr, done.stderr


def test_a_second_signal_while_the_first_is_said_is_ignored(capsys):
    """Two Ctrl-Cs 1 ms apart while `mstar run` started: the second raised another _Interrupted
    while the command said the first, a traceback and exit 1 (the handler raises one at most)."""
    from mstar.cli.mstar import _Interrupted, _Signals

    with _Signals() as signals:
        with pytest.raises(_Interrupted):
            signals._handle(signal.SIGINT, None)
        signals._handle(signal.SIGINT, None)  # the echo: nothing raised
        signals.begin_writing()  # the run's end: a later signal follows the writing rules again
        signals._handle(signal.SIGINT, None)
        assert signals.is_ending
