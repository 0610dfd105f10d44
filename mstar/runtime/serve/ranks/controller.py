"""The engine the run loop talks to on rank 0 when ranks are processes.

In: the plan, rank 0's own `RankExecutor` (None when rank 0 runs no node), a `Channel` to the other
ranks and the rank timeout. Out: `RankEngines`, an `Engine` (step.py): the driver, conductor and
every worker's scheduler stay in this one process, and each step goes to the ranks that run it:

- `launch(step)`: the instance of the step's worker for its node (a TP group's ranks, leader
  first, else the worker alone); KV the step's rows need that lives on another instance moves
  first (kv_homes.py: prefill on one rank, decode on another); the step goes to every remote rank
  of the instance, then rank 0 runs its own part, so a TP group's ranks run it together (their
  collectives meet); `wait` takes the leader's result (followers answer with what they imported);
- `add_request` goes to every rank (each checks the nodes it runs; the first refusal wins, and
  the ranks that accepted forget it again); `end_request` to every rank, and `end_node` (the
  request's last partition calling the node ended) too, each freeing what it holds there;
- `claim_prefix` (a plan with a prefix cache) goes to every rank of the one instance (a rank or
  a TP group) that runs the node's prefix walks, and they must agree; the request's KV starts
  there, so a decode step on another instance moves it as any other (prefill on one rank, decode
  on another). Where several instances run them (replicas), which one takes the prompt is decided
  only when its step is: nothing is claimed and the request prefills whole.

A rank that exits, hangs past the timeout or breaks the protocol raises `RankFailure` (an
`EngineLost`) naming the rank and its last step; from then on every request is refused with that
message and nothing more is sent. A step that raises inside a rank's engine fails that step's
requests alone, as in one process.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Optional

from mstar.arg_types import shown_error
from mstar.plan.prefix_walks import prefix_walk_pairs
from mstar.plan.schema import Plan
from mstar.runtime.serve.ranks.channel import Channel, Message, RankFailure
from mstar.runtime.serve.ranks.executor import RankExecutor
from mstar.runtime.serve.ranks.kv_homes import Instance, KvHomes
from mstar.runtime.serve.ranks.wire import decode_result, encode_request, encode_step
from mstar.runtime.step import EngineCaps, Step, StepHandle, StepResult


class RemoteStepError(RuntimeError):
    """A rank's engine raised while running a step (its requests fail alone)."""


