"""Which torch model a plan node gets, and the (node, walk) call table the engine looks outputs up in.

In: a `Plan`. Out: `NodePlan.model_kind` (stated in the spec: a kv node is a `decoder`, a stateless
node an `audio_codec`, `image_decoder`, `vision_encoder` or `audio_encoder`) and `CallInfo` per
(node, walk), which carries the roles of the call's inputs and outputs (docs/language.md "Roles").
Nothing here reads meaning from a name: a name is only a key into the plan's role tables.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from mstar.plan.schema import EdgePlan, NodePlan, Plan


@dataclass
class CallInfo:
    """What one (node, walk) call consumes and produces, merged over the walk's calls of that node.

    input_roles / output_roles: the node's declared role of each input the call takes and of each
    output its edges carry (name -> role)."""

    node: str
    walk: str
    inputs: list[str] = field(default_factory=list)
    edges: list[EdgePlan] = field(default_factory=list)
    loop_max_iters: int = 0  # of the innermost loop around the call, 0 outside loops
    input_roles: dict[str, str] = field(default_factory=dict)
    output_roles: dict[str, str] = field(default_factory=dict)

    @property
    def is_image_flow(self) -> bool:
        """A call that takes flow latents is an image-flow step (BAGEL's image_gen)."""
        return self.input_with("flow_latents") is not None

    def input_with(self, role: str) -> Optional[str]:
        """The first input of the call with `role`, else None."""
        return next((name for name in self.inputs if self.input_roles.get(name) == role), None)

    @property
    def output_names(self) -> list[str]:
        """Distinct output edge names in first-seen order (one value per name per row)."""
        return list(dict.fromkeys(edge.name for edge in self.edges))


def call_table(plan: Plan) -> dict[tuple[str, str], CallInfo]:
    """(node, walk) -> CallInfo, built once at engine start."""
    nodes: dict[str, NodePlan] = {n.name: n for n in plan.nodes}
    table: dict[tuple[str, str], CallInfo] = {}
    for walk in plan.walks:
        for call in walk.calls:
            max_iters = walk.loops[call.loop].max_iters if call.loop is not None else 0
            info = table.setdefault((call.node, walk.name), CallInfo(call.node, walk.name))
            info.inputs.extend(i.name for i in call.inputs if i.name not in info.inputs)
            info.edges.extend(call.edges)
            info.loop_max_iters = max(info.loop_max_iters, max_iters)
            node = nodes.get(call.node)
            if node is not None:
                roles = {r.name: r.role for r in node.input_roles}
                outputs = {o.name: o.role for o in node.outputs}
                info.input_roles.update((i.name, roles[i.name]) for i in call.inputs if i.name in roles)
                info.output_roles.update((e.name, outputs[e.name]) for e in call.edges if e.name in outputs)
    return table
