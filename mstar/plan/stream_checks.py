"""A partition's stream sources against the plan's partitions, nodes and walks, and each chunk
policy's fields against its kind, as the language writes them (grammar/mw.lark `chunk_policy`):
`window(SIZE[, stride=N])`, `left_context(chunk=SIZE, context=N)`, `fixed(SIZE[,
continue_after_done])`; sizes and strides at least 1 (MW217), a context at least 0, none past MAX_STEP_TOKENS (a
chunk is a step's input of its consumer, padded to the window's size by the codec runners). The runtime's
buffers (conductor/streams.py) trust them: a stride of -1 or a left_context stream that continues
after its producer is done never finished, and the run hung; so did a continue_after_done
stream into a partition whose route is one walk (MW218).

    stream_problems(plan, part) -> Iterator[str]
"""
from __future__ import annotations

from typing import Any, Iterable, Iterator

from mstar.arg_types import shown
from mstar.plan.int_bounds import MAX_STEP_TOKENS
from mstar.plan.schema import ChunkPolicyPlan, PartitionPlan, Plan


def route_lengths(stages: Iterable[Any]) -> set[int]:
    """How many walks the routes through these stages (a spec's or a plan's: `walks`,
    `is_optional`, `sequence_lengths`) can have: an optional stage may be left out, an alternative
    may be a sequence of walks. A partition fed by streams whose route is one walk re-runs it per
    chunk until its streams end (conductor/partition_state.py)."""
    lengths = {0}
    for stage in stages:
        options = set(stage.sequence_lengths or [1] * len(stage.walks)) | ({0} if stage.is_optional else set())
        lengths = {total + extra for total in lengths for extra in options}
    return lengths


def _policy_problems(where: str, policy: ChunkPolicyPlan) -> Iterator[str]:
    if policy.size < 1:
        yield f"{where} has chunk size {policy.size}"
    for name in ("size", "stride", "context"):  # a chunk is one step's input of its consumer
        if (getattr(policy, name) or 0) > MAX_STEP_TOKENS:
            yield f"{where}: its {name} {shown(getattr(policy, name))} is past {MAX_STEP_TOKENS} items (MW217)"
    if policy.stride is not None and (policy.kind != "window" or policy.stride < 1):
        yield f"{where}: a {policy.kind} policy has stride {policy.stride} (only a window has one, at least 1)"
    if (policy.context is not None) != (policy.kind == "left_context") or (policy.context or 0) < 0:
        yield f"{where}: a {policy.kind} policy has context {policy.context} (a left_context has one, at least 0)"
    if policy.is_continue_after_done and policy.kind != "fixed":
        yield f"{where}: a {policy.kind} policy continues after done (only a fixed one can)"


def stream_problems(plan: Plan, part: PartitionPlan) -> Iterator[str]:
    """Each stream of `part`: known producer partition and consumer node, a stream input of that
    node some walk of the partition calls it on, and a policy as the language writes it."""
    where = f"partition {part.name}"
    partitions = {p.name for p in plan.partitions}
    stream_inputs = {n.name: set(n.stream_inputs) for n in plan.nodes}
    for stream in part.streams:
        if stream.producer_partition not in partitions:
            yield f"{where}: stream from unknown partition {stream.producer_partition!r}"
        if stream.consumer_node not in stream_inputs:
            yield f"{where}: stream into unknown node {stream.consumer_node!r}"
        elif stream.edge not in stream_inputs[stream.consumer_node]:
            yield f"{where}: stream {stream.edge} feeds {stream.consumer_node}, which has no such stream input"
        elif not any(c.node == stream.consumer_node and any(i.name == stream.edge for i in c.inputs)
                     for w in plan.walks if w.partition == part.name for c in w.calls):
            yield (f"{where}: no walk of the partition calls {stream.consumer_node} on stream "
                   f"{stream.edge}, so its chunks would wait forever")
        yield from _policy_problems(f"{where}: stream {stream.edge}", stream.policy)
        if stream.policy.is_continue_after_done and 1 in route_lengths(part.stages):
            yield (f"{where}: stream {stream.edge} continues after done into a partition whose one-walk route "
                   "re-runs per chunk until its streams end, so no request would end (MW218)")
