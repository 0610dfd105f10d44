"""A run clock for tests that compare two runs step by step: each read moves it one tick and an
idle wait jumps it, so both runs (whatever their host speed) schedule the same steps."""
from __future__ import annotations


class TickClock:
    def __init__(self, tick: float = 1e-5) -> None:
        self.time = 0.0
        self.tick = tick

    def now(self) -> float:
        self.time += self.tick
        return self.time

    def sleep(self, seconds: float) -> None:
        self.time += max(seconds, 0.0)
