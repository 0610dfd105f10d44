"""Random valid worker plans for scheduler tests, built the way the compiler's tables read.

`build_key` makes one KeyPlan from walk caps, an optional combined cap, rows limits and capture
batch sizes: mixture caps follow the rule "one walk keeps its cap; a mixed step takes the combined
cap when given, else the smallest cap among the walks present". `worker_plans` (a hypothesis
strategy) draws a whole worker: several keys, speculation switches and, optionally, a TP key that
rank 0 leads and rank 1 follows.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from hypothesis import strategies as st

from mstar.plan.schema import (
    CaptureFamily,
    DeploymentPlan,
    KeyPlan,
    MixtureEntry,
    SpeculationPlan,
    TPGroup,
    WorkerPlan,
)


def batch_pad(sizes: list[int]) -> list[int]:
    """batch_pad[b] = smallest size >= b (0 above all); index 0 unused."""
    top = max(sizes)
    return [0] + [min(s for s in sizes if s >= b) for b in range(1, top + 1)]


def batched_family(name: str, sizes: list[int]) -> CaptureFamily:
    sizes = sorted(set(sizes))
    return CaptureFamily(
        name=name, kind="batched", batch_sizes=sizes, batch_pad=batch_pad(sizes),
        num_graphs=len(sizes), memory_bytes=0,
    )


def packed_family(name: str, sizes: list[int], token_buckets: list[int]) -> CaptureFamily:
    sizes, token_buckets = sorted(set(sizes)), sorted(set(token_buckets))
    return CaptureFamily(
        name=name, kind="packed", batch_sizes=sizes, token_buckets=token_buckets,
        batch_pad=batch_pad(sizes), num_graphs=len(sizes) * len(token_buckets), memory_bytes=0,
    )


def build_key(
    node: str,
    walks: list[str],
    caps: dict[str, int],
    combined: Optional[str] = None,
    combined_cap: Optional[int] = None,
    rows_limits: Optional[dict[str, int]] = None,
    walk_captures: Optional[dict[str, list[int]]] = None,
    mixed_capture: Optional[tuple[list[int], list[int]]] = None,
) -> KeyPlan:
    """One scheduling key with a mixture entry for every non-empty subset of `walks`."""
    is_combined = combined is not None
    name = f"{node}:{combined if is_combined else walks[0]}"
    families: dict[int, CaptureFamily] = {}
    captures: list[CaptureFamily] = []
    for i, walk in enumerate(walks):
        sizes = (walk_captures or {}).get(walk)
        if sizes:
            family = batched_family(f"{node}:{walk}", sizes)
            families[1 << i] = family
            captures.append(family)
    mixed_family = None
    if is_combined and mixed_capture is not None:
        mixed_family = packed_family(f"{node}:{combined}", *mixed_capture)
        captures.append(mixed_family)
    mixtures = [MixtureEntry(mask=0, walks=[], cap=0, attention="none")]
    for mask in range(1, 1 << len(walks)):
        present = [walk for i, walk in enumerate(walks) if mask >> i & 1]
        if len(present) == 1:
            family = families.get(mask)
            mixtures.append(MixtureEntry(
                mask=mask, walks=present, cap=caps[present[0]], label=present[0],
                capture=family.name if family else None,
                attention="decode" if present[0].startswith("d") else "prefill",
            ))
        else:
            cap = combined_cap if combined_cap is not None else min(caps[w] for w in present)
            mixtures.append(MixtureEntry(
                mask=mask, walks=present, cap=cap,
                capture=mixed_family.name if mixed_family else None, attention="split",
            ))
    return KeyPlan(
        name=name, node=node, walks=walks, is_combined=is_combined, mixtures=mixtures,
        rows_limits=dict(rows_limits or {}), captures=sorted(captures, key=lambda f: f.name),
    )


@dataclass
class WorkerCase:
    """A drawn worker: rank 0's plan, and rank 1's when a TP key is present (rank 1 follows it)."""

    leader: WorkerPlan
    follower: Optional[WorkerPlan]
    deployment: DeploymentPlan
    tp_key: Optional[str]


def assemble_worker(
    rank: int, keys: list[KeyPlan], specs: list[SpeculationPlan], tp_groups: list[TPGroup]
) -> WorkerPlan:
    placements = sorted(f"{key.node}/{walk}" for key in keys for walk in key.walks)
    walk_to_key = {f"{key.node}/{walk}": key.name for key in keys for walk in key.walks}
    return WorkerPlan(
        rank=rank, placements=placements, walk_to_key=walk_to_key, keys=keys,
        speculation=specs, tp_groups=tp_groups, capture_memory_bytes=0,
    )


@st.composite
def key_plans(draw, node: str) -> KeyPlan:
    num_walks = draw(st.integers(1, 3))
    walks = ["decode", "prefill", "extra"][:num_walks]
    caps = {walk: draw(st.integers(1, 8)) for walk in walks}
    combined = "mixed" if num_walks > 1 else None
    combined_cap = draw(st.one_of(st.none(), st.integers(1, 12))) if combined else None
    rows_limits = {}
    if combined:
        for walk in walks:
            if draw(st.booleans()):
                rows_limits[walk] = draw(st.integers(1, 6))
    walk_captures = {
        walk: draw(st.lists(st.integers(1, 10), min_size=1, max_size=3))
        for walk in walks if draw(st.booleans())
    }
    mixed_capture = None
    if combined and draw(st.booleans()):
        mixed_capture = (
            draw(st.lists(st.integers(1, 12), min_size=1, max_size=3)),
            draw(st.lists(st.integers(1, 64), min_size=1, max_size=3)),
        )
    return build_key(node, walks, caps, combined, combined_cap, rows_limits, walk_captures, mixed_capture)


@st.composite
def worker_cases(draw, with_tp: Optional[bool] = None, max_keys: int = 3) -> WorkerCase:
    """A random worker with 1..max_keys keys (one node each); with_tp None = maybe a TP key."""
    num_keys = draw(st.integers(1, max_keys))
    keys = [draw(key_plans(f"N{i}")) for i in range(num_keys)]
    specs = [
        SpeculationPlan(node=key.node, walk=walk, can_speculate=draw(st.booleans()),
                        mixes_walks=draw(st.booleans()))
        for key in keys for walk in key.walks
    ]
    has_tp = draw(st.booleans()) if with_tp is None else with_tp
    max_follow = draw(st.integers(1, 3))
    deployment = DeploymentPlan(max_seq_len=4096, kv_pools=[], max_consecutive_follower_batches=max_follow)
    if not has_tp:
        return WorkerCase(assemble_worker(0, keys, specs, []), None, deployment, None)
    tp_key = keys[-1]
    group = TPGroup(node=tp_key.node, walks=tp_key.walks, ranks=[0, 1], tp_size=2, sp_size=1, leader=0)
    # Lockstep nodes never speculate (the compiler sets can_speculate False for them).
    specs = [
        SpeculationPlan(node=s.node, walk=s.walk, can_speculate=False, mixes_walks=s.mixes_walks)
        if s.node == tp_key.node else s
        for s in specs
    ]
    leader = assemble_worker(0, keys, specs, [group])
    follower = assemble_worker(1, keys, specs, [group])
    return WorkerCase(leader, follower, deployment, tp_key.name)
