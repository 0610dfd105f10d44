"""Cross-references of a plan's tables: every name one table uses is declared by another.

The schema checks each table's shape; this checks that they fit together, so that a plan edited by
hand (with its content hash recomputed) is refused by `load_plan` with the first problems named,
instead of failing deep inside the scheduler or the conductor. mstarc never writes such a plan.

    reference_problems(plan) -> list[str]     empty for a consistent plan

Besides this module's own checks it gathers those of loop_nesting.py (the loops around every call
of a walk, followed from its start), rank_checks.py (worker ranks, TP groups and call instances),
stream_checks.py (a partition's streams and their chunk policies) and int_bounds.py (sizes within
mstarc's bounds: dims, pools, steps, nested loop iterations).
"""
from __future__ import annotations

from collections import Counter
from typing import Iterator

from mstar.plan.buckets import batch_pad_table, family_max_rows
from mstar.plan.int_bounds import bound_problems, loop_iteration_problems
from mstar.plan.loop_nesting import loop_nesting_problems
from mstar.plan.rank_checks import rank_problems
from mstar.plan.schema import EdgePlan, KeyPlan, NextPlan, PartitionPlan, Plan, WalkPlan
from mstar.plan.stream_checks import stream_problems

MAX_PROBLEMS = 5


def _index_problems(walk: WalkPlan, nodes: set[str], node_inputs: dict[str, set[str]],
                    node_outputs: dict[str, set[str]], partitions: set[str]) -> Iterator[str]:
    """Every index of a walk's tables within its lists; every name declared."""
    check = _WalkIndices(walk, nodes, partitions)
    where = check.where
    if walk.partition not in partitions:
        yield f"{where}: unknown partition {walk.partition!r}"
    yield from (f"{where}: unknown node {n!r}" for n in walk.nodes if n not in nodes)
    yield from check.next_problems(walk.start, "its start")
    for index, call in enumerate(walk.calls):
        yield from check.call_problems(index, call, node_inputs, node_outputs)
    for index, join in enumerate(walk.joins):
        if join.num_members < 1:
            yield f"{where}: join {index} has {join.num_members} members"
        yield from check.next_problems(join.then, f"join {index}")
    for index, loop in enumerate(walk.loops):
        yield from check.loop_problems(index, loop)


