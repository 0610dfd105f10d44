"""A walk as the compiler first lowers it: a tree of sections (compiler-internal, never in a plan).

In:  built by `lower_walks` from the checked AST (params resolved, loop-backs derived, stream
     edges given their consumer partition), or by hand in tests.
Out: read by the passes that reason about structure (`lower_keys`, `lower_workers`,
     `graph_picture`) and by `lower_tables`, which turns each tree into the walk tables the plan
     carries (mstar/plan/schema.py `WalkPlan`).

    TreeCall        node, inputs, edges
    TreeSequential  body run in order
    TreeParallel    members started together; it ends when all have ended
    TreeLoop        name, max_iters, has_stop, nodes, loop_back, is_on_device, outputs,
                    accumulate, body
"""
from __future__ import annotations

from typing import Annotated, Iterator, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field


class _TreeModel(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class TreeEdge(_TreeModel):
    """An output edge. dest_kind says where it goes; for `node` and `stream`, dest is the node."""

    name: str
    dest_kind: Literal["node", "conductor", "client", "stream"]
    dest: str = ""
    is_persist: bool = False
    is_device: bool = False  # on-device loop-back: the value never visits the host
    is_loop_back: bool = False
    is_count_tokens: bool = False
    modality: Optional[str] = None
    stream_partition: Optional[str] = None  # consumer partition for dest_kind == "stream"


class TreeCall(_TreeModel):
    kind: Literal["call"] = "call"
    node: str
    inputs: list[str]
    edges: list[TreeEdge]


class TreeParallel(_TreeModel):
    kind: Literal["parallel"] = "parallel"
    body: list["TreeSection"]


class TreeSequential(_TreeModel):
    kind: Literal["sequential"] = "sequential"
    body: list["TreeSection"]


class TreeLoop(_TreeModel):
    kind: Literal["loop"] = "loop"
    name: str  # unnamed loops get `<walk>.loop<i>`; only has_stop loops stop early
    max_iters: int  # params resolved
    count_param: Optional[str] = None  # `count=PARAM`: the request sets its iterations by this name
    default_count: Optional[int] = None  # the param's value: the iterations a request runs by default
    has_stop: bool
    nodes: list[str]
    loop_back: list[TreeEdge]
    is_on_device: bool  # every loop-back edge stays on the device
    outputs: list[str]
    accumulate: list[str]
    body: list["TreeSection"]


TreeSection = Annotated[Union[TreeCall, TreeParallel, TreeSequential, TreeLoop], Field(discriminator="kind")]


class WalkTree(_TreeModel):
    name: str
    partition: str
    nodes: list[str]  # nodes the walk runs, in first-use order
    body: list[TreeSection]


TreeParallel.model_rebuild()
TreeSequential.model_rebuild()
TreeLoop.model_rebuild()
WalkTree.model_rebuild()


def iter_calls(sections: list) -> Iterator[TreeCall]:
    """Every call of a section tree, loops included, in source order."""
    for section in sections:
        if isinstance(section, TreeCall):
            yield section
        else:
            yield from iter_calls(section.body)


def iter_loops(sections: list) -> Iterator[TreeLoop]:
    """Every loop of a section tree (outer before inner), in source order."""
    for section in sections:
        if isinstance(section, TreeLoop):
            yield section
        if not isinstance(section, TreeCall):
            yield from iter_loops(section.body)


def loops_back_into(walk: WalkTree, node: str) -> list[TreeEdge]:
    """The loop-back edges of `walk` that feed `node` (its own output fed back to it)."""
    return [e for loop in iter_loops(walk.body) if node in loop.nodes for e in loop.loop_back if e.dest == node]


def has_device_loop_back(walk: WalkTree, node: str) -> bool:
    """Does `node` run inside a loop of `walk` whose loop-backs all stay on the device."""
    return any(loop.is_on_device and node in loop.nodes for loop in iter_loops(walk.body))
