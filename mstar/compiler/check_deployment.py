"""Pass 4, check the deployment: every (node, walk) placed once, sharding rules of the reference.

In:  a `Spec` that passed resolve, a loaded `Deployment`, the run's `Diagnostics`.
Out: nothing; adds MW310-MW327 diagnostics, located in the deployment YAML (with notes into the
     spec where that helps).

Rules (reference section 1.12, "deployment rules enforced in code", plus mstar's own keys):
- the deployment's `model` is the spec's model;
- node_names, graph_walks, kv_pool.nodes, kv_cache.nodes and speculation_mixes_walks name
  nodes and walks of the spec;
- every (node, walk) the spec's walks run is placed by exactly one node group; a group's
  explicit graph_walks only lists walks its nodes run;
- len(ranks) is a multiple of tp_size x sp_size; no rank twice in a group;
- the ranks of all groups are 0 to N-1, none skipped: the runtime starts a process per rank up
  to the highest (`ranks: [15]` started 15 idle ones);
- tp_size or sp_size > 1 only for nodes marked `tp`; at most one lockstep (tp x sp > 1) node
  per worker; a kv node's tp_size splits its query heads, kv heads (or is split by them), MLP
  width and gated delta-net heads, as the runtime's shard layout needs (`plan.dims.tp_split_problem`),
  and so does each of its sub-models' widths (they are sharded as the node is); a depth model does
  not run tensor-parallel (MW326: each passed mstarc and the engines refused it at start-up);
- sp_size is 1: the engines run no sequence parallelism (MW327; the sim ran such a plan, every
  engine refused it);
- a node with a stream input runs all its walks on the same ranks (its stream buffers live
  there), and a lockstep such node is not restricted to some walks;
- a kv node's walks share one world size (the KV cache moves between them: PD split needs equal
  TP on both sides);
- each kv node's pool holds at least one request of the pool's max_seq_len; its device pool, its
  KV offload host pool and its recurrent state slots each fit what the runtime can allocate
  (MAX_NODE_BYTES), and there are as many slots as max_concurrent_requests (the runtime refuses
  fewer at start-up).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Optional

from mstar.compiler import codes
from mstar.compiler.chunking import offload_host_pages
from mstar.compiler.memory_bounds import MAX_NODE_BYTES, format_bytes, kv_pool_bytes, recurrent_slot_bytes
from mstar.compiler.node_decl import arg_values, recurrent_state
from mstar.compiler.deployment import Deployment, NodeGroup
from mstar.compiler.resolve import iter_calls, suggestion, walk_nodes
from mstar.lang import ast
from mstar.lang.ast import Span
from mstar.lang.diagnostics import Diagnostics, Note
from mstar.plan.dims import DecoderDims, DimsError, decoder_dims, tp_split_problem
from mstar.plan.schema import RecurrentState


def spec_pairs(spec: ast.Spec) -> list[tuple[str, str]]:
    """Every (node, walk) the spec runs, in walk then first-use order."""
    return [(node, walk.name) for walk in spec.walks for node in walk_nodes(walk)]


def run(spec: ast.Spec, deployment: Deployment, diags: Diagnostics) -> None:
    if deployment.model != spec.model:
        diags.error(codes.MODEL_MISMATCH,
                    f"deployment is for model '{deployment.model}' but the spec is model '{spec.model}'",
                    deployment.span_of("model"), Note("the spec's model", spec.span))
    nodes = {n.name: n for n in spec.nodes}
    walks = {w.name for w in spec.walks}
    pairs = spec_pairs(spec)
    runs = set(pairs)
    _check_names(deployment, nodes, walks, runs, diags)
    _check_groups(deployment, nodes, diags)
    _check_placement(spec, deployment, pairs, diags)
    _check_workers(deployment, diags)
    _check_kv_nodes(spec, deployment, pairs, diags)


def _engine_words(node: ast.NodeDecl) -> str:
    """The engine as the node's header writes it: `kv`, or `stateless` and the model kind."""
    return node.engine if node.model_kind is None else f"{node.engine} {node.model_kind}"


def _combine_hint(name: str, nodes: dict[str, ast.NodeDecl]) -> str:
    """Why a combined walk's name is no walk here: the deployment places walks, and a group that
    runs a combined walk's walks runs its mixed steps (a user lists `mixed` as one more walk)."""
    for node in nodes.values():
        for combine in node.combines:
            if combine.name == name:
                return (f": it is node {node.name}'s combined walk of {' + '.join(combine.walks)}; list those "
                        f"walks instead: a group that runs more than one of them runs their mixed steps")
    return ""


