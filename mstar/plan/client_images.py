"""Which call outputs of a plan reach the client as images.

In: a `WalkPlan`. Out: `image_outputs(walk) -> [(node, edge name)]`, the outputs of the walk's calls
whose value the client takes as an image: an edge to the client of modality `image`, or a loop's
output or accumulated edge whose exit hands it on to the client as one. The endpoints (which nodes
make a route's images, to check a request's `size`) and the simulated engine (which outputs get an
image placeholder) both read it, so a decoder inside a loop counts for both or for neither.
"""
from __future__ import annotations

from typing import Optional

from mstar.plan.schema import EdgePlan, WalkPlan


def image_outputs(walk: WalkPlan) -> list[tuple[str, str]]:
    exits: dict[tuple[Optional[int], Optional[int]], Optional[EdgePlan]] = {
        (index, number): x.edge for index, loop in enumerate(walk.loops) for number, x in enumerate(loop.exits)}
    found: list[tuple[str, str]] = []
    for call in walk.calls:
        for edge in call.edges:
            onward = exits.get((edge.loop, edge.exit)) if edge.action in ("loop_output", "loop_accumulate") else edge
            if onward is not None and onward.dest_kind == "client" and onward.modality == "image" \
                    and (call.node, edge.name) not in found:
                found.append((call.node, edge.name))
    return found
