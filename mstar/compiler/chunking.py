"""Which walks of a kv node may have their prompt rows cut into chunks, and the chunk sizes.

In:  a node declaration, a walk (AST), the deployment's resolved `NodeChunking` for the node.
Out: `is_chunkable(node, walk)`; `chunk_sizes(node, walks, chunking)` -> walk -> most tokens of
     one row a step feeds (only chunkable walks, only when the scheduler owns chunking);
     `holds_only_fixed_rows(node, walks)` -> whether the walks run the node only inside loops (a
     key of such walks carries no step token budget);
     `prefix_walks(node, walks)` -> the walks whose rows may start after a cached prefix;
     `per_position_edges(node, walk)` -> the edges that keep a walk from being one;
     `prefix_cache_mode(node, is_asked)` -> the plan's prefix cache setting of the node;
     `offload_host_pages(node, asked)` -> the plan's host pool for KV offload of the node.

A row of walk W on node N may be cut when feeding its tokens in pieces, each attending over the
KV the earlier pieces wrote, computes what feeding them at once does:
- N is a kv node and attends causally in W (not one of its `bidirectional` walks);
- N runs outside every loop of W (a loop's rows are one iteration's input, and its loop-backs
  feed the next iteration: there is no prompt to cut);
- every input of N's calls in W is a sequence of positions (`tokens`, `embeddings`, `hidden`) or
  is not fed to the model (`mask`, `signal`); an image-flow step (`flow_latents`, `flow_time`)
  or raw media are never cut.
Recurrent (gated delta-net) layers carry their state from piece to piece, so they chunk too.
A walk with batching rules on N (`batching W same shape, ...`) is never cut: its rows share a step
by their class (a chunk would change a row's shape), and its steps take whole rows within the
step token budget (runtime/scheduler/batch_rules.py).
A node that cross-attends (`cross_kv`: Whisper's decoder) is never cut: its runner starts the
decoder sequence from the whole prompt (the start sequence, the detected language) and samples on
every row, so a chunk would be taken for a whole prompt (a cut Whisper prompt stopped after two
tokens).
"""
from __future__ import annotations

from typing import Iterator, Literal, Optional

from mstar.lang import ast

CUTTABLE_ROLES = frozenset({"tokens", "embeddings", "hidden", "mask", "signal"})


def node_calls(sections: list, node: str, is_in_loop: bool = False) -> Iterator[tuple[ast.Call, bool]]:
    """The calls of `node` in a section tree, each with whether a loop encloses it."""
    for section in sections:
        if isinstance(section, ast.Call):
            if section.node == node:
                yield section, is_in_loop
        else:
            yield from node_calls(section.body, node, is_in_loop or isinstance(section, ast.Loop))


def is_chunkable(node: ast.NodeDecl, walk: ast.Walk) -> bool:
    """The module docstring's rule."""
    if node.engine != "kv" or node.cross_kv:
        return False
    if node.bidirectional is not None and walk.name in node.bidirectional.walks:
        return False
    if any(batching.walk == walk.name for batching in node.batching):
        return False
    roles = {i.name: i.role for i in node.inputs}
    calls = list(node_calls(walk.body, node.name))
    return bool(calls) and all(
        not is_in_loop and all(roles.get(name) in CUTTABLE_ROLES for name in call.inputs)
        for call, is_in_loop in calls
    )


def holds_only_fixed_rows(node: ast.NodeDecl, walks: list[ast.Walk]) -> bool:
    """Whether every call of `node` in `walks` sits inside a loop (and there is one): their rows are
    loop iterations of a fixed size, never cut and never a prompt, so a key holding only them has
    nothing for a step token budget to bound but its rows, which its cap bounds already (Cosmos 3's
    image_gen: 8 rows of 1,560 latent tokens a step; a budget sized for prompt chunks would hold it
    to one row a step)."""
    calls = [is_in_loop for walk in walks for _, is_in_loop in node_calls(walk.body, node.name)]
    return bool(calls) and all(calls)


def chunk_sizes(node: ast.NodeDecl, walks: list[ast.Walk], chunk_size: Optional[int]) -> dict[str, int]:
    """walk -> chunk size for the chunkable walks among `walks` (empty without a chunk size)."""
    if chunk_size is None:
        return {}
    return {walk.name: chunk_size for walk in walks if is_chunkable(node, walk)}


PrefixCacheMode = Literal["off", "pages", "recurrent_state", "cross_attention"]


def prefix_cache_mode(node: ast.NodeDecl, is_asked: bool) -> PrefixCacheMode:
    """The plan's `KvPoolPlan.prefix_cache` of a kv node: "pages" when the deployment asks for the
    cache on it (`is_asked`); "recurrent_state" when it asks but the node keeps recurrent state (no
    KV page holds it, MW424), "cross_attention" when the node cross-attends (its KV depends on more
    than its tokens, MW428): off, and the plan says why."""
    if not is_asked:
        return "off"
    if any(s.kind == "recurrent" for s in node.states):
        return "recurrent_state"
    return "cross_attention" if node.cross_kv else "pages"


# Outputs that hold a value per fed position (the torch engine's `DecoderRunner._outputs`): hidden
# states, except those that loop back into the node (its last position only), and masks. A cached
# prefix's positions are never computed, so they would send nothing for those.
PER_POSITION_ROLES = frozenset({"hidden", "mask"})


def prefix_walks(node: ast.NodeDecl, walks: list[ast.Walk]) -> list[str]:
    """Walks whose first row on `node` may start after a request's cached prefix: they can be cut
    (a cached prefix is one chunk already fed), the node's call in them takes the text prompt
    (a cache hit is found by the prompt's token ids), runs the node's own model (cached pages
    hold that model's KV, not a sub-model's) and sends no output with a value per prompt position
    (`per_position_edges`: the cached positions would send nothing)."""
    return [walk.name for walk in prompt_walks(node, walks) if not per_position_edges(node, walk)]


def prompt_walks(node: ast.NodeDecl, walks: list[ast.Walk]) -> list[ast.Walk]:
    """`prefix_walks` before its last condition: cut, taking the text prompt, on the node's model."""
    prompt_inputs = {i.name for i in node.inputs if i.prompt == "text"}
    on_submodels = {walk for sub in node.submodels if sub.samples is None for walk in sub.walks}
    return [walk for walk in walks if is_chunkable(node, walk) and walk.name not in on_submodels
            and all(not prompt_inputs.isdisjoint(call.inputs) for call, _ in node_calls(walk.body, node.name))]


def per_position_edges(node: ast.NodeDecl, walk: ast.Walk) -> list[ast.Edge]:
    """The edges of `node`'s calls in `walk` that carry an output with a value per position (a
    hidden output any edge of the call loops back into the node is its last position's only)."""
    roles = {o.name: o.role for o in node.outputs}
    found = []
    for call, _ in node_calls(walk.body, node.name):
        looped = {edge.name for edge in call.edges if edge.dest == node.name}
        found += [edge for edge in call.edges if roles.get(edge.name) in PER_POSITION_ROLES
                  and not (roles.get(edge.name) == "hidden" and edge.name in looped)]
    return found


def offload_host_pages(node: ast.NodeDecl, asked: int) -> int:
    """The plan's `KvPoolPlan.host_pages` of a kv node: the pages the deployment asks for, or 0 on a
    node that cross-attends (`cross_kv`, a Whisper decoder: its runner keeps each request's KV
    outside the paged pool, one request at a time, so no page of it can move; MW430)."""
    return 0 if node.cross_kv else asked