class _WalkIndices:
    """The index checks of one walk's tables (`_index_problems`), a method a table."""

    def __init__(self, walk: WalkPlan, nodes: set[str], partitions: set[str]) -> None:
        self.walk, self.nodes, self.partitions = walk, nodes, partitions
        self.where = f"walk {walk.name}"
        self.num_calls, self.num_joins = len(walk.calls), len(walk.joins)
        self.num_loops, self.num_slots = len(walk.loops), len(walk.slots)

    def next_problems(self, then: NextPlan, what: str) -> Iterator[str]:
        where = self.where
        if then.kind == "start" and not then.calls:
            yield f"{where}: {what} starts no call"
        for name, indices, size in (("call", then.calls, self.num_calls), ("join", then.joins, self.num_joins),
                                    ("loop", then.loops, self.num_loops)):
            yield from (f"{where}: {what} names {name} {i}, which the walk lacks" for i in indices if not 0 <= i < size)
            # (a call started twice ran twice: the walk's state refused it mid-run, an internal error)
            yield from (f"{where}: {what} names {name} {i} twice" for i, count in Counter(indices).items() if count > 1)
        target_size = {"join": self.num_joins, "loop_end": self.num_loops}.get(then.kind)
        if target_size is not None and (then.target is None or not 0 <= then.target < target_size):
            yield f"{where}: {what} ends {then.kind} {then.target}, which the walk lacks"

    def edge_problems(self, edge: EdgePlan, what: str) -> Iterator[str]:
        where = self.where
        if edge.dest_kind in ("node", "stream") and edge.dest not in self.nodes:
            yield f"{where}: edge {edge.name} goes to unknown node {edge.dest!r}"
        if edge.stream_partition is not None and edge.stream_partition not in self.partitions:
            yield f"{where}: edge {edge.name} streams to unknown partition {edge.stream_partition!r}"
        if edge.action in ("slot", "loop_back") and (edge.slot is None or not 0 <= edge.slot < self.num_slots):
            yield f"{where}: {what} edge {edge.name} writes slot {edge.slot}, which the walk lacks"
        if edge.action in ("loop_back", "loop_output", "loop_accumulate"):
            if edge.loop is None or not 0 <= edge.loop < self.num_loops:
                yield f"{where}: {what} edge {edge.name} names loop {edge.loop}, which the walk lacks"
            elif edge.action != "loop_back":
                exits = self.walk.loops[edge.loop].exits
                if edge.exit is None or not 0 <= edge.exit < len(exits) or exits[edge.exit].edge is None:
                    yield f"{where}: {what} edge {edge.name} names exit {edge.exit} of loop {edge.loop}, which it lacks"

    def call_problems(self, index: int, call, node_inputs: dict[str, set[str]],
                      node_outputs: dict[str, set[str]]) -> Iterator[str]:
        where, what, num_slots = self.where, f"call {index}", self.num_slots
        if call.node not in self.nodes:
            yield f"{where}: a call of unknown node {call.node!r}"
        else:
            yield from (f"{where}: {call.node} is called with {i.name!r}, not one of its inputs"
                        for i in call.inputs if i.name not in node_inputs[call.node])
        for source in call.inputs:
            yield from (f"{where}: {what} reads slot {s}, which the walk lacks"
                        for s in source.slots if not 0 <= s < num_slots)
            if source.is_wait and not source.slots:
                yield f"{where}: {what} waits for {source.name} in no slot"
        for edge in call.edges:
            yield from self.edge_problems(edge, what)
            if call.node in self.nodes and edge.name not in node_outputs[call.node]:
                yield f"{where}: edge {edge.name} is not an output of {call.node}"
        for name, loop_index in (("loop", call.loop), ("stop loop", call.stop_loop)):
            if loop_index is not None and not 0 <= loop_index < self.num_loops:
                yield f"{where}: {what} has {name} {loop_index}, which the walk lacks"
        yield from self.next_problems(call.then, what)

    def loop_problems(self, index: int, loop) -> Iterator[str]:
        where, what = self.where, f"loop {loop.name}"
        yield from (f"{where}: {what} runs unknown node {n!r}" for n in loop.nodes if n not in self.nodes)
        if loop.max_iters < 1:
            yield f"{where}: {what} has max_iters {loop.max_iters}"
        if (loop.count_param is None) != (loop.default_count is None):
            yield f"{where}: {what} has a count param without a default count, or the reverse"
        elif loop.default_count is not None and not 1 <= loop.default_count <= loop.max_iters:
            yield f"{where}: {what} has default_count {loop.default_count} outside 1..{loop.max_iters}"
        if loop.body.kind != "start":
            yield f"{where}: {what} body is not a start"
        yield from self.next_problems(loop.body, what)
        yield from self.next_problems(loop.then, what)
        if loop.then.kind == "loop_end" and loop.then.target is not None and loop.then.target >= index:
            yield f"{where}: {what} ends loop {loop.then.target} when it exits, not an outer loop"
        yield from (f"{where}: {what} clears slot {s}, which the walk lacks"
                    for s in loop.cleared_slots if not 0 <= s < self.num_slots)
        yield from self.exit_problems(index, loop, what)

    def exit_problems(self, index: int, loop, what: str) -> Iterator[str]:
        where = self.where
        for exit in loop.exits:
            if exit.kind == "scope":
                if exit.slot is None or not 0 <= exit.slot < self.num_slots:
                    yield f"{where}: {what} writes its output {exit.name} to slot {exit.slot}, which the walk lacks"
            elif exit.edge is None:
                yield f"{where}: {what} hands on {exit.name} by no edge"
            elif exit.edge.action in ("loop_output", "loop_accumulate", "loop_back") and (
                    exit.edge.loop is None or not 0 <= exit.edge.loop < index):
                yield f"{where}: {what} hands {exit.name} on to loop {exit.edge.loop}, not an outer loop"
            else:
                yield from self.edge_problems(exit.edge, what)