def _check_names(deployment: Deployment, nodes: dict[str, ast.NodeDecl], walks: set[str],
                 runs: set[tuple[str, str]], diags: Diagnostics) -> None:
    def node_known(name: str, span) -> bool:
        if name in nodes:
            return True
        diags.error(codes.DEPLOYMENT_UNKNOWN_NODE,
                    f"unknown node '{name}'{suggestion(name, nodes)}", span)
        return False

    def walk_known(name: str, span) -> bool:
        if name in walks:
            return True
        diags.error(codes.DEPLOYMENT_UNKNOWN_WALK,
                    f"unknown walk '{name}'{suggestion(name, walks) or _combine_hint(name, nodes)}", span)
        return False

    for group in deployment.node_groups:
        known = [n for i, n in enumerate(group.node_names)
                 if node_known(n, group.item_span("node_names", i))]
        for i, walk in enumerate(group.graph_walks or []):
            span = group.item_span("graph_walks", i)
            if walk_known(walk, span) and known and not any((n, walk) in runs for n in known):
                diags.error(codes.PLACED_WITHOUT_WORK,
                            f"graph_walks lists {walk}, but {' and '.join(known)} "
                            f"{'does' if len(known) == 1 else 'do'} not run in walk {walk}", span)
    for name in deployment.kv_pool.nodes:
        node_known(name, deployment.kv_pool.span_of(f"nodes.{name}"))
    for i, name in enumerate(deployment.kv_cache.nodes or []):
        node_known(name, deployment.kv_cache.item_span("nodes", i))
    for i, entry in enumerate(deployment.speculation_mixes_walks):
        span = deployment.item_span("speculation_mixes_walks", i)
        node, _, walk = entry.partition(".")
        if node_known(node, span) and walk and walk_known(walk, span) and (node, walk) not in runs:
            diags.error(codes.PLACED_WITHOUT_WORK, f"{node} does not run in walk {walk}", span)


def _check_groups(deployment: Deployment, nodes: dict[str, ast.NodeDecl], diags: Diagnostics) -> None:
    for group in deployment.node_groups:
        seen: set[int] = set()
        for i, rank in enumerate(group.ranks):
            if rank in seen:
                diags.error(codes.DUPLICATE_RANK, f"rank {rank} is listed twice in this node group",
                            group.item_span("ranks", i))
            seen.add(rank)
        if len(group.ranks) % group.world_size:
            diags.error(codes.RANKS_NOT_MULTIPLE,
                        f"{len(group.ranks)} ranks cannot form instances of tp_size x sp_size = "
                        f"{group.tp_size} x {group.sp_size} = {group.world_size}",
                        group.span_of("ranks"))
        if group.sp_size > 1:  # (the sim ran such a plan; every engine refused it at start-up)
            diags.error(codes.SEQUENCE_PARALLEL_UNSUPPORTED,
                        f"sp_size {group.sp_size}: mstar's engines run no sequence parallelism (the reference's "
                        "sp-enabled nodes); shard the node with tp_size, or list its ranks as replicas",
                        group.span_of("sp_size"))
        if group.world_size > 1:
            for i, name in enumerate(group.node_names):
                node = nodes.get(name)
                if node is not None and not node.is_tp:
                    key = "tp_size" if group.tp_size > 1 else "sp_size"
                    diags.error(codes.SHARDING_NOT_ALLOWED,
                                f"{key} {getattr(group, key)} for node {name}, which is not marked `tp`: give "
                                f"the group {key} 1 (its ranks are then replicas), or mark the node `tp` after "
                                f"its engine (`node {name} {_engine_words(node)}(...) tp {{`)",
                                group.item_span("node_names", i), Note("the node", node.span))
                elif node is not None and node.engine == "kv" and group.tp_size > 1:
                    _check_tp_split(node, group, deployment, diags)


@dataclass(frozen=True)
class _Declared:
    """A kv node's dims as the runtime reads them (`plan.dims.DimsSource`), from its declaration."""
    name: str
    dims: Mapping[str, Any]
    recurrent: Optional[RecurrentState]


