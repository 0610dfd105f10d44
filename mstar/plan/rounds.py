"""How many rounds a node's walks may run in one request.

A partition that repeats (`repeat while VALUE max=N`, `PartitionPlan.repeat`: Whisper's long-form
windows) runs its stages again from the first, each round on a new sequence, at most N rounds.

    max_rounds(plan, nodes) -> int   the most rounds a partition holding a walk that calls one of
                                     `nodes` may run; 1 when none of them repeats
    kv_rounds(plan) -> int           max_rounds over the plan's kv nodes: a request's prompt +
                                     max_tokens may reach max_seq_len x that
    max_request_tokens(plan) -> int  that bound, max_seq_len x kv_rounds(plan)

Its users: the audio a request may bring (one front-end window a round, serve/audio_input.py) and
the tokens a request may ask (max_seq_len a round on the kv nodes: serve/api.py, `mstar run`'s
generated workload). A repeating partition that holds none of the nodes does not raise their bound.
"""
from __future__ import annotations

from collections.abc import Iterable

from mstar.plan.schema import Plan


def max_rounds(plan: Plan, nodes: Iterable[str]) -> int:
    names = set(nodes)
    walks = {walk.name for walk in plan.walks if any(call.node in names for call in walk.calls)}
    return max((p.repeat.max_rounds for p in plan.partitions
                if p.repeat is not None and any(set(stage.walks) & walks for stage in p.stages)), default=1)


def kv_rounds(plan: Plan) -> int:
    return max_rounds(plan, (node.name for node in plan.nodes if node.engine == "kv"))


def max_request_tokens(plan: Plan) -> int:
    """The tokens a request may reach, prompt + max_tokens: max_seq_len a round of a repeating
    partition holding the kv nodes' walks."""
    return plan.deployment.max_seq_len * kv_rounds(plan)