def _role_problems(plan: Plan, problems: list[str]) -> None:
    """Roles: every input has exactly one, kv access and guidance name the node's sequences and
    walks, a kv node is a decoder and a stateless node is not."""
    walks = {w.name for w in plan.walks}
    for node in plan.nodes:
        where = f"node {node.name}"
        declared = [r.name for r in node.input_roles]
        if sorted(declared) != sorted(node.inputs + node.stream_inputs):
            problems.append(f"{where}: input_roles {sorted(declared)} do not match its inputs "
                            f"{sorted(node.inputs + node.stream_inputs)}")
        problems.extend(f"{where}: stream input {r.name} takes the prompt"
                        for r in node.input_roles if r.prompt is not None and r.name in node.stream_inputs)
        if (node.engine == "kv") != (node.model_kind == "decoder"):
            problems.append(f"{where}: a {node.engine} node cannot be model_kind {node.model_kind}")
        outputs = [o.name for o in node.outputs]
        if len(set(outputs)) < len(outputs):
            problems.append(f"{where}: an output is declared twice")
        labels = node.kv_sequences
        pools = [c.label for c in node.cross_kv]
        problems.extend(f"{where}: cross_kv {c.label} is filled from {c.source!r}, not an input of the node"
                        for c in node.cross_kv if c.source not in node.inputs)
        if set(pools) & set(labels) or len(set(pools)) < len(pools):
            problems.append(f"{where}: cross_kv labels {pools} repeat or clash with its KV sequences")
        for access in node.kv_access:
            if access.walk not in walks:
                problems.append(f"{where}: kv access of unknown walk {access.walk!r}")
            problems.extend(f"{where}: walk {access.walk} uses unknown KV sequence {label!r}"
                            for label in access.reads + access.writes if label not in labels + pools)
        for guidance in node.guidance:
            if guidance.label not in labels[1:]:
                problems.append(f"{where}: guidance label {guidance.label!r} is not one of its KV sequences "
                                "after the first")


def reference_problems(plan: Plan) -> list[str]:
    problems: list[str] = []
    nodes = {n.name for n in plan.nodes}
    node_inputs = {n.name: set(n.inputs) | set(n.stream_inputs) for n in plan.nodes}
    node_outputs = {n.name: {o.name for o in n.outputs} for n in plan.nodes}
    _role_problems(plan, problems)
    walks = {w.name for w in plan.walks}
    partitions = {p.name for p in plan.partitions}
    for what, names in (("node", [n.name for n in plan.nodes]), ("walk", [w.name for w in plan.walks]),
                        ("partition", [p.name for p in plan.partitions]),
                        ("worker rank", [str(w.rank) for w in plan.workers])):
        repeated = sorted(n for n, count in Counter(names).items() if count > 1)  # linear: a plan holds 100k+ workers
        if repeated:
            problems.append(f"{what} {repeated[0]} is declared twice")

    ranks = {w.rank for w in plan.workers}
    for walk in plan.walks:
        index_problems = list(_index_problems(walk, nodes, node_inputs, node_outputs, partitions))
        nesting_problems = index_problems or loop_nesting_problems(walk)
        problems.extend(nesting_problems or loop_iteration_problems(walk))
        problems.extend(f"walk {walk.name}: {call.node} runs on rank {rank}, which the plan lacks"
                        for call in walk.calls for instance in call.instances for rank in instance
                        if rank not in ranks)
    for part in plan.partitions:
        problems.extend(_stage_problems(part, walks))
        problems.extend(stream_problems(plan, part))
    for pool in plan.deployment.kv_pools:
        if pool.node not in nodes:
            problems.append(f"kv pool of unknown node {pool.node!r}")
        if min(pool.page_size, pool.num_pages, pool.max_seq_len) < 1:
            problems.append(f"kv pool of {pool.node}: page_size, num_pages and max_seq_len must be positive")
    for worker in plan.workers:
        _worker_problems(worker, nodes, walks, {n.name for n in plan.nodes if n.engine == "kv"}, problems)
    problems.extend(rank_problems(plan))
    _capture_key_problems(plan, problems)
    problems.extend(bound_problems(plan))
    return problems


