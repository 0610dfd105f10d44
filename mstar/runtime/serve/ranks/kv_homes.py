"""Where each request's KV cache of each kv node lives, and which steps must move it first.

In: the steps the controller launches (node, rows) and the instance (ranks) that runs each. Out:
`KvHomes.moves(step, instance)` -> the (request, instance holding its KV) pairs that must move to
`instance` before the step runs (prefill on one rank, decode on another: the plan's routes put
the walks on different workers); `settle(...)` records where the KV lives once the step ran. A
request's first step on a node makes that instance its home; a move makes the receiver the home
once it has the KV (the sender then drops its copy).
"""
from __future__ import annotations

from mstar.plan.schema import Plan
from mstar.runtime.step import Step, StepResult

Instance = tuple[int, ...]


class KvHomes:
    def __init__(self, plan: Plan):
        self.kv_nodes = frozenset(node.name for node in plan.nodes if node.engine == "kv")
        self.home: dict[tuple[str, str], Instance] = {}  # (request, node) -> instance holding its KV

    def moves(self, step: Step, instance: Instance) -> list[tuple[str, Instance]]:
        if step.node not in self.kv_nodes:
            return []
        found = []
        for row in step.rows:
            home = self.home.get((row.request_id, step.node))
            if home is not None and home != instance:
                found.append((row.request_id, home))
        return found

    def settle(self, step: Step, instance: Instance, result: StepResult, imported: list[str]) -> None:
        """The step ran: rows that ran start their home here, moved rows the receiver has now."""
        if step.node not in self.kv_nodes:
            return
        for request_id in imported:
            self.home[(request_id, step.node)] = instance
        failed = set(result.allocation_failed)
        for row in step.rows:
            if row.request_id not in failed:
                self.home.setdefault((row.request_id, step.node), instance)

    def start(self, request_id: str, node: str, instance: Instance) -> None:
        """The request's KV on `node` starts on `instance` before any step of it ran there (a prefix
        claim put cached pages in its sequence)."""
        if node in self.kv_nodes:
            self.home[(request_id, node)] = instance

    def forget(self, request_id: str) -> None:
        for node in self.kv_nodes:
            self.home.pop((request_id, node), None)
