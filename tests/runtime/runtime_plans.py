"""Plans for the runtime tests: the checked-in generated plans, and small hand-built ones.

`generated(name)` loads generated/<name>.plan without re-hashing its inputs (so a spec edit in
progress elsewhere does not break these tests). `hand_plan(walks, partitions, nodes)` lowers
hand-written walks (section trees, mstar/compiler/walk_tree.py) into walk tables and wraps them
in a one-worker plan with one eager key per (node, walk), cap 8, so the driver and scheduler can
run them.
"""
from __future__ import annotations

from pathlib import Path
from typing import Optional

from plan_roles import with_roles
from mstar.compiler.lower_tables import lower_walk_tables
from mstar.compiler.walk_tree import TreeCall as CallPlan, TreeEdge as EdgePlan, TreeLoop as LoopPlan
from mstar.compiler.walk_tree import WalkTree as WalkPlan
from mstar.plan.io import load_plan
from mstar.plan.schema import (
    DeploymentPlan, Hashes, Header, KeyPlan, KvPoolPlan, MixtureEntry, NodePlan, PartitionPlan, Plan,
    SpeculationPlan, StagePlan, WorkerPlan,
)

ROOT = Path(__file__).resolve().parents[2]


def generated(name: str) -> Plan:
    return load_plan(ROOT / "generated" / f"{name}.plan", verify=False)


def _calls(walk: WalkPlan):
    stack = list(walk.body)
    while stack:
        section = stack.pop()
        if isinstance(section, CallPlan):
            yield section
        else:
            stack.extend(section.body)


def one_worker(walks: list[WalkPlan], nodes: list[NodePlan], cap: int = 8) -> WorkerPlan:
    placements = sorted({f"{call.node}/{walk.name}" for walk in walks for call in _calls(walk)})
    keys = []
    for placement in placements:
        node, walk = placement.split("/")
        keys.append(KeyPlan(
            name=f"{node}:{walk}", node=node, walks=[walk], is_combined=False,
            mixtures=[MixtureEntry(mask=0, walks=[], cap=0, attention="none"),
                      MixtureEntry(mask=1, walks=[walk], cap=cap, label=walk, attention="prefill")],
        ))
    speculation = [SpeculationPlan(node=p.split("/")[0], walk=p.split("/")[1], can_speculate=False, mixes_walks=False)
                   for p in placements]
    return WorkerPlan(rank=0, placements=placements, walk_to_key={p: p.replace("/", ":") for p in placements},
                      keys=keys, speculation=speculation, tp_groups=[], capture_memory_bytes=0)


def hand_plan(walks: list[WalkPlan], partitions: list[PartitionPlan], nodes: list[NodePlan],
              num_pages: int = 4096, max_concurrent: Optional[int] = None) -> Plan:
    header = Header(compiler_version="test", model="test", deployment="test", spec_path="", deployment_path="",
                    glue_path="", hashes=Hashes(spec="", deployment="", glue=""))
    kv_pools = [KvPoolPlan(node=n.name, page_size=16, num_pages=num_pages, max_seq_len=4096)
                for n in nodes if n.engine == "kv"]
    nodes = [with_roles(n, walks) if not n.input_roles and not n.outputs else n for n in nodes]
    instances = {(call.node, walk.name): [[0]] for walk in walks for call in _calls(walk)}
    tables = lower_walk_tables(walks, partitions, nodes, instances)
    return Plan(header=header, params={}, nodes=nodes, walks=tables, partitions=partitions,
                deployment=DeploymentPlan(max_seq_len=4096, max_concurrent_requests=max_concurrent, kv_pools=kv_pools),
                workers=[one_worker(walks, nodes)])


def kv_node(name: str, inputs: list[str], stream_inputs: tuple[str, ...] = ()) -> NodePlan:
    """Roles are filled in by `hand_plan` from the walks (plan_roles.with_roles)."""
    return NodePlan(name=name, engine="kv", model_kind="decoder", dims={"layers": 2, "hidden": 64}, inputs=inputs,
                    stream_inputs=list(stream_inputs), input_roles=[], outputs=[])


def stateless_node(name: str, inputs: list[str], stream_inputs: tuple[str, ...] = ()) -> NodePlan:
    return NodePlan(name=name, engine="stateless", model_kind="audio_codec", dims={}, inputs=inputs,
                    stream_inputs=list(stream_inputs), input_roles=[], outputs=[])


def edge(name: str, kind: str = "node", dest: str = "", **flags) -> EdgePlan:
    return EdgePlan(name=name, dest_kind=kind, dest=dest, **flags)


def call(node: str, inputs: list[str], *edges: EdgePlan) -> CallPlan:
    return CallPlan(node=node, inputs=inputs, edges=list(edges))


def loop(name: str, max_iters: int, body: list, *, has_stop: bool = False, nodes: list[str],
         outputs: tuple[str, ...] = (), accumulate: tuple[str, ...] = ()) -> LoopPlan:
    loop_back = [e for c in body if isinstance(c, CallPlan) for e in c.edges if e.is_loop_back]
    return LoopPlan(name=name, max_iters=max_iters, has_stop=has_stop, nodes=nodes, loop_back=loop_back,
                    is_on_device=all(e.is_device for e in loop_back), outputs=list(outputs),
                    accumulate=list(accumulate), body=body)


def walk(name: str, partition: str, *body) -> WalkPlan:
    nodes = []
    for section in body:
        calls = [section] if isinstance(section, CallPlan) else list(
            _calls(WalkPlan(name="x", partition="x", nodes=[], body=[section])))
        for c in calls:
            if c.node not in nodes:
                nodes.append(c.node)
    return WalkPlan(name=name, partition=partition, nodes=nodes, body=list(body))


def partition(name: str, *stages: list[str], initial: Optional[str] = "first", streams=(),
              optional=()) -> PartitionPlan:
    first = stages[0][0] if stages and initial == "first" else initial
    return PartitionPlan(name=name,
                         stages=[StagePlan(walks=s, is_optional=i in optional) for i, s in enumerate(stages)],
                         initial_walk=first, streams=list(streams))


class Names:
    """Fresh node names n1, n2, ... for generated walk trees."""

    def __init__(self):
        self.next = 0

    def name(self) -> str:
        self.next += 1
        return f"n{self.next}"


def section_shapes(depth: int):
    """A hypothesis strategy of section trees up to `depth` deep: ("call",), ("seq", children),
    ("par", children), ("loop", count 1-3, children)."""
    from hypothesis import strategies as st

    leaf = st.just(("call",))
    if depth == 0:
        return leaf
    inner = st.lists(section_shapes(depth - 1), min_size=1, max_size=3)
    return st.one_of(
        leaf,
        st.tuples(st.just("seq"), inner),
        st.tuples(st.just("par"), inner),
        st.tuples(st.just("loop"), st.integers(1, 3), inner),
    )