def _spec_dims(node: ast.NodeDecl, deployment: Deployment, sub: Optional[ast.SubModelDecl] = None
               ) -> Optional[DecoderDims]:
    """The decoder dims the runtime builds a kv node at (`--dims spec`), or its sub-model `sub` at
    (the node's values with the sub-model's over them, as engine/submodels.py builds it), from the
    values lowering puts in its plan (node_decl.py); None where its arguments are bad (check_args
    says why)."""
    values = arg_values(node.args) if sub is None else {**arg_values(node.args), **arg_values(sub.args)}
    name = node.name if sub is None else f"{node.name}.{sub.name}"
    try:
        return decoder_dims(_Declared(name, values, recurrent_state(node, deployment)), "spec")
    except (DimsError, ValueError, TypeError):  # (pydantic's ValidationError is a ValueError)
        return None


def _check_tp_split(node: ast.NodeDecl, group: NodeGroup, deployment: Deployment, diags: Diagnostics) -> None:
    """MW326: the runtime shards a kv node's heads and widths over its TP group and refuses at
    start-up what does not divide (qo_heads=32 over tp_size 3 passed mstarc)."""
    dims = _spec_dims(node, deployment)
    problem = tp_split_problem(dims, group.tp_size) if dims is not None else ""
    if problem:
        diags.error(codes.TP_SPLIT_IMPOSSIBLE, f"tp_size {group.tp_size} cannot split node {node.name}: {problem}",
                    group.span_of("tp_size"), Note("the node", node.span))
        return
    for sub in node.submodels:  # sharded as the node is (engine/submodels.py); its widths must split too
        if sub.samples is not None:
            diags.error(codes.TP_SPLIT_IMPOSSIBLE, f"tp_size {group.tp_size}: node {node.name}'s depth model "
                        f"{sub.name} does not run tensor-parallel", group.span_of("tp_size"),
                        Note("the depth model", sub.span))
            continue
        sub_dims = _spec_dims(node, deployment, sub)
        sub_problem = tp_split_problem(sub_dims, group.tp_size) if sub_dims is not None else ""
        if sub_problem:
            diags.error(codes.TP_SPLIT_IMPOSSIBLE, f"tp_size {group.tp_size} cannot split node {node.name}'s "
                        f"sub-model {sub.name}: {sub_problem}", group.span_of("tp_size"),
                        Note("the sub-model", sub.span))


def _check_placement(spec: ast.Spec, deployment: Deployment, pairs: list[tuple[str, str]],
                     diags: Diagnostics) -> None:
    calls = {(c.node, w.name): c for w in spec.walks for c in iter_calls(w.body)}
    for node, walk in pairs:
        groups = deployment.groups_for(node, walk)
        if not groups:
            diags.error(codes.NOT_PLACED,
                        f"{node} in walk {walk} is placed on no rank: no node group lists {node} "
                        f"for walk {walk}", deployment.span_of("node_groups"),
                        Note(f"{node} runs in walk {walk} here", calls[(node, walk)].span))
        for extra in groups[1:]:
            diags.error(codes.PLACED_TWICE,
                        f"{node} in walk {walk} is placed by node groups {groups[0].index} and "
                        f"{extra.index}; list its ranks in one group (extra ranks are replicas)",
                        extra.span, Note("first placed here", groups[0].span))
    _check_stream_consumers(spec, deployment, diags)


def _check_stream_consumers(spec: ast.Spec, deployment: Deployment, diags: Diagnostics) -> None:
    for node in spec.nodes:
        if not any(d.is_stream for d in node.inputs):
            continue
        groups = {g.index: g for w in spec.walks if node.name in walk_nodes(w)
                  for g in deployment.groups_for(node.name, w.name)}
        by_ranks = {tuple(sorted(g.ranks)): g for _, g in sorted(groups.items())}
        if len(by_ranks) > 1:
            first, second = list(by_ranks.values())[:2]
            diags.error(codes.STREAM_CONSUMER_SPLIT,
                        f"{node.name} consumes a stream, so all its walks run on the same ranks; "
                        f"node groups {first.index} (ranks {sorted(first.ranks)}) and {second.index} "
                        f"(ranks {sorted(second.ranks)}) split it",
                        second.span, Note("also placed here", first.span))
        for group in groups.values():
            if group.world_size > 1 and group.graph_walks is not None:
                diags.error(codes.STREAM_CONSUMER_SPLIT,
                            f"{node.name} consumes a stream, so its lockstep group may not be "
                            f"restricted to some walks", group.span_of("graph_walks"))


