"""Which torch model a plan node gets, and the (node, walk) call table the engine looks outputs up in.

In: a `Plan`. Out: `NodePlan.model_kind` (stated in the spec: a kv node is a `decoder`, a stateless
node an `audio_codec`, `image_decoder`, `vision_encoder` or `audio_encoder`) and `CallInfo` per
(node, walk), which carries the roles of the call's inputs and outputs (docs/language.md "Roles").
Nothing here reads meaning from a name: a name is only a key into the plan's role tables.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from mstar.plan.schema import EdgePlan, NodePlan, Plan, WalkPlan


@dataclass
class CallInfo:
    """What one (node, walk) call consumes and produces, merged over the walk's calls of that node.

    input_roles / output_roles: the node's declared role of each input the call takes and of each
    output its edges carry (name -> role). request_inputs: the inputs whose value is always the
    request's own media (`_request_media`), so a value the node cannot take there is the
    client's fault; any other input's value came from the deployment (another node, a stand-in)."""

    node: str
    walk: str
    inputs: list[str] = field(default_factory=list)
    edges: list[EdgePlan] = field(default_factory=list)
    loop_max_iters: int = 0  # of the innermost loop around the call, 0 outside loops
    input_roles: dict[str, str] = field(default_factory=dict)
    output_roles: dict[str, str] = field(default_factory=dict)
    request_inputs: frozenset[str] = frozenset()
    # the call sends a sampled token to the client as text, one an emission (`sends_text_tokens`):
    # the token whose log-probabilities a request may ask for (RowResult.logprobs)
    sends_text_tokens: bool = False

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
    for info in table.values():
        info.sends_text_tokens = any(_is_text_token_sink(edge, info.output_roles) for edge in info.edges)
    persisted = {edge.name for walk in plan.walks for edge in _edges(walk) if edge.is_persist}
    for walk in plan.walks:
        for name in {call.node for call in walk.calls}:
            table[(name, walk.name)].request_inputs = _request_media(walk, name, persisted)
    return table


def _is_text_token_sink(edge: EdgePlan, output_roles: dict[str, str]) -> bool:
    """An edge that hands each sampled token to the client as text when the call runs (not at a
    loop's exit, where a loop's accumulated tokens leave together)."""
    return (edge.action == "sink" and edge.dest_kind == "client" and edge.modality == "text"
            and output_roles.get(edge.name, "tokens") == "tokens")


def _request_media(walk: WalkPlan, node: str, persisted: set[str]) -> frozenset[str]:
    """The inputs of `node`'s calls in `walk` that take the request's own media and nothing else:
    each call sources them from the request's prompt of an image or audio modality, with no run
    slot (no edge of the walk fills them) and under a name no edge of the plan persists (the
    conductor hands a persisted value of that name first: a codec's audio, say). An input some
    call of the walk feeds otherwise is left out: its value may be another node's."""
    brought: set[str] = set()
    fed: set[str] = set()
    for call in walk.calls:
        if call.node != node:
            continue
        for source in call.inputs:
            is_media = source.source == "prompt" and source.prompt is not None and source.prompt != "text"
            is_own = is_media and not source.slots and source.name not in persisted
            (brought if is_own else fed).add(source.name)
    return frozenset(brought - fed)


def _edges(walk: WalkPlan) -> list[EdgePlan]:
    """Every edge of the walk: its calls' and the onward edges its loops' exits take."""
    exits = [x.edge for loop in walk.loops for x in loop.exits if x.edge is not None]
    return [edge for call in walk.calls for edge in call.edges] + exits


def prompt_logprob_calls(plan: Any, calls: dict[tuple[str, str], CallInfo]) -> frozenset[tuple[str, str]]:
    """The (node, walk) calls that give a request's prompt log-probabilities (engine/prompt_logprobs.py):
    the first node's, in plan order, that take the text prompt (an input whose role says `prompt
    text`) outside any loop and send text tokens to the client; empty when the plan has none.
    Here, without torch, so the Python API can refuse such a request before it runs."""
    for node in plan.nodes:
        prompt_inputs = {role.name for role in node.input_roles if role.prompt == "text"}
        found = frozenset(key for key, call in calls.items()
                          if key[0] == node.name and call.loop_max_iters == 0 and call.sends_text_tokens
                          and prompt_inputs.intersection(call.inputs))
        if found:
            return found
    return frozenset()
