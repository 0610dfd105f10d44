"""The `mstar` and `mstarc` console scripts: each command's module is imported inside a guard, so
a Ctrl-C while its imports load (numpy, the runtime: a few hundred ms) ends with one line and exit
130, not the import's traceback (an audit: `mstar run` or `mstar bench` interrupted in its first
0.1-0.3 s printed a traceback through numpy's import). `python3 -m mstar.cli.mstar` imports the
module itself, outside any guard.

Once the command returned, its outcome is written and said: a Ctrl-C while the interpreter exits
(torch's finalizers run a while) ends the process by SIGINT (a shell sees 130), where Python's
handler raised KeyboardInterrupt inside an exit callback and printed its traceback after the
command's last line (`exit_by_signals`)."""
from __future__ import annotations

import atexit
import os
import signal
import sys
from importlib import import_module
from typing import Callable


def _launch(module: str, name: str) -> int:
    try:
        command = import_module(module).main
    except KeyboardInterrupt:
        print(f"{name}: interrupted before the command started; nothing was written", file=sys.stderr)
        return 128 + signal.SIGINT
    return finish(command)


def finish(command: Callable[[], int]) -> int:
    """Run the command, then `exit_by_signals`. The command says every interrupt of its own; a
    KeyboardInterrupt that reaches here came after its outcome was said (between the command's
    handlers going and `exit_by_signals`: a traceback after `mstar run`'s last line), so the
    process ends by SIGINT, as the module docstring says."""
    try:
        code = command()
        exit_by_signals()
    except KeyboardInterrupt:
        die_by_sigint()
    return code


def die_by_sigint() -> None:
    """End the process by SIGINT's default action (a shell sees 130), with no traceback."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    os.kill(os.getpid(), signal.SIGINT)
    os._exit(128 + signal.SIGINT)  # (not reached: the signal ends the process)


def exit_by_signals() -> None:
    """At exit, before the exit callbacks registered so far (they run last first), SIGINT takes its
    default action again (see the module docstring)."""
    atexit.register(signal.signal, signal.SIGINT, signal.SIG_DFL)


def mstar() -> int:
    return _launch("mstar.cli.mstar", "mstar")


def mstarc() -> int:
    return _launch("mstar.cli.mstarc", "mstarc")
