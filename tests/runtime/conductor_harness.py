"""Drive a Conductor by hand, one row per step, without schedulers: for unit tests of the walk
machine. Rows run FIFO in the order they became ready; `respond` may replace the engine's
row result (to inject stops and errors)."""
from __future__ import annotations

from collections import deque
from typing import Callable, Optional

from mstar.runtime.conductor.conductor import Conductor
from mstar.runtime.engine.sim import SimEngine
from mstar.runtime.step import RowResult, Step, StepRow


class Harness:
    def __init__(self, plan, engine: Optional[SimEngine] = None,
                 respond: Optional[Callable[[str, StepRow, RowResult], RowResult]] = None):
        # one-row steps under made-up keys (no scheduler): not checked against the plan's keys
        self.engine = engine or SimEngine(plan, check_steps=False)
        self.conductor = Conductor(plan, self.engine, self.engine.clock)
        self.queue: deque = deque()
        self.respond = respond
        self.ran: list[tuple[str, str, str, StepRow]] = []  # (request, node, walk, row)

    def submit(self, request):
        record = self.conductor.submit(request)
        self._collect()
        return record

    def _collect(self):
        for node, walk, request_ids, num_tokens in self.conductor.ready_out:
            self.queue.extend((rid, node, walk, num) for rid, num in zip(request_ids, num_tokens))
        self.conductor.ready_out.clear()
        self.conductor.ended_out.clear()

    def run(self, max_rows: int = 100_000) -> None:
        for _ in range(max_rows):
            if not self.queue:
                return
            request_id, node, walk, _ = self.queue.popleft()
            rows, _ = self.conductor.step_rows(node, [request_id], [walk])
            if not rows:
                continue
            row = rows[0]
            self.ran.append((request_id, node, walk, row))
            step = Step(worker=0, key=f"{node}:{walk}", node=node, mask=1, label=walk, rows=[row], attention="prefill")
            result = self.engine.run_step(step)
            assert not result.allocation_failed
            row_result = result.rows[0]
            if self.respond is not None:
                row_result = self.respond(node, row, row_result)
            self.engine.clock.advance_to(self.engine.clock() + 0.001)
            self.conductor.on_step(node, [row], [row_result])
            self._collect()
        raise AssertionError("the harness did not settle")
