"""Part of pass 5: the step token budget, chunk sizes, caps and token buckets of each kv node
checked against each other, and a prefix cache that cannot apply.

In:  a checked `Spec`, its `Deployment`, the run's `Diagnostics`.
Out: nothing; adds MW420-MW424 and MW428-MW431 (warnings for switches that are given but cannot
apply).

Per kv node, with the budget and chunk size `Deployment.chunking_for` resolves:
- MW420: the chunk size is at most the budget (a chunk the budget could never hold);
- MW421: a full step of a walk whose rows cannot be cut (the node runs in a loop of it: a decode
  iteration) fits the budget: cap x tokens a row <= budget (a combined walk's larger cap counts),
  else decode rows alone would break it; and, when prompts are cut, below it (a chunk needs room);
- MW422: every packed capture that a step holding chunks replays has a token bucket that holds
  the budget (else the fullest steps, the common case under load, run eagerly); without a
  budget, a bucket that holds one chunk;
- MW423 (warning): `max_prefill_chunk_size` without `scheduler_owns_chunking`: mstar cuts prompts
  only in the scheduler, so the key is not read (kv_pool.nodes.NODE.max_prefill_chunk_size is);
- MW424 (warning): a prefix cache asked for on a node with recurrent state: the state after a
  prefix is not in any KV page, so no page can be shared; the plan says `recurrent_state` and
  the cache stays off there;
- MW428 (warning): a prefix cache asked for on a node with cross-attention KV (`cross_kv`): its
  self-attention K/V after the first layer depend on what it cross-attends (a Whisper decoder's
  on the audio), not on its token ids alone, so no page can be shared by them; the plan says
  `cross_attention` and the cache stays off there;
- MW429 (warning): a walk that takes the node's text prompt sends an output with a value per
  prompt position (hidden states that do not loop back, a mask: Qwen3-Omni's Thinker streams its
  states to the Talker; `chunking.per_position_edges`): a row starting after a cached prefix would
  send nothing for the cached positions, so the walk is not one of the plan's `prefix_walks` and its
  prompts are computed whole;
- MW430 (warning): KV offload (`cpu_offload_pages`) asked for on a node that cross-attends: its
  runner keeps each request's KV outside the paged pool, so nothing can move; the plan's
  `host_pages` is 0 there;
- MW431 (warning): a prefix cache asked for where no walk can use it (a node's own switch, or the
  deployment-wide one when it serves no node): no walk takes the node's text prompt and can be cut,
  so the plan's `prefix_walks` is empty and nothing is ever looked up.
"""
from __future__ import annotations

from mstar.compiler import codes
from mstar.compiler.chunking import (
    holds_only_fixed_rows,
    is_chunkable,
    node_calls,
    per_position_edges,
    prefix_cache_mode,
    prompt_walks,
)
from mstar.compiler.deployment import Deployment, NodeChunking
from mstar.compiler.lower_keys import walk_cap, walk_captures
from mstar.lang import ast
from mstar.lang.diagnostics import Diagnostics, Note