class RankEngines:
    def __init__(self, plan: Plan, local: Optional[RankExecutor], channel: Channel, world_size: int,
                 timeout_s: float):
        self.local = local
        self.channel = channel
        self.timeout_s = timeout_s
        self.remote = list(range(1, world_size))
        self.instances: dict[tuple[int, str], Instance] = {
            (worker.rank, group.node): tuple(group.ranks) for worker in plan.workers for group in worker.tp_groups}
        # (node, instance) of every instance running a node: a TP group once, a lone worker as itself
        self.node_instances: set[tuple[str, Instance]] = set()
        # node -> the instances that run its prefix walks (KvPoolPlan.prefix_walks: the walks whose
        # first row may start after a cached prefix), where claim_prefix claims
        self.prefix_instances: dict[str, set[Instance]] = {}
        prefix_walks = prefix_walk_pairs(plan)
        for worker in plan.workers:
            for key in worker.keys:
                instance = self._instance_of(worker.rank, key.node)
                self.node_instances.add((key.node, instance))
                if any((key.node, walk) in prefix_walks for walk in key.walks):
                    self.prefix_instances.setdefault(key.node, set()).add(instance)
        self.homes = KvHomes(plan)
        # rank 0's engine reads every decoder's dims (its own nodes or not), so its caps hold for all ranks
        # (rank 0's engine runs nothing ahead for steps it sends to other ranks)
        # (a failed step on a rank of its own is not run again: rerun_nodes is rank 0's engine's only)
        self.caps = (dataclasses.replace(local.engine.caps, can_launch_ahead=False, rerun_nodes=frozenset())
                     if local else EngineCaps())
        self.lost: Optional[str] = None
        self.is_abandoned = False  # `abandon`: no message to the ranks from now on
        self.num_steps = 0
        self.last_step: dict[int, str] = {}  # rank -> its latest step, for a failure's message
        self.running: set[int] = set()  # ranks with a step whose answer has not come back
        self.memory: dict[int, dict[str, int]] = {}  # rank -> its memory at start-up (executor.memory)
        self.num_kv_moves = 0  # requests whose KV moved to another instance

    def summary(self, mode: str) -> dict[str, Any]:
        """For the run report: how the ranks ran, each rank's memory, the KV moves."""
        return {"mode": mode, "world_size": len(self.remote) + 1, "num_kv_moves": self.num_kv_moves,
                "memory": {str(rank): figures for rank, figures in sorted(self.memory.items())}}

    # ------------------------------------------------------------ messages

    def _send(self, rank: int, kind: str, body: dict[str, Any], tensors: Optional[list] = None) -> None:
        try:
            self.channel.send(rank, kind, body, tensors, timeout_s=self.timeout_s)
        except RankFailure as failure:
            raise self._lose(failure) from None

    def _recv(self, rank: int, kind: str) -> Message:
        try:
            message = self.channel.recv(rank, timeout_s=self.timeout_s)
        except RankFailure as failure:
            raise self._lose(failure) from None
        if message.kind == "fatal":
            raise self._lose(RankFailure(rank, f"failed: {message.body['message']}"))
        if message.kind not in (kind, "step_error"):
            raise self._lose(RankFailure(rank, f"answered {message.kind!r} where {kind!r} was due"))
        return message

    def _lose(self, failure: RankFailure) -> RankFailure:
        """The run cannot go on: name the rank and its last step; refuse everything from now on."""
        if failure.is_final:
            return failure
        rank = failure.rank
        step = self.last_step.get(rank)
        where = ("before its first step" if step is None
                 else f"{'during' if rank in self.running else 'after'} its {step}")
        self.lost = f"rank {rank} {failure.reason} ({where})"
        final = RankFailure(rank, f"{failure.reason} ({where})")
        final.is_final = True
        return final

    # ------------------------------------------------------------ requests

    def add_request(self, request_id: str, request: Any) -> Optional[str]:
        if self.lost is not None:
            return f"not run: {self.lost}"
        tensors: list = []
        body = {"request_id": request_id, "request": encode_request(request, tensors)}
        for rank in self.remote:
            self._send(rank, "add_request", body, tensors)
        reasons = [self.local.add_request(request_id, request)] if self.local else []
        reasons += [self._recv(rank, "added").body["reason"] for rank in self.remote]
        reason = next((r for r in reasons if r is not None), None)
        if reason is not None:
            self.end_request(request_id)
        return reason

    def claim_prefix(self, request_id: str, node: str, tokens: list[int]) -> int:
        """The request's prompt on `node`'s prefix cache (module docstring): the tokens the one
        instance running the node's prefix walks now holds from cached pages, every rank of it the
        same; 0 where several instances (or none) run them, or the run is lost."""
        instances = self.prefix_instances.get(node, set())
        if self.lost is not None or len(instances) != 1:
            return 0
        (instance,) = instances
        body = {"request_id": request_id, "node": node, "tokens": list(tokens)}
        for rank in instance:
            if rank != 0:
                self._send(rank, "claim_prefix", body)
        claimed = {0: self.local.claim_prefix(request_id, node, tokens)} if 0 in instance and self.local else {}
        for rank in instance:
            if rank != 0:
                claimed[rank] = self._recv(rank, "claimed").body["num_tokens"]
        leader = claimed[instance[0]]
        for rank, num_tokens in claimed.items():
            if num_tokens != leader:
                raise self._lose(RankFailure(rank, f"found {num_tokens} cached tokens of request {request_id} on "
                                                   f"{node} where rank {instance[0]} found {leader}"))
        if leader:
            self.homes.start(request_id, node, instance)
        return leader

    def end_request(self, request_id: str) -> None:
        if self.lost is not None:
            return
        for rank in self.remote:
            self._send(rank, "end_request", {"request_id": request_id})
        if self.local:
            self.local.end_request(request_id)
        self.homes.forget(request_id)

    def end_node(self, request_id: str, node: str) -> None:
        if self.lost is not None:
            return
        for rank in self.remote:  # each rank frees what it holds of the node (none where it runs no instance)
            self._send(rank, "end_node", {"request_id": request_id, "node": node})
        if self.local:
            self.local.end_node(request_id, node)

    def offload_figures(self) -> Optional[dict[str, dict[str, int]]]:
        """Per kv node with a host pool: the KV pages moved to it and back so far, summed over the
        node's instances, a TP group counted once (its ranks move the same pages, each its shard:
        the leader's figure); None once the run is lost (a rank may not answer) or while a step's
        answer is due (a run stopped mid-step: that answer would come first)."""
        if self.lost is not None or self.running:
            return None
        try:  # a rank lost only now (a signal to the whole process group, say): the run is lost
            for rank in self.remote:
                self._send(rank, "offload_figures", {})
            per_rank = {0: self.local.engine.offload_figures()} if self.local else {}
            for rank in self.remote:
                per_rank[rank] = self._recv(rank, "offload").body["figures"]
        except RankFailure:
            return None
        totals: dict[str, dict[str, int]] = {}
        for node, instance in sorted(self.node_instances):
            figures = per_rank.get(instance[0], {}).get(node)
            if figures is not None:
                total = totals.setdefault(node, dict.fromkeys(figures, 0))
                for name, value in figures.items():
                    total[name] += value
        return totals

    def abandon(self) -> None:
        """A second signal ended the run inside a step (`mstar run`): where each rank stands is not
        known (one may be computing a step nobody will read, or waiting on KV pages rank 0 never
        sent), so nothing more is sent to the ranks, and `RankProcesses.close` kills them at once.
        (A rank blocked that way took no more messages: the next one waited out the rank timeout,
        7-9 s after the second Ctrl-C, and the teardown then aborted the process one time in five.)"""
        self.is_abandoned = True
        if self.lost is None:
            self.lost = "was abandoned mid-step by a second signal"

    def stop(self) -> None:
        """Tell every rank the run is over (it exits); a rank already gone is ignored."""
        for rank in self.remote:
            try:
                self.channel.send(rank, "stop", {}, timeout_s=min(self.timeout_s, 2.0))
            except RankFailure:
                pass

    # ------------------------------------------------------------ steps

    def instance(self, step: Step) -> Instance:
        return self._instance_of(step.worker, step.node)

    def _instance_of(self, rank: int, node: str) -> Instance:
        """The instance running `node` on worker `rank`: its TP group's ranks, else the rank alone."""
        return self.instances.get((rank, node), (rank,))

    def launch(self, step: Step) -> StepHandle:
        if self.lost is not None:
            raise RankFailure(-1, self.lost)
        instance = self.instance(step)
        moves = self.homes.moves(step, instance)
        try:
            for request_id, home in moves:
                self._move(request_id, step.node, home, instance)
        except RankFailure as failure:
            raise self._lose(failure) from None
        self.num_steps += 1
        tensors: list = []
        body = encode_step(step, tensors) if any(rank != 0 for rank in instance) else {}
        for rank in instance:
            self.last_step[rank] = f"step {self.num_steps} ({step.key}, {len(step.rows)} rows)"
            if rank != 0:
                self.running.add(rank)  # (first: a signal between the two left a sent step unaccounted)
                self._send(rank, "step", body, tensors)
        local: Any = None
        if 0 in instance and self.local is not None:
            try:
                local = self.local.run_step(step)
            except Exception as error:  # answered in wait, after the other ranks' answers
                local = error
        return StepHandle(step, pending=(instance, moves, local))

    def wait(self, handle: StepHandle) -> StepResult:
        instance, moves, local = handle.pending
        answers = {}
        for rank in instance:
            if rank != 0:
                answers[rank] = self._recv(rank, "result" if rank == instance[0] else "done")
                self.running.discard(rank)
        errors = [(rank, m.body["message"]) for rank, m in answers.items() if m.kind == "step_error"]
        if len(instance) > 1 and (isinstance(local, Exception) or errors):
            # A tensor-parallel group's step that failed on a rank left its collectives out of step
            # (gloo closes the group's connections after a timeout): as an ordinary step failure,
            # every later step of the run failed with the transport's message, and the run exited 0.
            rank, said = errors[0] if errors else (0, shown_error(local))
            raise self._lose(RankFailure(rank, f"failed a tensor-parallel step, which leaves its group's collectives "
                                               f"out of step: {said}"))
        if isinstance(local, Exception):
            raise local
        if errors:
            raise RemoteStepError(errors[0][1])
        if instance[0] == 0:
            result, imported = local
        else:
            leader = answers[instance[0]]
            result, imported = decode_result(leader.body["result"], leader.tensors), leader.body["imported"]
        self.homes.settle(handle.step, instance, result, imported)
        for request_id, home in moves:
            if request_id in imported:
                self.num_kv_moves += 1
                self._drop(request_id, handle.step.node, home)
        return result

    def _move(self, request_id: str, node: str, src: Instance, dst: Instance) -> None:
        """Each rank of the instance holding the KV sends its shard to the rank holding the same shard
        there: a rank's shard is its place among its group's ranks in ascending order (tp/build.py),
        not in the plan's list (a group listed [3, 2] paired rank 0's shard 0 with rank 3's shard 1:
        decode read other heads' KV, and the run exited 0)."""
        if len(src) != len(dst):
            raise RemoteStepError(f"request {request_id}: its KV on {node} lives on ranks {list(src)} and cannot move "
                                  f"to ranks {list(dst)} (a different tensor-parallel size)")
        for sender, receiver in zip(sorted(src), sorted(dst)):
            if receiver != 0:
                self._send(receiver, "kv_recv", {"request_id": request_id, "node": node, "src": sender})
            if sender != 0:
                self._send(sender, "kv_send", {"request_id": request_id, "node": node, "dst": receiver})
            elif self.local is not None:
                self.local.kv_send(request_id, node, receiver)
            if receiver == 0 and self.local is not None:
                self.local.kv_recv(request_id, node, sender)

    def _drop(self, request_id: str, node: str, src: Instance) -> None:
        for rank in src:
            if rank != 0:
                self._send(rank, "kv_drop", {"request_id": request_id, "node": node})
            elif self.local is not None:
                self.local.kv_drop(request_id, node)
