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