def run(spec: ast.Spec, deployment: Deployment, diags: Diagnostics) -> None:
    if deployment.max_prefill_chunk_size is not None and not deployment.scheduler_owns_chunking:
        diags.warning(codes.CHUNKING_NOT_OWNED,
                      "max_prefill_chunk_size is not read without scheduler_owns_chunking: true (mstar cuts "
                      "prompts in the scheduler only); prompts run whole unless kv_pool.nodes.NODE."
                      "max_prefill_chunk_size is set",
                      deployment.span_of("max_prefill_chunk_size"))
    served: dict[str, bool] = {}  # kv node asked for a prefix cache -> whether some walk can use it
    for node in spec.nodes:
        if node.engine != "kv":
            continue
        walks = [w for w in spec.walks if any(True for _ in node_calls(w.body, node.name))]
        _check_node(node, walks, deployment.chunking_for(node.name), diags)
        mode = prefix_cache_mode(node, deployment.prefix_cache_for(node.name))
        if mode == "pages":
            served[node.name] = bool(prompt_walks(node, walks))
        if mode == "recurrent_state":
            diags.warning(codes.PREFIX_CACHE_RECURRENT,
                          f"node {node.name} keeps recurrent state, which no KV page holds: its prefix cache "
                          "stays off (the plan says prefix_cache: recurrent_state)",
                          deployment.span_of("prefix_cache"),
                          Note("the recurrent state is declared here", node.states[0].span))
        elif mode == "pages":
            _check_prefix_walks(node, walks, deployment, diags)
        elif mode == "cross_attention":
            diags.warning(codes.PREFIX_CACHE_CROSS,
                          f"node {node.name} cross-attends, so its KV depends on more than its tokens: its prefix "
                          "cache stays off (the plan says prefix_cache: cross_attention)",
                          deployment.span_of("prefix_cache"),
                          Note("the cross-attention KV is declared here", node.cross_kv[0].span))
        if node.cross_kv and deployment.host_pages_for(node.name):
            diags.warning(codes.OFFLOAD_CROSS,
                          f"node {node.name} cross-attends: its runner keeps each request's KV outside the paged "
                          "pool (one request at a time), so none of it moves to the host pool (the plan says "
                          "host_pages: 0 for it)",
                          deployment.host_pages_span(node.name),
                          Note("the cross-attention KV is declared here", node.cross_kv[0].span))
    _check_cache_served(served, deployment, diags)


def _check_cache_served(served: dict[str, bool], deployment: Deployment, diags: Diagnostics) -> None:
    """MW431 for a prefix cache no walk can use: a node's own `kv_pool.nodes.NODE.prefix_cache`, or
    the deployment-wide switch when it serves no node at all (a node it cannot serve beside one it
    does is the common case of a multi-node model, not a mistake)."""
    why = ("a row starts after a cached prefix only on a walk that takes the node's text prompt and can be cut "
           "into chunks (not inside a loop, a bidirectional walk or one with batching rules)")
    own = {name for name, per_node in deployment.kv_pool.nodes.items() if per_node.prefix_cache}
    for name in sorted(own & {name for name, is_served in served.items() if not is_served}):
        diags.warning(codes.PREFIX_CACHE_UNUSED, f"no walk of node {name} can use its prefix cache: {why}",
                      deployment.kv_pool.nodes[name].span_of("prefix_cache"))
    global_nodes = sorted(set(served) - own)
    if global_nodes and not any(served.values()):
        diags.warning(codes.PREFIX_CACHE_UNUSED,
                      f"no walk of node{'s' if len(global_nodes) > 1 else ''} {', '.join(global_nodes)} can use the "
                      f"prefix cache: {why}", deployment.span_of("prefix_cache"))


def _check_prefix_walks(node: ast.NodeDecl, walks: list[ast.Walk], deployment: Deployment,
                        diags: Diagnostics) -> None:
    """MW429 for each walk that takes the text prompt but sends a value per prompt position."""
    for walk in prompt_walks(node, walks):
        edges = per_position_edges(node, walk)
        if edges:
            role = {o.name: o.role for o in node.outputs}[edges[0].name]
            diags.warning(codes.PREFIX_WALK_PER_POSITION,
                          f"walk {walk.name} sends {edges[0].name} ({role}) of node {node.name} to {edges[0].dest}, a "
                          "value per prompt position: a cached prefix's positions would send nothing, so its rows "
                          "never start after one (its prompts are computed whole)",
                          edges[0].span, Note("the prefix cache is asked for here", deployment.span_of("prefix_cache")))