def _check_workers(deployment: Deployment, diags: Diagnostics) -> None:
    _check_rank_numbers(deployment, diags)
    lockstep: dict[int, dict[str, NodeGroup]] = {}
    for group in deployment.node_groups:
        if group.world_size > 1:
            for rank in group.ranks:
                for name in group.node_names:
                    lockstep.setdefault(rank, {}).setdefault(name, group)
    for rank, by_node in sorted(lockstep.items()):
        if len(by_node) > 1:
            names = sorted(by_node)
            later = max(by_node.values(), key=lambda g: g.index)
            diags.error(codes.TWO_LOCKSTEP_NODES,
                        f"rank {rank} would host lockstep nodes {' and '.join(names)}; a worker runs "
                        f"at most one node with tp_size x sp_size > 1", later.span_of("ranks"))


def _check_rank_numbers(deployment: Deployment, diags: Diagnostics) -> None:
    """MW324: the ranks used are 0 to N-1. The runtime's world is the highest rank plus one, a
    process each, so a skipped rank is a process that idles (and waits at the rendezvous)."""
    used = deployment.ranks()
    if used == list(range(len(used))):
        return
    missing = sorted(set(range(used[-1] + 1)) - set(used))
    # some rank is past the count (the highest is): blame the first such in the file
    group, index = next((g, i) for g in deployment.node_groups for i, r in enumerate(g.ranks) if r >= len(used))
    diags.error(codes.RANKS_NOT_CONTIGUOUS,
                f"rank {group.ranks[index]} leaves {_rank_list(missing)} unused: the deployment's "
                f"{_rank_count(len(used))} (the runtime starts a process for every rank up to the highest)",
                group.item_span("ranks", index))


def _rank_count(count: int) -> str:
    """`1 rank must be rank 0`, `2 ranks must be ranks 0 and 1`, `3 ranks must be ranks 0 to 2`."""
    if count <= 2:
        return "1 rank must be rank 0" if count == 1 else "2 ranks must be ranks 0 and 1"
    return f"{count} ranks must be ranks 0 to {count - 1}"


def _rank_list(ranks: list[int]) -> str:
    """`rank 1`, `ranks 0 to 14`, `ranks 1 and 3`, `ranks 1, 3 and 5`."""
    if len(ranks) == 1:
        return f"rank {ranks[0]}"
    if ranks == list(range(ranks[0], ranks[-1] + 1)):
        return f"ranks {ranks[0]} to {ranks[-1]}"
    shown = ", ".join(map(str, ranks[:-1][:8])) + (", ..." if len(ranks) > 9 else "")
    return f"ranks {shown} and {ranks[-1]}"


def _check_kv_nodes(spec: ast.Spec, deployment: Deployment, pairs: list[tuple[str, str]],
                    diags: Diagnostics) -> None:
    for node in spec.nodes:
        if node.engine != "kv":
            continue
        sizes = {g.world_size: g for n, w in pairs if n == node.name
                 for g in deployment.groups_for(n, w)}
        if len(sizes) > 1:
            low, high = min(sizes), max(sizes)
            diags.error(codes.KV_HANDOFF_TP_MISMATCH,
                        f"{node.name}'s walks run at world sizes {low} and {high}; its KV cache "
                        f"cannot move between different TP world sizes: give its node groups one tp_size",
                        sizes[high].span,
                        Note(f"world size {low} here", sizes[low].span))
        if not any(n == node.name for n, _ in pairs):
            continue
        _check_kv_pool(node, deployment, diags)
        _check_host_pool(node, deployment, diags)
        for state in node.states:
            if state.kind == "recurrent":
                _check_recurrent_slots(node, state, deployment, diags)


def _pool_span(node: ast.NodeDecl, deployment: Deployment) -> Span:
    """Where a node's KV pool is set: its kv_pool.nodes entry, else kv_pool, else the reference's
    kv_cache.max_num_pages (it pointed at max_seq_len when the pages came from there), else
    max_seq_len."""
    if node.name in deployment.kv_pool.nodes:
        return deployment.kv_pool.span_of(f"nodes.{node.name}")
    if "kv_pool" in deployment.model_fields_set:  # (at its num_pages, the value to change, where given)
        pool = deployment.kv_pool
        return pool.span_of("num_pages") if "num_pages" in pool.model_fields_set else deployment.span_of("kv_pool")
    if deployment.kv_cache.max_num_pages is not None:
        return deployment.kv_cache.span_of("max_num_pages")
    return deployment.span_of("max_seq_len")


