"""Which torch model a plan node gets, and the (node, walk) call table the engine looks outputs up in.

In: a `Plan`. Out: `NodeKind` per node and `CallInfo` per (node, walk).

Kinds:
- `decoder`: every `kv` node (a Llama-style decoder; gated delta-net layers when the node has a
  layer pattern or recurrent state; an image-flow head when a walk feeds it `latents`);
- `codec`: a stateless node of flavour `audio_codec` (codes in, audio samples out);
- `image_decoder`: a stateless node whose walk sends an `image` to the client (latents in);
- `encoder`: any other stateless node whose outputs feed a kv node (media in, embeddings out);
  it is an audio encoder when one of its inputs is named like audio, else a vision encoder.
A spec can force the kind with a string dim `kind=decoder|codec|image_decoder|encoder`.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterator, Literal

from mstar.plan.node_args import NODE_KINDS
from mstar.plan.schema import CallPlan, EdgePlan, LoopPlan, NodePlan, Plan, SectionPlan

NodeKind = Literal["decoder", "codec", "image_decoder", "encoder"]


class NodeKindError(ValueError):
    """The engine cannot tell which model a node needs."""


@dataclass
class CallInfo:
    """What one (node, walk) call consumes and produces, merged over the walk's calls of that node."""

    node: str
    walk: str
    inputs: list[str] = field(default_factory=list)
    edges: list[EdgePlan] = field(default_factory=list)
    loop_max_iters: int = 0  # of the innermost loop around the call, 0 outside loops

    @property
    def is_image_flow(self) -> bool:
        """A call that takes `latents` is an image-flow step (BAGEL's image_gen)."""
        return "latents" in self.inputs

    @property
    def output_names(self) -> list[str]:
        """Distinct output edge names in first-seen order (one value per name per row)."""
        return list(dict.fromkeys(edge.name for edge in self.edges))


def _calls(sections: list[SectionPlan], max_iters: int) -> Iterator[tuple[CallPlan, int]]:
    for section in sections:
        if isinstance(section, CallPlan):
            yield section, max_iters
        elif isinstance(section, LoopPlan):
            yield from _calls(section.body, section.max_iters)
        else:
            yield from _calls(section.body, max_iters)


def call_table(plan: Plan) -> dict[tuple[str, str], CallInfo]:
    """(node, walk) -> CallInfo, built once at engine start."""
    table: dict[tuple[str, str], CallInfo] = {}
    for walk in plan.walks:
        for call, max_iters in _calls(walk.body, 0):
            info = table.setdefault((call.node, walk.name), CallInfo(call.node, walk.name))
            info.inputs.extend(name for name in call.inputs if name not in info.inputs)
            info.edges.extend(call.edges)
            info.loop_max_iters = max(info.loop_max_iters, max_iters)
    return table


def node_kind(plan: Plan, node: NodePlan, calls: dict[tuple[str, str], CallInfo]) -> NodeKind:
    """The model kind of `node` (rules in the module docstring)."""
    forced = node.dims.get("kind")
    if forced is not None:
        if forced not in NODE_KINDS:
            raise NodeKindError(f"node {node.name}: dims kind={forced!r} is not one of {', '.join(NODE_KINDS)}")
        return forced
    if node.engine == "kv":
        return "decoder"
    if node.flavor == "audio_codec":
        return "codec"
    edges = [edge for (name, _), info in calls.items() if name == node.name for edge in info.edges]
    if any(edge.modality == "image" for edge in edges):
        return "image_decoder"
    kv_nodes = {n.name for n in plan.nodes if n.engine == "kv"}
    if any(edge.dest_kind == "node" and edge.dest in kv_nodes for edge in edges):
        return "encoder"
    raise NodeKindError(
        f"node {node.name}: a stateless node that is not an audio codec, sends no image to the "
        "client and feeds no kv node; the engine has no model for it (set dims kind=...)"
    )


def is_audio_encoder(node: NodePlan) -> bool:
    """Audio encoders are told apart by their input names (audio_features, mel, ...)."""
    return any("audio" in name or "mel" in name for name in node.inputs + node.stream_inputs)