def _check_node(node: ast.NodeDecl, walks: list[ast.Walk], chunking: NodeChunking, diags: Diagnostics) -> None:
    budget, chunk = chunking.token_budget, chunking.chunk_size
    if budget is not None and chunk is not None and chunk > budget:
        diags.error(codes.CHUNK_ABOVE_BUDGET,
                    f"node {node.name}: prefill chunk size {chunk} is above the step token budget {budget}; "
                    "a chunk must fit in one step",
                    chunking.chunk_span, Note(f"the budget of {node.name}'s steps is set here", chunking.budget_span))
    chunked = {w.name for w in walks if chunk is not None and is_chunkable(node, w)}
    if budget is not None:
        for walk in walks:
            if not holds_only_fixed_rows(node, _key_walks(node, walk, walks)):  # else its key has no budget
                _check_fixed_rows(node, walk, budget, bool(chunked), chunking, diags)
    need = budget if budget is not None else chunk
    if chunked and need is not None:
        for capture, owner in _captures_holding(node, chunked):
            if max(capture.tokens, default=0) < need:
                what = "the step token budget" if budget is not None else "one prefill chunk"
                diags.error(codes.BUCKETS_BELOW_BUDGET,
                            f"node {node.name}: the packed capture of {owner} has no token bucket that holds "
                            f"{what} ({need} tokens; its largest is {max(capture.tokens, default=0)}); such steps "
                            f"would run eagerly: add a bucket of at least {need} tokens or lower the "
                            f"{'budget' if budget is not None else 'chunk size'}",
                            capture.span, Note("the budget is set here", chunking.budget_span) if budget is not None
                            else Note("the chunk size is set here", chunking.chunk_span))


def _key_walks(node: ast.NodeDecl, walk: ast.Walk, walks: list[ast.Walk]) -> list[ast.Walk]:
    """The walks a step of `walk` may share a key with: its combined walks' (whichever of them a
    worker runs beside it), or itself alone."""
    names = {walk.name}.union(*(set(c.walks) for c in node.combines if walk.name in c.walks))
    return [w for w in walks if w.name in names]


def _check_fixed_rows(node: ast.NodeDecl, walk: ast.Walk, budget: int, is_chunked: bool, chunking: NodeChunking,
                      diags: Diagnostics) -> None:
    """MW421 for a walk whose node call sits in a loop (rows of a fixed size, never cut): a full
    step of them (the walk's cap, or a combined walk's own cap less the one row of another walk
    that makes a step mixed, when larger) fits the budget and,
    when the node's prompts are cut, leaves at least one token for a chunk (else a prompt could
    wait behind full decode steps for ever)."""
    if not any(is_in_loop for _, is_in_loop in node_calls(walk.body, node.name)):
        return
    cap = walk_cap(node, walk.name, 0)
    if cap == 0:
        return  # no cap or capture bounds the walk: the fallback cap is not the author's to fix here
    # a mixed step holds at least one row of another walk: at most its cap - 1 of this one (the
    # combine's cap itself refused a budget that held a full mixed step exactly)
    cap = max([cap] + [c.cap - 1 for c in node.combines if walk.name in c.walks and c.cap is not None])
    batched = [c for c in walk_captures(node, walk.name) if c.family == "batched"]
    per_row = max((c.tokens_per_row for c in batched), default=1)
    if cap * per_row > budget or (is_chunked and cap * per_row == budget):
        span = next((c.span for c in node.caps if c.walk == walk.name), None) or walk_captures(node, walk.name)[0].span
        diags.error(codes.BUDGET_BELOW_FIXED_ROWS,
                    f"node {node.name}: a full step of walk {walk.name} ({cap} rows x {per_row} token(s)) "
                    + (f"is above the step token budget {budget}" if cap * per_row > budget else
                       f"takes all of the step token budget {budget}, leaving no token for a prompt chunk")
                    + "; raise max_step_tokens or lower the cap",
                    chunking.budget_span, Note(f"the cap of {walk.name}", span))


def _captures_holding(node: ast.NodeDecl, chunked: set[str]) -> list[tuple[ast.CaptureDecl, str]]:
    """Packed captures a step holding a chunk replays, one per owner: a chunked walk's (of several,
    its one with the largest token bucket: a step takes any family that holds it), and its combine's."""
    found: list[tuple[ast.CaptureDecl, str]] = []
    for walk in sorted(chunked):
        packed = [c for c in walk_captures(node, walk) if c.family == "packed"]
        if packed:
            found.append((max(packed, key=lambda c: max(c.tokens, default=0)), f"walk {walk}"))
    for combine in node.combines:
        if combine.capture is not None and combine.capture.family == "packed" and not chunked.isdisjoint(combine.walks):
            found.append((combine.capture, f"combined walk {combine.name}"))
    return found

