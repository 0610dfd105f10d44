"""The run loop's time: wall time for a real engine, simulated time for a simulated one.

In: the engine's `EngineCaps` (is_simulated, clock) and an optional clock that overrides it.
Out: a `RunClock`:

    clock()                      now, in seconds of the run clock
    finish_time(start, elapsed)  when a step launched at `start` completes: start + elapsed on a
                                 simulated clock (elapsed is modelled), now on a wall clock (the
                                 engine already waited for the step, so workers take turns)
    advance_to(when)             simulated: the clock jumps to `when`; wall: nothing
    sleep_until(when, now, sleep)  wait idle until `when` (at least MIN_WAIT_S past `now`, at most
                                 MAX_WAIT_S at once: the loop looks again, and sleeps again);
                                 `sleep(seconds)` waits (time.sleep by default; an online
                                 source wakes early when a request arrives)
    can_jump_ahead               simulated: an event before the next completion happens first
"""
from __future__ import annotations

import time
from typing import Callable, Optional

from mstar.runtime.step import EngineCaps

MIN_WAIT_S = 1e-4  # shortest idle wait when nothing can run yet
MAX_WAIT_S = 0.1  # longest idle sleep at once: the run loop sees a Driver.stop() this soon


class ClockError(ValueError):
    """A simulated engine whose clock cannot be moved."""


class RunClock:
    def __init__(self, caps: EngineCaps, clock: Optional[Callable[[], float]] = None):
        self.now = clock or caps.clock or time.monotonic
        self.can_jump_ahead = caps.is_simulated
        if self.can_jump_ahead and not callable(getattr(self.now, "advance_to", None)):
            raise ClockError("a simulated engine needs a clock with advance_to(when): the run loop moves it")

    def __call__(self) -> float:
        return self.now()

    def finish_time(self, start_s: float, elapsed_s: float) -> float:
        return start_s + elapsed_s if self.can_jump_ahead else self.now()

    def advance_to(self, when: float) -> None:
        if self.can_jump_ahead:
            self.now.advance_to(when)  # type: ignore[attr-defined]

    def sleep_until(self, when: float, now: float, sleep: Callable[[float], None] = time.sleep) -> None:
        # A deadline already past that released nothing: move on a little rather than spin.
        when = max(when, now + MIN_WAIT_S)
        if self.can_jump_ahead:
            self.advance_to(when)
        else:
            sleep(min(MAX_WAIT_S, max(0.0, when - self.now())))