def _stage_problems(part: PartitionPlan, walks: set[str]) -> Iterator[str]:
    """A partition's stages as mstarc writes them: at least one stage, each with at least one walk
    (the conductor routes a request through the first alternative of every stage it does not
    skip: an empty stage was an IndexError there), walks that exist, sequence lengths that split
    them, and the initial walk, when there is one, the first walk of the first stage."""
    where = f"partition {part.name}"
    if not part.stages:
        yield f"{where} has no stages"
    for index, stage in enumerate(part.stages):
        if not stage.walks:
            yield f"{where}: stage {index} has no walks (a stage lists at least one alternative)"
        yield from (f"{where}: stage walk {w!r} is not a walk" for w in stage.walks if w not in walks)
        if stage.sequence_lengths and (sum(stage.sequence_lengths) != len(stage.walks)
                                       or min(stage.sequence_lengths) < 1):
            yield f"{where}: stage sequence lengths {stage.sequence_lengths} do not split its {len(stage.walks)} walks"
    if part.initial_walk is not None and part.initial_walk not in walks:
        yield f"{where}: initial walk {part.initial_walk!r} is not a walk"
    elif part.initial_walk is not None and part.stages and part.stages[0].walks[:1] not in ([], [part.initial_walk]):
        yield f"{where}: initial walk {part.initial_walk} is not the first walk of its first stage"


def _capture_key_problems(plan: Plan, problems: list[str]) -> None:
    """A family's labels are KV sequences (or cross_kv pools) of its node, and a `guided` family is
    on a node with guidance sequences (else no step would ever replay it)."""
    sequences = {n.name: set(n.kv_sequences) | {c.label for c in n.cross_kv} if n.engine == "kv" else set()
                 for n in plan.nodes}
    guided_nodes = {n.name for n in plan.nodes if n.guidance}
    for worker in plan.workers:
        for key in worker.keys:
            where = f"worker {worker.rank}: key {key.name}"
            for family in key.captures:
                problems.extend(f"{where}: capture {family.name} touches {label!r}, not a KV sequence of {key.node}"
                                for label in family.labels if label not in sequences.get(key.node, set()))
                if family.guidance == "guided" and key.node not in guided_nodes:
                    problems.append(f"{where}: capture {family.name} is guided on {key.node}, which has no guidance "
                                    "sequences")


def _worker_problems(worker, nodes: set[str], walks: set[str], kv_nodes: set[str], problems: list[str]) -> None:
    where = f"worker {worker.rank}"
    keys = {k.name: k for k in worker.keys}
    for placement in worker.placements:
        node, _, walk = placement.partition("/")
        if node not in nodes or walk not in walks:
            problems.append(f"{where}: placement {placement!r} names an unknown node or walk")
        key = keys.get(worker.walk_to_key.get(placement, ""))
        if key is None:
            problems.append(f"{where}: placement {placement!r} has no scheduling key")
        elif key.node != node or walk not in key.walks:
            problems.append(f"{where}: walk_to_key[{placement}] is key {key.name}, which does not run {placement}")
    for key in worker.keys:
        if key.node not in nodes:
            problems.append(f"{where}: key {key.name} of unknown node {key.node!r}")
        problems.extend(f"{where}: key {key.name} has unknown walk {w!r}" for w in key.walks if w not in walks)
        if len(key.mixtures) != 1 << len(key.walks):
            problems.append(f"{where}: key {key.name} has {len(key.mixtures)} mixtures for "
                            f"{len(key.walks)} walks (needs {1 << len(key.walks)})")
        problems.extend(f"{where}: key {key.name}: walk_to_key[{key.node}/{w}] is "
                        f"{worker.walk_to_key.get(f'{key.node}/{w}')!r}, not this key"
                        for w in key.walks if worker.walk_to_key.get(f"{key.node}/{w}") != key.name)
        _mixture_problems(f"{where}: key {key.name}", key, kv_nodes, problems)
        _capture_problems(f"{where}: key {key.name}", key, problems)
        problems.extend(f"{where}: key {key.name} limits unknown walk {w!r}"
                        for w in key.rows_limits if w not in key.walks)
        problems.extend(f"{where}: key {key.name}: rows_limits[{w}] is {n}, must be at least 1"
                        for w, n in key.rows_limits.items() if n < 1)
        problems.extend(f"{where}: key {key.name}: batch_rules for walk {w}, which is not in the key"
                        for w in key.batch_rules if w not in key.walks)
        if key.batch_rules and key.is_combined:
            problems.append(f"{where}: key {key.name}: a combined key with batch_rules (a walk with rules runs alone)")
    for spec in worker.speculation:
        if f"{spec.node}/{spec.walk}" not in worker.placements:
            problems.append(f"{where}: speculation for {spec.node}/{spec.walk}, which it does not run")


