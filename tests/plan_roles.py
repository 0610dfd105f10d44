"""Roles for hand-built test plans: what a compiled plan states from the spec's roles.

`with_roles(node, walks, prompt="text_inputs", kind=None, output_roles=None, input_roles=None)`
returns the node with `input_roles` (every input `tokens` unless `input_roles` says otherwise; the
input named `prompt` takes the text prompt), `outputs` (every edge name its calls in `walks` carry,
`tokens` unless `output_roles` says otherwise; `walks` are section trees, as hand-built plans
write them) and `model_kind` (a kv node is a decoder, a stateless one an audio codec unless `kind`
says otherwise). Test data only: the runtime never sees the names.
"""
from __future__ import annotations

from typing import Optional

from mstar.compiler.walk_tree import TreeCall as CallPlan, WalkTree as WalkPlan
from mstar.plan.schema import InputPlan, NodePlan, OutputPlan


def _calls(sections):
    for section in sections:
        if isinstance(section, CallPlan):
            yield section
        else:
            yield from _calls(section.body)


def with_roles(node: NodePlan, walks: list[WalkPlan], prompt: Optional[str] = "text_inputs",
               kind: Optional[str] = None, output_roles: Optional[dict[str, str]] = None,
               input_roles: Optional[dict[str, str]] = None) -> NodePlan:
    input_roles = input_roles or {}
    output_roles = output_roles or {}
    inputs = [InputPlan(name=name, role=input_roles.get(name, "tokens"),
                        prompt="text" if name == prompt and name in node.inputs else None)
              for name in list(dict.fromkeys(node.inputs + node.stream_inputs))]
    names = [edge.name for walk in walks for call in _calls(walk.body) if call.node == node.name for edge in call.edges]
    outputs = [OutputPlan(name=name, role=output_roles.get(name, "tokens")) for name in dict.fromkeys(names)]
    model_kind = "decoder" if node.engine == "kv" else (kind or "audio_codec")
    return node.model_copy(update={"input_roles": inputs, "outputs": outputs, "model_kind": model_kind})


def node_plan(name: str, engine: str, walks: list[WalkPlan], **fields) -> NodePlan:
    """A NodePlan built with empty roles, then `with_roles` (extra keyword arguments: `prompt`,
    `kind`, `output_roles`, `input_roles` go to with_roles, the rest to NodePlan)."""
    role_args = {k: fields.pop(k) for k in ("prompt", "kind", "output_roles", "input_roles") if k in fields}
    model_kind = "decoder" if engine == "kv" else "audio_codec"
    node = NodePlan(name=name, engine=engine, model_kind=model_kind, input_roles=[], outputs=[], **fields)
    return with_roles(node, walks, **role_args)
