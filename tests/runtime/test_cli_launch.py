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
