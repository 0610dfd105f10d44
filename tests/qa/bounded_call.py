"""Run one in-process CLI call under a time and memory bound, for the bounded-input tests and the
file-reader fuzz target.

    call_bounded(main, argv, capsys) -> Outcome(status, text, seconds, peak_bytes)

The time bound (MAX_SECONDS) is a hang guard with the issue's figure, not a benchmark: a bounded
reader answers in milliseconds, an unbounded one runs for minutes. It is an interval timer that
raises in the call; the test-wide hang guard of tests/conftest.py (the same SIGALRM) is put back
afterwards with its remaining time. Memory is the peak of Python allocations (tracemalloc), which
is where an expanded alias bomb or a billion-entry tuple lives.
"""
from __future__ import annotations

import signal
import time
import tracemalloc
from dataclasses import dataclass

MAX_SECONDS = 2.0
MAX_PEAK_BYTES = 500 * 1024 * 1024


class CallTimeout(Exception):
    pass


@dataclass
class Outcome:
    status: int
    text: str
    seconds: float
    peak_bytes: int

    def assert_clean(self) -> None:
        """Exit 0, 1 or 2 with a message when not 0; no traceback, no internal error; in bounds."""
        assert "Traceback" not in self.text, self.text
        assert "internal error" not in self.text, self.text
        assert self.status in (0, 1, 2), (self.status, self.text)
        assert self.status == 0 or self.text.strip(), "an error exit without a message"
        assert self.seconds < MAX_SECONDS, f"{self.seconds:.1f} s"
        assert self.peak_bytes < MAX_PEAK_BYTES, f"{self.peak_bytes / 2**20:.0f} MiB"


def _on_timer(signum, frame):
    raise CallTimeout(f"the call ran past {MAX_SECONDS} s")


def warm_up() -> None:
    """Import what the commands import lazily and build the parser, outside any bound: an
    import interrupted by the timer would leave a half-made module behind."""
    import rich.console  # noqa: F401
    import yaml  # noqa: F401

    import mstar.compiler.driver  # noqa: F401
    import mstar.compiler.emit  # noqa: F401
    import mstar.compiler.glue  # noqa: F401
    import mstar.compiler.regen  # noqa: F401
    import mstar.lang.fmt  # noqa: F401
    import mstar.plan.explain  # noqa: F401
    from mstar.lang import parser

    parser.keywords()


def call_bounded(main, argv, capsys, seconds: float = MAX_SECONDS) -> Outcome:
    warm_up()
    capsys.readouterr()
    previous_handler = signal.signal(signal.SIGALRM, _on_timer)
    previous_left, _ = signal.setitimer(signal.ITIMER_REAL, seconds)
    tracemalloc.start()
    start = time.perf_counter()
    try:
        try:
            status = main([str(a) for a in argv])
        except SystemExit as stop:  # argparse usage errors
            status = stop.code
        elapsed = time.perf_counter() - start
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous_handler)
        if previous_left > 0:
            signal.setitimer(signal.ITIMER_REAL, max(0.01, previous_left - (time.perf_counter() - start)))
    captured = capsys.readouterr()
    return Outcome(status, captured.out + captured.err, elapsed, peak)
