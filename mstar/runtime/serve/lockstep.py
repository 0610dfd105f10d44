"""TP lockstep: a leader's step is post-processed only once every follower ran its copy.

In: the plan's TP groups and the per-rank schedulers. Out: `Lockstep`:

    follow(leader_launch, batch)      queue `batch` (the rows the followers run) on each follower
                                      of the leader's node; the leader waits for them
    follower_ran(rank, node)          a follower finished its oldest copy: the leader launch that
                                      may now be post-processed, or None
    leader_ran(launch) -> bool        the leader's step finished: True = post-process it now,
                                      False = it waits for followers (kept until they ran)
    release_all() -> [launch]         followers that will never run: leaders to post-process now

Followers run the leader's batches in order; launches are matched by identity (`id`).
"""
from __future__ import annotations

from collections import deque
from typing import Any

from mstar.plan.schema import Plan
from mstar.runtime.scheduler.batch import Batch
from mstar.runtime.scheduler.scheduler import WorkerScheduler


class Lockstep:
    def __init__(self, plan: Plan, schedulers: dict[int, WorkerScheduler]):
        self.schedulers = schedulers
        self.followers: dict[tuple[int, str], list[int]] = {}  # (leader rank, node) -> follower ranks
        for worker in plan.workers:
            for group in worker.tp_groups:
                if group.leader == worker.rank:
                    self.followers[(worker.rank, group.node)] = [r for r in group.ranks if r != worker.rank]
        self.pending: dict[tuple[int, str], deque] = {}  # (follower, node) -> leader launches
        self.waiting: dict[int, set[int]] = {}  # id(leader launch) -> followers still to run
        self.done_leaders: dict[int, Any] = {}  # id(leader launch) -> launch whose step finished

    def follow(self, launch: Any, batch: Batch) -> None:
        for follower in self.followers.get((launch.worker, batch.node), ()):
            self.schedulers[follower].register_follow(batch)
            self.pending.setdefault((follower, batch.node), deque()).append(launch)
            self.waiting.setdefault(id(launch), set()).add(follower)

    def follower_ran(self, rank: int, node: str) -> Any:
        queue = self.pending.get((rank, node))
        leader = queue.popleft() if queue else None
        if leader is None:
            return None
        waiting = self.waiting[id(leader)]
        waiting.discard(rank)
        if waiting or id(leader) not in self.done_leaders:
            return None
        del self.waiting[id(leader)]
        return self.done_leaders.pop(id(leader))

    def leader_ran(self, launch: Any) -> bool:
        if self.waiting.get(id(launch)):
            self.done_leaders[id(launch)] = launch
            return False
        self.waiting.pop(id(launch), None)
        return True

    def release_all(self) -> list[Any]:
        leaders = list(self.done_leaders.values())
        if not leaders:
            return []
        self.waiting.clear()
        self.pending.clear()
        self.done_leaders.clear()
        return leaders
