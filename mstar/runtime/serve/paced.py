"""A simulated engine paced to the wall clock, for serving.

In: a simulated engine (`EngineCaps.is_simulated`, e.g. `SimEngine`) and `pace`, wall seconds per
modelled second. Out: an engine with the same steps and outputs whose `wait` returns once
`pace * elapsed_s` of wall time has passed since `launch` (the host work already spent counts), and
whose caps say wall time (`is_simulated` False). Under `mstar run` the simulated clock jumps; a
server's clients live in wall time, so a server on the simulated engine must take the time the
cost model gives a step, or it would answer as fast as the host can go (pace 0 does just that).
"""
from __future__ import annotations

import dataclasses
import time
from typing import Any, Optional

from mstar.runtime.step import Engine, Step, StepHandle, StepResult


class PacedEngine:
    def __init__(self, engine: Engine, pace: float = 1.0):
        if not pace >= 0:
            raise ValueError(f"the pace must be >= 0 wall seconds per modelled second, got {pace}")
        self.inner = engine
        self.pace = pace
        self.caps = dataclasses.replace(engine.caps, is_simulated=False, clock=None, can_launch_ahead=False)

    def add_request(self, request_id: str, spec: Any) -> Optional[str]:
        return self.inner.add_request(request_id, spec)

    def end_request(self, request_id: str) -> None:
        self.inner.end_request(request_id)

    def end_node(self, request_id: str, node: str) -> None:
        self.inner.end_node(request_id, node)

    def claim_prefix(self, request_id: str, node: str, tokens: list[int]) -> int:
        return self.inner.claim_prefix(request_id, node, tokens)

    def launch(self, step: Step) -> StepHandle:
        started = time.monotonic()
        handle = self.inner.launch(step)
        return StepHandle(step, None, (handle, started))

    def wait(self, handle: StepHandle) -> StepResult:
        inner, started = handle.pending
        result = self.inner.wait(inner)
        remaining = started + self.pace * result.elapsed_s - time.monotonic()
        if remaining > 0:
            time.sleep(remaining)
        return dataclasses.replace(result, elapsed_s=time.monotonic() - started)

    def kv_pages(self) -> dict[str, tuple[int, int]]:
        kv_pages = getattr(self.inner, "kv_pages", None)
        return kv_pages() if callable(kv_pages) else {}