def _mixture_problems(where: str, key: KeyPlan, kv_nodes: set[str], problems: list[str]) -> None:
    """Mixture i is the step holding exactly the walks of mask i: its mask, walks and label say so;
    a step with rows has a cap; a kv node's step has an attention route; a capture it replays exists."""
    captures = {c.name for c in key.captures}
    for index, entry in enumerate(key.mixtures):
        present = [w for i, w in enumerate(key.walks) if index >> i & 1]
        if entry.mask != index:
            problems.append(f"{where}: mixtures[{index}] has mask {entry.mask} (the table is indexed by mask)")
        if entry.walks != present:
            problems.append(f"{where}: mixtures[{index}].walks is {entry.walks}, mask {index} holds {present}")
        label = present[0] if len(present) == 1 else None
        if entry.label != label:
            problems.append(f"{where}: mixtures[{index}].label is {entry.label!r}, mask {index} needs {label!r}")
        if index and entry.cap < 1:
            problems.append(f"{where}: mixtures[{index}] (mask {index}) has cap {entry.cap}")
        if not index and entry.cap:
            problems.append(f"{where}: mixtures[0] (the empty step) has cap {entry.cap}")
        if index and entry.attention == "none" and key.node in kv_nodes:
            problems.append(f"{where}: mixtures[{index}].attention is none on kv node {key.node}")
        if entry.capture is not None and entry.capture not in captures:
            problems.append(f"{where}: mixtures[{index}] replays unknown capture {entry.capture!r}")
        if entry.also_captures and entry.capture is None:
            problems.append(f"{where}: mixtures[{index}] lists also_captures without a capture")
        for name in entry.also_captures:
            if name not in captures or name == entry.capture or entry.also_captures.count(name) > 1:
                problems.append(f"{where}: mixtures[{index}].also_captures names {name!r}, which is not another "
                                "capture family of the key")


def _capture_problems(where: str, key: KeyPlan, problems: list[str]) -> None:
    """Bucket tables agree with the sizes they are built from: batch_pad is rebuilt from
    batch_sizes (sized to the largest cap replaying the family) and must be the same table."""
    for family in key.captures:
        sizes, buckets = family.batch_sizes, family.token_buckets
        if not sizes or sizes != sorted(set(sizes)) or sizes[0] < 1:
            problems.append(f"{where}: capture {family.name}: batch_sizes {sizes} must be positive, sorted, distinct")
            continue
        if family.kind == "packed" and (not buckets or buckets != sorted(set(buckets)) or buckets[0] < 1):
            problems.append(f"{where}: capture {family.name}: token_buckets {buckets} must be positive, sorted, "
                            "distinct")
        if family.kind == "batched" and buckets:
            problems.append(f"{where}: capture {family.name}: a batched family has token_buckets {buckets}")
        # The table's length first: a tampered cap or batch size of 10**12 would otherwise have the
        # check build a table of that many entries (out of memory instead of refused); the stored
        # table's length is bounded by the file's.
        length = max(family_max_rows(key, family.name), sizes[-1]) + 1
        if len(family.batch_pad) != length:
            problems.append(f"{where}: capture {family.name}: batch_pad has {len(family.batch_pad)} entries, where "
                            f"its largest batch size ({sizes[-1]}) and the largest cap replaying it give {length}")
            continue
        expected = batch_pad_table(sizes, length - 1)
        if family.batch_pad != expected:
            at = next(b for b, (x, y) in enumerate(zip(family.batch_pad, expected)) if x != y)  # lengths equal
            problems.append(f"{where}: capture {family.name}: batch_pad disagrees with batch_sizes {sizes}: it pads "
                            f"{at} rows to {family.batch_pad[at]}, batch_sizes give {expected[at]}")


def describe(problems: list[str]) -> str:
    shown = "; ".join(problems[:MAX_PROBLEMS])
    more = len(problems) - MAX_PROBLEMS
    return shown + (f"; and {more} more" if more > 0 else "")
