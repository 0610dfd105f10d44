"""Workers, TP groups and the instances of calls against each other, as mstarc's lowering writes
them (compiler/lower_workers.py):

- `workers[i]` is rank i: one worker per rank, sorted, the ranks 0 to N-1 with N the world size
  (MW324: the multi-rank runtime starts a process per rank up to the highest);
- a TP group (one lockstep instance) holds tp_size x sp_size distinct ranks of the plan, its
  leader first, the rank that lists it among them; it names a node and walks that rank runs, and
  every rank of the group lists the same group (a follower that lists no group leads its own
  rows: the scheduler then ran every row twice, or failed on a rank number it does not have);
- a call's `instances` are the ones its workers give (node, walk): for each rank that runs it, in
  rank order, the rank's TP group for it (leader first) or the rank alone, each once; a rank of an
  instance runs (node, walk), and a TP instance's ranks each list a TP group for it;
- a kv node's instances are of one width in every walk (mstarc's MW321): its KV cache cannot move
  between different TP world sizes (a plan whose TP groups covered decode alone ran prefill on one
  rank, and every request ended `stalled`).

    rank_problems(plan) -> list[str]     empty for a consistent plan
"""
from __future__ import annotations

from typing import Iterator

from mstar.plan.instances import call_instances, tp_group_for
from mstar.plan.schema import CallPlan, Plan, TPGroup, WalkPlan, WorkerPlan


def _worker_rank_problems(plan: Plan) -> Iterator[str]:
    last = len(plan.workers) - 1
    yield from (f"workers[{i}] is rank {w.rank}; the workers are ranks 0 to {last}, in order"
                for i, w in enumerate(plan.workers) if w.rank != i)


def _group_problems(workers: dict[int, WorkerPlan], worker: WorkerPlan, group: TPGroup,
                    nodes: set[str]) -> Iterator[str]:
    """One TP group a worker lists (module docstring); `workers` by rank."""
    where = f"worker {worker.rank}: TP group of {group.node} with ranks {group.ranks}"
    num_ranks = len(workers)
    if group.node not in nodes:
        yield f"{where} names unknown node {group.node!r}"
    yield from (f"{where} has rank {r}, which the plan lacks (its ranks are 0 to {num_ranks - 1})"
                for r in group.ranks if not 0 <= r < num_ranks)
    if len(set(group.ranks)) < len(group.ranks):
        yield f"{where} repeats a rank"
    if len(group.ranks) != group.tp_size * group.sp_size or min(group.tp_size, group.sp_size) < 1:
        yield (f"{where} has {len(group.ranks)} ranks for tp_size {group.tp_size} x sp_size {group.sp_size} "
               f"(one lockstep instance)")
    if group.ranks[:1] != [group.leader]:
        yield f"{where} has leader {group.leader}, not its first rank"
    if worker.rank not in group.ranks:
        yield f"{where} does not hold rank {worker.rank}, which lists it"
    yield from (f"{where} runs walk {w!r}, which rank {worker.rank} does not run on {group.node}"
                for w in group.walks if f"{group.node}/{w}" not in worker.placements)
    yield from (f"{where} holds rank {r}, which does not list this group (same node, walks, ranks, sizes, leader)"
                for r in group.ranks if r in workers and r != worker.rank and group not in workers[r].tp_groups)


def _call_problems(workers: dict[int, WorkerPlan], walk: WalkPlan, index: int, call: CallPlan,
                   expected: dict[tuple[str, str], list[list[int]]]) -> Iterator[str]:
    """One call's instances against its workers (module docstring); `workers` by rank."""
    where = f"walk {walk.name}: call {index} ({call.node})"
    placement = f"{call.node}/{walk.name}"
    found = False
    for instance in call.instances:
        for rank in instance:
            worker = workers.get(rank)
            if worker is None:
                continue  # references.py names a rank the plan lacks
            if placement not in worker.placements:
                found = True
                yield f"{where} runs on rank {rank}, whose worker does not run {placement}"
            elif len(instance) > 1 and tp_group_for(worker, call.node, walk.name) is None:
                found = True
                yield f"{where} runs on TP instance {instance}, but worker {rank} lists no TP group for {placement}"
    want = expected.get((call.node, walk.name), [])
    if not found and call.instances != want:
        yield f"{where} has instances {call.instances}, but its workers' placements and TP groups give {want}"


def _kv_width_problems(plan: Plan) -> Iterator[str]:
    """A kv node whose walks run on instances of different widths (module docstring)."""
    kv_nodes = {node.name for node in plan.nodes if node.engine == "kv"}
    widths: dict[str, dict[int, str]] = {}
    for walk in plan.walks:
        for call in walk.calls:
            if call.node in kv_nodes:
                for instance in call.instances:
                    widths.setdefault(call.node, {}).setdefault(len(instance), walk.name)
    for node, by_width in widths.items():
        if len(by_width) > 1:
            low, high = min(by_width), max(by_width)
            yield (f"node {node}: its walks run at TP world sizes {low} (walk {by_width[low]}) and {high} "
                   f"(walk {by_width[high]}); its KV cache cannot move between different TP world sizes")


def rank_problems(plan: Plan) -> list[str]:
    nodes = {n.name for n in plan.nodes}
    workers = {w.rank: w for w in plan.workers}
    problems = list(_worker_rank_problems(plan))
    for worker in plan.workers:
        for group in worker.tp_groups:
            problems.extend(_group_problems(workers, worker, group, nodes))
    expected = call_instances(plan.workers)
    for walk in plan.walks:
        for index, call in enumerate(walk.calls):
            problems.extend(_call_problems(workers, walk, index, call, expected))
    if not problems:  # widths read the instances, which must first agree with the workers
        problems.extend(_kv_width_problems(plan))
    return problems
