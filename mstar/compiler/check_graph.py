"""Pass 3, check the graph: walks, loops and partitions are well formed.

In:  a `Spec` that passed resolve, and the run's `Diagnostics`.
Out: nothing; adds MW201-MW215, MW217 and MW218 diagnostics (MW216 is resolve's).

Where a call's input may come from (MW201 when none applies):
1. an edge of the same walk that reaches the call: from an earlier section of a sequence, or
   from a sibling of a `parallel`;
2. a stream: the input is declared `in NAME stream` and the walk's partition has a stream
   source `<- PARTITION.NAME policy`;
3. the conductor, which holds the request's data and the edges earlier walks persisted
   (`-> x: conductor persist`). It feeds (a) every input of a walk's *entry calls* - calls that
   no edge of the walk reaches; (b) at any call, an input whose name is a *request input* or a
   *persisted edge* of the walk's partition (request inputs: the inputs of the entry calls of
   the partition's walks); (c) at any call, an input that no edge of the whole spec delivers
   to that node: nothing in the model computes it, so it is request data (Qwen3-Omni's
   `video_second_per_grid`, which the conductor hands to the Thinker after the vision encoder).
   So MW201 means: the input is something the model computes (some edge delivers it to that
   node), this call is reached by other edges of the walk, yet no edge of this walk, stream or
   persisted edge carries it here - typically a missing edge from an encoder.
A loop-back edge feeds its call from the second iteration on; the first iteration's value comes
from rule 1 or 3 (`decode`'s LLM is an entry call: the conductor hands it the persisted token).

Loop-backs (as the reference derives them): an edge from a call to itself, or to a call of an
earlier (or the same) section of a sequence, when a loop encloses both. Any other backward edge,
or a cycle among parallel siblings, is MW202.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Sequence

from graphlib import CycleError, TopologicalSorter

from mstar.compiler import codes
from mstar.compiler.memory_bounds import MAX_LOOP_ITERATIONS, MAX_STEP_TOKENS
from mstar.compiler.resolve import SPECIAL_DESTS, iter_calls, iter_sections, name_span, suggestion
from mstar.plan.stream_checks import route_lengths
from mstar.lang import ast
from mstar.lang.diagnostics import Diagnostics, Note


@dataclass
class Site:
    """One call of a walk and where it sits: a path of (container id, index) from the walk body."""

    call: ast.Call
    path: tuple[tuple[int, int], ...]


@dataclass
class WalkFlow:
    """The data flow of one walk: every edge between its calls, classified."""

    walk: ast.Walk
    sites: list[Site] = field(default_factory=list)
    containers: dict[int, ast.AstNode] = field(default_factory=dict)  # id -> Walk/section
    # (source site index, edge, target site index) per relation
    forward: list[tuple[int, ast.Edge, int]] = field(default_factory=list)
    loop_back: list[tuple[int, ast.Edge, int]] = field(default_factory=list)
    backward: list[tuple[int, ast.Edge, int]] = field(default_factory=list)
    reached: set[int] = field(default_factory=set)  # sites some forward edge reaches

    def is_entry(self, index: int) -> bool:
        """An entry call: no edge of the walk reaches it, so the conductor feeds its inputs."""
        return index not in self.reached


def walk_flow(walk: ast.Walk) -> WalkFlow:
    """Sites of a walk and its intra-walk edges split into forward, loop-back and backward."""
    flow = WalkFlow(walk)
    flow.containers[id(walk)] = walk
    _collect(walk.body, id(walk), (), flow)
    by_node: dict[str, list[int]] = {}
    for i, site in enumerate(flow.sites):
        by_node.setdefault(site.call.node, []).append(i)
    for i, site in enumerate(flow.sites):
        for edge in site.call.edges:
            if edge.dest in SPECIAL_DESTS or edge.is_stream:
                continue
            for j in by_node.get(edge.dest, []):
                if edge.name not in flow.sites[j].call.inputs:
                    continue
                relation = _relation(flow, i, j)
                getattr(flow, relation).append((i, edge, j))
    flow.reached = {target for _, _, target in flow.forward}
    return flow


def _collect(body: Sequence[ast.Section], container: int, path: tuple, flow: WalkFlow) -> None:
    for index, section in enumerate(body):
        here = path + ((container, index),)
        if isinstance(section, ast.Call):
            flow.sites.append(Site(section, here))
        else:
            flow.containers[id(section)] = section
            _collect(section.body, id(section), here, flow)


def _relation(flow: WalkFlow, source: int, target: int) -> str:
    a, b = flow.sites[source].path, flow.sites[target].path
    depth = 0
    while depth < min(len(a), len(b)) and a[depth] == b[depth]:
        depth += 1
    shared = [flow.containers[c] for c, _ in a[:depth]]
    if source != target:
        container = flow.containers[a[depth][0]]
        shared.append(container)
        if isinstance(container, ast.Parallel):
            return "forward"
        if a[depth][1] < b[depth][1]:
            return "forward"
    return "loop_back" if any(isinstance(c, ast.Loop) for c in shared) else "backward"


def run(spec: ast.Spec, diags: Diagnostics) -> None:
    params = ast.values_by_name(spec.params)
    partition_of = _check_partitions(spec, diags)
    flows = {w.name: walk_flow(w) for w in spec.walks}
    conductor_names = _conductor_names(spec, flows, partition_of)
    delivered = {(e.dest, e.name) for w in spec.walks for c in iter_calls(w.body) for e in c.edges}
    # Values the conductor keeps for later walks (any partition's, which it also hands over).
    persisted = {e.name for w in spec.walks for c in iter_calls(w.body) for e in c.edges
                 if e.is_persist or e.dest == "conductor"}
    partitions = {p.name: p for p in spec.partitions}
    nodes = {n.name: n for n in spec.nodes}
    for walk in spec.walks:
        flow = flows[walk.name]
        partition = partitions.get(partition_of.get(walk.name, ""))
        _check_sections(walk, params, diags)
        _check_loop_nests(walk, params, diags)
        _check_edges(flow, nodes, diags)
        _check_inputs(flow, nodes, partition, conductor_names.get(partition_of.get(walk.name), set()),
                      delivered, persisted, diags)
    _check_streams(spec, partition_of, diags)
    _check_chunk_policies(spec, diags)
    _check_streams_end(spec, diags)


# ---------------------------------------------------------------- sections and loops


def _check_sections(walk: ast.Walk, params: dict[str, int], diags: Diagnostics) -> None:
    if not walk.body:
        diags.error(codes.EMPTY_SECTION, f"walk {walk.name} is empty", walk.span)
    for section in iter_sections(walk.body):
        if isinstance(section, ast.Call):
            continue
        if not section.body:
            diags.error(codes.EMPTY_SECTION, f"empty {section.kind} in walk {walk.name}", section.span)
        if not isinstance(section, ast.Loop):
            continue
        bound = params.get(section.max_iters) if isinstance(section.max_iters, str) else section.max_iters
        if bound is not None and bound < 1:
            diags.error(codes.BAD_LOOP_BOUND,
                        f"loop bound must be at least 1, got {bound}", section.span)
        _check_count(section, bound, params, diags)
        if section.has_stop and section.name is None:
            diags.error(codes.STOP_WITHOUT_NAME,
                        "an early `stop` needs a named loop (`loop NAME max=...`): the stop check "
                        "names the loop it ends", section.span)
        produced = {e.name for call in iter_calls(section.body) for e in call.edges}
        for name in list(section.outputs) + list(section.accumulate):
            if name not in produced:
                diags.error(codes.LOOP_OUTPUT_NOT_PRODUCED,
                            f"loop output '{name}' is produced by no edge inside the loop",
                            name_span(_tail_span(section), name, diags))
        for name in sorted(set(section.outputs) & set(section.accumulate)):
            diags.error(codes.ACCUMULATE_OVERLAPS_OUTPUT,
                        f"'{name}' is both a loop output and accumulated: the final value and the "
                        f"per-iteration list would share one name",
                        name_span(_tail_span(section), name, diags, skip=1))


def _check_count(loop: ast.Loop, bound: Optional[int], params: dict[str, int], diags: Diagnostics) -> None:
    """MW215: a loop's default count (its `count=` param's value) runs at least one iteration
    and at most `max` (a request's own count is checked against the same range when it arrives)."""
    if loop.count is None or loop.count not in params or bound is None:
        return
    default = params[loop.count]
    if not 1 <= default <= bound:
        diags.error(codes.BAD_LOOP_COUNT,
                    f"loop count {loop.count} = {default} is outside 1..{bound}: a request runs `count` "
                    f"iterations (this default unless it sets its own), at most the loop's max={loop.max_iters}",
                    name_span(loop.span, "count=" + loop.count, diags))


def _check_loop_nests(walk: ast.Walk, params: dict[str, int], diags: Diagnostics) -> None:
    """MW214: the maximum iterations of nested loops multiply into the steps one request may
    take; past MAX_LOOP_ITERATIONS a request could run for days (twenty nested `loop max=3`).
    Reported once per walk, at the innermost loop where the product first passes the limit."""
    stack: list[tuple[Sequence[ast.Section], int, list[ast.Loop]]] = [(walk.body, 1, [])]
    while stack:
        body, product, loops = stack.pop()
        for section in body:
            if isinstance(section, ast.Call):
                continue
            inner_product, inner_loops = product, loops
            if isinstance(section, ast.Loop):
                bound = params.get(section.max_iters) if isinstance(section.max_iters, str) else section.max_iters
                inner_product = product * max(1, bound or 1)
                inner_loops = loops + [section]
                if inner_product > MAX_LOOP_ITERATIONS:
                    bounds = " x ".join(str(_loop_bound(loop, params)) for loop in inner_loops)
                    diags.error(codes.LOOP_NEST_TOO_LONG,
                                f"walk {walk.name}: these nested loops may run {bounds} = "
                                f"{inner_product:,} iterations for one request, more than the limit "
                                f"of {MAX_LOOP_ITERATIONS:,}; lower a loop's max or nest fewer loops",
                                section.span,
                                *[Note("an enclosing loop", loop.span) for loop in inner_loops[:-1][:3]])
                    return
            stack.append((section.body, inner_product, inner_loops))


def _loop_bound(loop: ast.Loop, params: dict[str, int]) -> int:
    bound = params.get(loop.max_iters) if isinstance(loop.max_iters, str) else loop.max_iters
    return max(1, bound or 1)


def _tail_span(loop: ast.Loop) -> ast.Span:
    """The part of a loop's span after its body: where `outputs` and `accumulate` are written."""
    if not loop.body:
        return loop.span
    end = loop.body[-1].span
    return ast.Span(file=loop.span.file, line=end.end_line, col=end.end_col,
                    end_line=loop.span.end_line, end_col=loop.span.end_col)


# ---------------------------------------------------------------- edges and inputs


def _check_edges(flow: WalkFlow, nodes: dict[str, ast.NodeDecl], diags: Diagnostics) -> None:
    walk = flow.walk
    in_walk = {s.call.node for s in flow.sites}
    loop_back_edges = {id(e) for _, e, _ in flow.loop_back}
    for site in flow.sites:
        for edge in site.call.edges:
            if edge.is_device and (id(edge) not in loop_back_edges or edge.dest != site.call.node):
                diags.error(codes.DEVICE_EDGE_NOT_LOOP_BACK,
                            f"`device` edge '{edge.name}' must loop back to {site.call.node} inside a "
                            f"loop: only a loop-back to the same node can stay on the device",
                            edge.span)
            if edge.dest in SPECIAL_DESTS or edge.is_stream or edge.dest not in nodes:
                continue
            if edge.dest not in in_walk:
                diags.error(codes.EDGE_TO_ABSENT_NODE,
                            f"edge '{edge.name}' goes to {edge.dest}, which walk {walk.name} does not "
                            f"run (a cross-partition edge needs `stream`)",
                            name_span(edge.span, edge.dest, diags))
            elif not any(edge.name in s.call.inputs for s in flow.sites if s.call.node == edge.dest):
                diags.error(codes.EDGE_TO_ABSENT_NODE,
                            f"edge '{edge.name}' goes to {edge.dest}, but no call of {edge.dest} in "
                            f"walk {walk.name} takes '{edge.name}'",
                            name_span(edge.span, edge.name, diags))
    for source, edge, target in flow.backward:
        diags.error(codes.CYCLE_WITHOUT_LOOP,
                    f"edge '{edge.name}' from {flow.sites[source].call.node} goes back to "
                    f"{flow.sites[target].call.node}, which runs earlier, outside any loop",
                    edge.span, Note("the target call", flow.sites[target].call.span))
    found = _find_cycle((s, t, {"edge": e}) for s, e, t in flow.forward)
    if found is None:
        return
    graph, cycle = found
    names = " -> ".join(flow.sites[s].call.node for s, _ in cycle)
    first = graph.edges[cycle[0]]["edge"]
    diags.error(codes.CYCLE_WITHOUT_LOOP,
                f"calls of walk {walk.name} feed each other in a cycle outside any loop: "
                f"{names} -> {flow.sites[cycle[0][0]].call.node}", first.span)


def _conductor_names(spec: ast.Spec, flows: dict[str, WalkFlow],
                     partition_of: dict[str, str]) -> dict[Optional[str], set[str]]:
    """partition -> request inputs and persisted edge names its walks may take from the conductor."""
    names: dict[Optional[str], set[str]] = {}
    for walk in spec.walks:
        flow = flows[walk.name]
        bucket = names.setdefault(partition_of.get(walk.name), set())
        for i, site in enumerate(flow.sites):
            if flow.is_entry(i):
                bucket.update(site.call.inputs)
            bucket.update(e.name for e in site.call.edges if e.is_persist or e.dest == "conductor")
    return names


def _check_inputs(flow: WalkFlow, nodes: dict[str, ast.NodeDecl], partition: Optional[ast.Partition],
                  conductor_names: set[str], delivered: set[tuple[str, str]], persisted: set[str],
                  diags: Diagnostics) -> None:
    fed: dict[int, set[str]] = {}
    for _, edge, target in flow.forward:
        fed.setdefault(target, set()).add(edge.name)
    # Inputs a backward edge outside a loop brings to an earlier call: MW202 reports those. (A
    # loop-back feeds only the second iteration on; the first needs a value from rule 1 or 3.)
    fed_back: dict[int, set[str]] = {}
    for _, edge, target in flow.backward:
        fed_back.setdefault(target, set()).add(edge.name)
    streamed = {s.edge for s in partition.streams} if partition is not None else set()
    for i, site in enumerate(flow.sites):
        node = nodes.get(site.call.node)
        if node is None:
            continue
        decls = {d.name: d for d in node.inputs}
        for name in site.call.inputs:
            if name in fed.get(i, ()) or name in fed_back.get(i, ()):
                continue
            decl = decls.get(name)
            if decl is not None and decl.is_stream:
                if name not in streamed:
                    where = f"partition {partition.name}" if partition is not None else "its partition"
                    diags.error(codes.INPUT_NOT_PRODUCED,
                                f"stream input '{name}' of {node.name} is fed by no stream source of "
                                f"{where} (add `<- PARTITION.{name} policy`)",
                                name_span(site.call.span, name, diags))
                continue
            if flow.is_entry(i) or name in conductor_names or (node.name, name) not in delivered:
                if _is_unsupplied(decl, name, persisted):
                    _report_unsupplied(flow, site, nodes, name, persisted, diags)
                continue
            diags.error(codes.INPUT_NOT_PRODUCED,
                        f"input '{name}' of {node.name} in walk {flow.walk.name} is produced by "
                        f"nothing here: the model computes it (an edge elsewhere delivers it to "
                        f"{node.name}), but no earlier edge of this walk carries it, and it is "
                        f"neither a request input nor a persisted edge of the partition",
                        name_span(site.call.span, name, diags))


# Roles of values only a model computes: a request never brings them (it brings prompts, media,
# signals and masks; an image flow's latents and time index are seeded by the model).
_COMPUTED = frozenset({"hidden", "embeddings"})


def _is_unsupplied(decl: Optional[ast.InputDecl], name: str, persisted: set[str]) -> bool:
    """An input left to the conductor that it cannot have: a value only a model computes, which
    no walk persists."""
    return decl is not None and decl.role in _COMPUTED and name not in persisted


def _report_unsupplied(flow: WalkFlow, site: Site, nodes: dict[str, ast.NodeDecl], name: str,
                       persisted: set[str], diags: Diagnostics) -> None:
    """MW201 at the input itself, naming a call of this walk that makes the value but drops it
    (a deleted edge) and a persisted name it may have been misspelt as."""
    notes = [Note(f"{other.call.node} makes '{name}' here, but no edge of this call carries it",
                  other.call.span)
             for other in flow.sites
             if other is not site and other.call.node in nodes
             and any(o.name == name for o in nodes[other.call.node].outputs)
             and not any(e.name == name for e in other.call.edges)]
    decl_role = next((d.role for d in nodes[site.call.node].inputs if d.name == name), "computed")
    is_looped = any(flow.sites[target] is site and edge.name == name for _, edge, target in flow.loop_back)
    what = ("has no value for its loop's first iteration: a loop-back feeds only the later ones"
            if is_looped else "is produced by nothing: no edge of this walk carries it")
    diags.error(codes.INPUT_NOT_PRODUCED,
                f"input '{name}' of {site.call.node} in walk {flow.walk.name} {what}, no walk "
                f"persists it, and a request does not bring {decl_role} values"
                f"{suggestion(name, sorted(persisted))}",
                name_span(site.call.span, name, diags), *notes[:2])


# ---------------------------------------------------------------- partitions and streams


def _check_partitions(spec: ast.Spec, diags: Diagnostics) -> dict[str, str]:
    """Walk -> its partition (the first that lists it), reporting MW207-MW209."""
    partition_of: dict[str, str] = {}
    listed: dict[str, list[ast.Partition]] = {}
    for partition in spec.partitions:
        if not partition.stages:
            diags.error(codes.EMPTY_SECTION, f"partition {partition.name} runs no walk",
                        name_span(partition.span, partition.name, diags))
        seen: set[str] = set()
        for stage in partition.stages:
            # A walk may come back later in the walk order (Higgs-Audio: text, audio, text), but
            # two alternatives of a stage that start with the same walk make a route ambiguous.
            firsts: set[str] = set()
            for sequence in ast.alternatives(stage):
                if sequence[0] in firsts:
                    diags.error(codes.WALK_ORDER_REPEATS,
                                f"partition {partition.name}: two alternatives of this stage start with walk "
                                f"{sequence[0]}, so a route naming it could take either",
                                name_span(stage.span, sequence[0], diags, skip=1))
                firsts.add(sequence[0])
            for walk in stage.walks:
                if walk in seen:
                    continue
                seen.add(walk)
                listed.setdefault(walk, []).append(partition)
                partition_of.setdefault(walk, partition.name)
    for walk_decl in spec.walks:
        owners = listed.get(walk_decl.name, [])
        if not owners:
            diags.error(codes.WALK_PARTITION_COUNT,
                        f"walk {walk_decl.name} is in no partition: a request could never run it",
                        name_span(walk_decl.span, walk_decl.name, diags))
        elif len(owners) > 1:
            diags.error(codes.WALK_PARTITION_COUNT,
                        f"walk {walk_decl.name} is in partitions {', '.join(p.name for p in owners)}; a walk "
                        f"belongs to exactly one", name_span(walk_decl.span, walk_decl.name, diags),
                        *(Note(f"listed by partition {p.name}", p.span) for p in owners))
    names = {p.name for p in spec.partitions}
    found = _find_cycle((source.partition, partition.name, {"span": source.span})
                        for partition in spec.partitions for source in partition.streams
                        if source.partition in names)
    if found is None:
        return partition_of
    graph, cycle = found
    path = " -> ".join(a for a, _ in cycle) + f" -> {cycle[0][0]}"
    diags.error(codes.PARTITION_CYCLE,
                f"partitions stream to each other in a cycle ({path}): none could start first",
                graph.edges[cycle[-1]]["span"])
    return partition_of


def _check_streams(spec: ast.Spec, partition_of: dict[str, str], diags: Diagnostics) -> None:
    nodes = {n.name: n for n in spec.nodes}
    walks = {w.name: w for w in spec.walks}
    # (partition, node) -> inputs its walks' calls take
    takes: dict[tuple[str, str], set[str]] = {}
    for walk in spec.walks:
        for call in iter_calls(walk.body):
            takes.setdefault((partition_of.get(walk.name, ""), call.node), set()).update(call.inputs)
    sources = {(s.partition, s.edge): p for p in spec.partitions for s in p.streams}
    for walk in spec.walks:
        producer = partition_of.get(walk.name, "")
        for call in iter_calls(walk.body):
            for edge in call.edges:
                if not edge.is_stream:
                    continue
                dest = nodes.get(edge.dest)
                if dest is None:
                    diags.error(codes.STREAM_MISMATCH,
                                f"stream edge '{edge.name}' must go to a node of another partition, "
                                f"not {edge.dest}", edge.span)
                    continue
                consumer = sources.get((producer, edge.name))
                if consumer is None or edge.name not in takes.get((consumer.name, dest.name), set()):
                    diags.error(codes.STREAM_MISMATCH,
                                f"stream edge '{edge.name}' to {dest.name} has no consumer: no partition "
                                f"has `<- {producer}.{edge.name}` and runs {dest.name} on "
                                f"'{edge.name}'", edge.span)
                elif not any(d.name == edge.name and d.is_stream for d in dest.inputs):
                    diags.error(codes.STREAM_MISMATCH,
                                f"stream edge '{edge.name}' feeds {dest.name}, whose input "
                                f"'{edge.name}' is not declared `stream`", edge.span)
    for partition in spec.partitions:
        consumers = {c.node for stage in partition.stages for w in stage.walks if w in walks
                     for c in iter_calls(walks[w].body)}
        for source in partition.streams:
            if not any(d.name == source.edge and d.is_stream
                       for n in consumers if n in nodes for d in nodes[n].inputs):
                diags.error(codes.STREAM_MISMATCH,
                            f"partition {partition.name} takes stream '{source.edge}' but none of its "
                            f"walks runs a node with a `stream` input '{source.edge}'", source.span)


def _check_chunk_policies(spec: ast.Spec, diags: Diagnostics) -> None:
    """MW217: a stream source's policy cuts chunks of at least one item (`load_plan` refuses a
    plan whose stream has chunk size 0) and of at most MAX_STEP_TOKENS, and a window moves by at
    least one."""
    for partition in spec.partitions:
        for source in partition.streams:
            policy = source.policy
            stream = f"stream {source.partition}.{source.edge} into partition {partition.name}"
            size_name = "chunk" if policy.kind == "left_context" else "size"
            largest = max(policy.size, policy.stride or 0, policy.context or 0)
            if policy.size < 1:
                diags.error(codes.BAD_CHUNK_SIZE,
                            f"{stream}: a {policy.kind} {size_name} of {policy.size} cuts chunks of no items, so its "
                            f"consumer would never run; give a {size_name} of at least 1", policy.span)
            elif largest > MAX_STEP_TOKENS:
                diags.error(codes.BAD_CHUNK_SIZE,
                            f"{stream}: a chunk policy of {largest} items is past {MAX_STEP_TOKENS}, the most tokens "
                            "a step may hold (a chunk is one step's input of its consumer, which pads the last to "
                            "the window's size)", policy.span)
            elif policy.stride is not None and policy.stride < 1:
                diags.error(codes.BAD_CHUNK_SIZE,
                            f"{stream}: stride={policy.stride} would never move the window; give a stride of at "
                            f"least 1, or leave it out (it is then the window's size, {policy.size})", policy.span)


def _check_streams_end(spec: ast.Spec, diags: Diagnostics) -> None:
    """MW218: a `continue_after_done` stream never ends (drained, it answers each ask for a chunk
    with an empty one: Qwen3-Omni's Talker stages each run once on it), and a partition fed by
    streams whose route can be a single walk re-runs that walk per chunk until its streams end
    (SNAC, Code2Wav): such a stream into such a partition ran every request for ever, spinning."""
    for partition in spec.partitions:
        if not partition.streams or 1 not in route_lengths(partition.stages):
            continue
        for source in partition.streams:
            if source.policy.is_continue_after_done:
                diags.error(codes.STREAM_NEVER_ENDS,
                            f"stream {source.partition}.{source.edge} into partition {partition.name}: "
                            "continue_after_done keeps it open for ever, and a route of "
                            f"{partition.name} that is one walk re-runs it per chunk until its streams end, so "
                            "no request would end; drop continue_after_done (the walk then ends with the stream)",
                            source.policy.span)


def _find_cycle(edges) -> Optional[tuple]:
    """(graph, cycle) for edges `(source, target, attrs)` that form a cycle, else None.

    Most specs have no cycle: the standard library's topological sort says so cheaply, and
    networkx (about 100 ms to import, a fifth of a whole `mstarc compile`) is imported only to
    name the cycle in a diagnostic.
    """
    edges = list(edges)
    order: TopologicalSorter = TopologicalSorter()
    for source, target, _ in edges:
        order.add(target, source)
    try:
        order.prepare()
    except CycleError:
        import networkx as nx

        graph = nx.DiGraph()
        graph.add_edges_from(edges)
        return graph, nx.find_cycle(graph)
    return None