def _check_kv_pool(node: ast.NodeDecl, deployment: Deployment, diags: Diagnostics) -> None:
    """MW323 past what the runtime can allocate; MW322 too small for one request of the pool's
    max_seq_len (kv_cache.max_seq_len, else max_seq_len: the runtime sizes per-request tables by it)."""
    pool = deployment.kv_pool_for(node.name)
    span = _pool_span(node, deployment)
    pool_bytes = kv_pool_bytes(ast.values_by_name(node.args), pool.page_size, pool.num_pages)
    max_seq_len = deployment.pool_max_seq_len()
    if pool_bytes > MAX_NODE_BYTES:
        diags.error(codes.KV_POOL_TOO_LARGE,
                    f"KV pool of {node.name}: {pool.num_pages} pages x {pool.page_size} tokens "
                    f"with the node's layers, kv_heads and head_dim take at least "
                    f"{format_bytes(pool_bytes)}, more than the runtime can allocate "
                    f"({format_bytes(MAX_NODE_BYTES)})", span)
    elif pool.num_pages * pool.page_size < max_seq_len:
        which = "kv_cache.max_seq_len" if deployment.kv_cache.max_seq_len else "max_seq_len"
        diags.error(codes.KV_POOL_TOO_SMALL,
                    f"KV pool of {node.name} holds {pool.num_pages} pages x {pool.page_size} = "
                    f"{pool.num_pages * pool.page_size} tokens, less than one {which} "
                    f"{max_seq_len} request: give it at least {-(-max_seq_len // pool.page_size)} pages "
                    f"or a {which} of at most {pool.num_pages * pool.page_size}", span)


def _check_host_pool(node: ast.NodeDecl, deployment: Deployment, diags: Diagnostics) -> None:
    """MW323 for the KV offload host pool: host pages are the device pool's pages (same page
    size, every layer's keys and values), allocated in host memory at start-up."""
    host_pages = offload_host_pages(node, deployment.host_pages_for(node.name))
    page_size = deployment.kv_pool_for(node.name).page_size
    host_bytes = kv_pool_bytes(ast.values_by_name(node.args), page_size, host_pages)
    if host_bytes > MAX_NODE_BYTES:
        diags.error(codes.KV_POOL_TOO_LARGE,
                    f"KV offload host pool of {node.name}: cpu_offload_pages {host_pages} pages x {page_size} "
                    f"tokens with the node's layers, kv_heads and head_dim take at least "
                    f"{format_bytes(host_bytes)} of host memory, more than the runtime can allocate "
                    f"({format_bytes(MAX_NODE_BYTES)})", deployment.host_pages_span(node.name))


def _check_recurrent_slots(node: ast.NodeDecl, state: ast.StateDecl, deployment: Deployment,
                           diags: Diagnostics) -> None:
    """MW323: the slots' state past what the runtime can allocate; MW325: fewer slots than
    requests admitted at once (the runtime refuses to start: each holds a slot until it ends)."""
    slots = deployment.recurrent_slots()
    span = deployment.span_of("recurrent_state_slots" if deployment.recurrent_state_slots
                              else "max_concurrent_requests")
    state_bytes = slots * recurrent_slot_bytes(ast.values_by_name(state.args))
    if state_bytes > MAX_NODE_BYTES:
        diags.error(codes.KV_POOL_TOO_LARGE,
                    f"recurrent state of {node.name}: {slots} slots of its state recurrent(...) take at least "
                    f"{format_bytes(state_bytes)}, more than the runtime can allocate "
                    f"({format_bytes(MAX_NODE_BYTES)}); lower recurrent_state_slots", span,
                    Note("the state declaration", state.span))
    limit = deployment.max_concurrent_requests
    if limit is not None and slots < limit:
        diags.error(codes.RECURRENT_SLOTS_TOO_FEW,
                    f"recurrent_state_slots {slots} cannot hold max_concurrent_requests={limit} requests "
                    f"on {node.name} (each holds a slot of its recurrent state until it ends); set "
                    f"recurrent_state_slots to at least {limit}, or leave it out (it defaults to "
                    "max_concurrent_requests)", span)
