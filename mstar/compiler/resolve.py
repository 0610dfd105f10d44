"""Pass 2, resolve: every name in a spec refers to a declaration.

In:  a parsed `Spec` and the run's `Diagnostics` (which holds the spec's source text).
Out: nothing; adds MW101-MW108 diagnostics (unknown node, input, walk, loop parameter,
     partition or stream edge, each with a "did you mean"; names declared twice; reserved names).

Namespaces are separate: a partition may share its node's name (`partition LLM` beside
`node LLM`). Edge destinations `conductor` and `client` are reserved words, not nodes.
The small helpers here (section iteration, name spans, suggestions) are shared by the other
check passes.
"""
from __future__ import annotations

import difflib
import re
from typing import Iterable, Iterator, Sequence

from mstar.compiler import codes
from mstar.lang import ast
from mstar.lang.diagnostics import Diagnostics, Note

SPECIAL_DESTS = ("conductor", "client")


# ---------------------------------------------------------------- shared helpers


def iter_sections(body: Sequence[ast.Section]) -> Iterator[ast.Section]:
    """Every section of `body`, depth first, parents before children."""
    for section in body:
        yield section
        if not isinstance(section, ast.Call):
            yield from iter_sections(section.body)


def iter_calls(body: Sequence[ast.Section]) -> Iterator[ast.Call]:
    return (s for s in iter_sections(body) if isinstance(s, ast.Call))


def walk_nodes(walk: ast.Walk) -> list[str]:
    """Nodes a walk runs, in first-use order."""
    return list(dict.fromkeys(call.node for call in iter_calls(walk.body)))


def suggestion(name: str, candidates: Iterable[str]) -> str:
    """`; did you mean 'x'?` for the closest candidate, or an empty string."""
    close = difflib.get_close_matches(name, sorted(set(candidates)), n=1, cutoff=0.6)
    return f"; did you mean '{close[0]}'?" if close else ""


def name_span(span: ast.Span, name: str, diags: Diagnostics, skip: int = 0) -> ast.Span:
    """The span of the word `name` inside `span` (its `skip`-th occurrence), else `span`.

    AST nodes carry the span of their whole rule; pointing at the offending word reads better.
    """
    text = diags.sources.get(span.file)
    if text is None or not name:
        return span
    lines = text.splitlines()
    pattern = re.compile(rf"(?<!\w){re.escape(name)}(?!\w)")
    seen = 0
    for line_no in range(span.line, min(span.end_line, len(lines)) + 1):
        line = lines[line_no - 1]
        start = span.col - 1 if line_no == span.line else 0
        stop = span.end_col - 1 if line_no == span.end_line else len(line)
        for match in pattern.finditer(line, start, max(start, stop)):
            if seen == skip:
                return ast.Span(file=span.file, line=line_no, col=match.start() + 1,
                                end_line=line_no, end_col=match.end() + 1)
            seen += 1
    return span


def _duplicates(items: Iterable, key, what: str, diags: Diagnostics) -> None:
    first: dict = {}
    for item in items:
        name = key(item)
        if name in first:
            diags.error(codes.DUPLICATE_NAME, f"{what} '{name}' is declared twice",
                        item.span, _note_first(first[name]))
        else:
            first[name] = item


def _note_first(item: ast.AstNode) -> Note:
    return Note("first declared here", item.span)


# ---------------------------------------------------------------- the pass


def run(spec: ast.Spec, diags: Diagnostics) -> None:
    nodes = {n.name: n for n in spec.nodes}
    walks = {w.name for w in spec.walks}
    params = {p.name for p in spec.params}

    _duplicates(spec.params, lambda p: p.name, "param", diags)
    _duplicates(spec.nodes, lambda n: n.name, "node", diags)
    _duplicates(spec.walks, lambda w: w.name, "walk", diags)
    _duplicates(spec.partitions, lambda p: p.name, "partition", diags)
    for node in spec.nodes:
        if node.name in SPECIAL_DESTS:
            diags.error(codes.RESERVED_NAME,
                        f"'{node.name}' is a reserved edge destination and cannot name a node",
                        name_span(node.span, node.name, diags))
        _resolve_node(node, walks, {w.name for w in spec.walks if node.name in walk_nodes(w)}, diags)
    for walk in spec.walks:
        _resolve_walk(walk, nodes, params, diags)
    _resolve_partitions(spec, walks, diags)
    for partition in spec.partitions:
        if partition.repeat is not None:
            _resolve_repeat(spec, partition, partition.repeat, diags)


def _resolve_repeat(spec: ast.Spec, partition: ast.Partition, repeat: ast.Repeat, diags: Diagnostics) -> None:
    """MW104 for an unknown bound; MW216 when the rule cannot run: a bound below 1, or a value no
    walk of the partition persists (the conductor reads it from the partition's persisted values)."""
    params = ast.values_by_name(spec.params)
    if isinstance(repeat.max_rounds, str) and repeat.max_rounds not in params:
        diags.error(codes.UNKNOWN_PARAM,
                    f"unknown param '{repeat.max_rounds}' as repeat bound{suggestion(repeat.max_rounds, params)}",
                    name_span(repeat.span, repeat.max_rounds, diags))
    bound = params.get(repeat.max_rounds) if isinstance(repeat.max_rounds, str) else repeat.max_rounds
    if bound is not None and bound < 1:
        diags.error(codes.BAD_REPEAT, f"partition {partition.name} repeats at most {bound} rounds; the bound "
                    f"counts every round, the first included, so it is at least 1", repeat.span)
    walk_by_name = {w.name: w for w in spec.walks}
    persisted = {edge.name for stage in partition.stages for w in stage.walks if w in walk_by_name
                 for call in iter_calls(walk_by_name[w].body) for edge in call.edges
                 if edge.dest == "conductor" and edge.is_persist}
    if repeat.value not in persisted:
        diags.error(codes.BAD_REPEAT,
                    f"partition {partition.name} repeats while '{repeat.value}' is above zero, but no walk of it "
                    f"persists '{repeat.value}' (`-> {repeat.value}: conductor persist`)"
                    f"{suggestion(repeat.value, persisted)}",
                    name_span(repeat.span, repeat.value, diags))


def _walk_hint(walk: str, node: ast.NodeDecl, own: set[str]) -> str:
    """A did-you-mean among the walks that run `node` (a walk that never calls it is no fix for a
    misspelt one: `cap encode` on an encoder suggested `decode`), else which walks run it."""
    hint = suggestion(walk, own)
    if hint or not own:
        return hint
    return f"; node {node.name} runs in {', '.join(sorted(own))}"


def _resolve_node(node: ast.NodeDecl, walks: set[str], own: set[str], diags: Diagnostics) -> None:
    """`own`: the walks that call the node."""
    what = f"in node {node.name}"
    _duplicates(node.inputs, lambda i: i.name, f"input of node {node.name}", diags)
    _duplicates(node.outputs, lambda o: o.name, f"output of node {node.name}", diags)
    _duplicates(node.guidance, lambda g: g.label, f"guidance label of node {node.name}", diags)
    _duplicates(node.cross_kv, lambda c: c.label, f"cross_kv pool of node {node.name}", diags)
    _resolve_cross(node, diags)
    _duplicates(node.kv_access, lambda a: a.walk, f"kv access {what} for walk", diags)
    _duplicates(node.caps, lambda c: c.walk, f"cap {what} for walk", diags)
    _duplicates(node.capture_replays, lambda r: f"{r.walk} replays {r.source}", f"capture {what}", diags)
    _duplicates(node.combines, lambda c: c.name, f"combined walk {what}", diags)
    if node.kv_sequences is not None and len(set(node.kv_sequences.labels)) < len(node.kv_sequences.labels):
        diags.error(codes.DUPLICATE_NAME, f"kv_sequences of node {node.name} lists a label twice",
                    node.kv_sequences.span)
    if node.bidirectional is not None and len(set(node.bidirectional.walks)) < len(node.bidirectional.walks):
        diags.error(codes.DUPLICATE_NAME, f"bidirectional of node {node.name} lists a walk twice",
                    node.bidirectional.span)
    refs: list[tuple[str, ast.Span]] = [(c.walk, c.span) for c in node.caps]
    refs += [(a.walk, a.span) for a in node.kv_access]
    if node.bidirectional is not None:
        refs += [(w, node.bidirectional.span) for w in node.bidirectional.walks]
    refs += [(c.walk, c.span) for c in node.captures if c.walk is not None]
    replay_refs = [(w, r.span, skip) for r in node.capture_replays
                   for w, skip in ((r.walk, 0), (r.source, 1 if r.source == r.walk else 0))]
    for combine in node.combines:
        refs += [(w, combine.span) for w in combine.walks]
        refs += [(r.walk, r.span) for r in combine.rows]
    for walk, span, skip in [(w, s, 0) for w, s in refs] + replay_refs:
        if walk not in walks:
            diags.error(codes.UNKNOWN_WALK, f"unknown walk '{walk}'{_walk_hint(walk, node, own)}",
                        name_span(span, walk, diags, skip=skip))
    for sub in node.submodels:
        for walk in sub.walks:
            if walk not in walks:  # `submodel NAME(...) for WALK`: skip NAME when the walk is spelled alike
                diags.error(codes.UNKNOWN_WALK, f"unknown walk '{walk}'{_walk_hint(walk, node, own)}",
                            name_span(sub.span, walk, diags, skip=1 if walk == sub.name else 0))


def _resolve_cross(node: ast.NodeDecl, diags: Diagnostics) -> None:
    """A cross_kv pool has a label apart from the node's KV sequences and is filled from an input."""
    sequences = set(node.kv_sequences.labels) if node.kv_sequences is not None else set()
    inputs = [d.name for d in node.inputs]
    for cross in node.cross_kv:
        if cross.label in sequences:
            diags.error(codes.DUPLICATE_NAME, f"cross_kv {cross.label} of node {node.name} has the name of one of "
                        "its KV sequences", name_span(cross.span, cross.label, diags),
                        Note("the KV sequences", node.kv_sequences.span if node.kv_sequences else node.span))
        if cross.source not in inputs:
            diags.error(codes.UNKNOWN_INPUT, f"cross_kv {cross.label} is filled from '{cross.source}', which is not "
                        f"an input of node {node.name}{suggestion(cross.source, inputs)}",
                        name_span(cross.span, cross.source, diags, skip=1 if cross.source == cross.label else 0))


def _resolve_walk(walk: ast.Walk, nodes: dict[str, ast.NodeDecl], params: set[str],
                  diags: Diagnostics) -> None:
    loops: dict[str, ast.Loop] = {}
    for section in iter_sections(walk.body):
        if isinstance(section, ast.Loop):
            if isinstance(section.max_iters, str) and section.max_iters not in params:
                diags.error(codes.UNKNOWN_PARAM,
                            f"unknown param '{section.max_iters}' as loop bound"
                            f"{suggestion(section.max_iters, params)}",
                            name_span(section.span, section.max_iters, diags))
            if section.count is not None and section.count not in params:
                diags.error(codes.UNKNOWN_PARAM,
                            f"unknown param '{section.count}' as loop count{suggestion(section.count, params)}",
                            name_span(section.span, "count=" + section.count, diags))
            if section.name is not None:
                if section.name in loops:
                    diags.error(codes.DUPLICATE_NAME,
                                f"loop '{section.name}' is declared twice in walk {walk.name}",
                                section.span, _note_first(loops[section.name]))
                else:
                    loops[section.name] = section
        elif isinstance(section, ast.Call):
            _resolve_call(section, nodes, diags)


def _resolve_call(call: ast.Call, nodes: dict[str, ast.NodeDecl], diags: Diagnostics) -> None:
    node = nodes.get(call.node)
    if node is None:
        diags.error(codes.UNKNOWN_NODE, f"unknown node '{call.node}'{suggestion(call.node, nodes)}",
                    name_span(call.span, call.node, diags))
    else:
        declared = {i.name for i in node.inputs}
        for name in call.inputs:
            if name not in declared:
                diags.error(codes.UNKNOWN_INPUT,
                            f"'{name}' is not an input of node {node.name}"
                            f"{suggestion(name, declared)}",
                            name_span(call.span, name, diags))
    for edge in call.edges:
        if edge.dest in SPECIAL_DESTS:
            continue
        dest = nodes.get(edge.dest)
        if dest is None:
            diags.error(codes.UNKNOWN_NODE,
                        f"unknown edge destination '{edge.dest}' (a node, conductor or client)"
                        f"{suggestion(edge.dest, list(nodes) + list(SPECIAL_DESTS))}",
                        name_span(edge.span, edge.dest, diags))
        elif edge.name not in {i.name for i in dest.inputs}:
            diags.error(codes.UNKNOWN_INPUT,
                        f"edge '{edge.name}' is not an input of node {dest.name}"
                        f"{_input_hint(edge.name, dest)}",
                        name_span(edge.span, edge.name, diags))


def _input_hint(name: str, dest: ast.NodeDecl) -> str:
    """A did-you-mean, else what the node takes: an edge's one name is both the output it carries
    and the input it feeds, which a user naming them apart (`-> new_token: codec` into `in codes`)
    does not guess from 'not an input'."""
    hint = suggestion(name, [i.name for i in dest.inputs])
    if hint:
        return hint
    takes = ", ".join(i.name for i in dest.inputs) or "no input"
    return (f" (it takes {takes}); an edge's name is both the output it carries and the input it feeds: "
            f"name the input '{name}' or use the input's name for the output")


def _resolve_partitions(spec: ast.Spec, walks: set[str], diags: Diagnostics) -> None:
    partitions = {p.name: p for p in spec.partitions}
    walk_by_name = {w.name: w for w in spec.walks}
    for partition in spec.partitions:
        for stage in partition.stages:
            for walk in stage.walks:
                if walk not in walks:
                    diags.error(codes.UNKNOWN_WALK, f"unknown walk '{walk}'{suggestion(walk, walks)}",
                                name_span(stage.span, walk, diags))
        for source in partition.streams:
            producer = partitions.get(source.partition)
            if producer is None:
                diags.error(codes.UNKNOWN_PARTITION,
                            f"unknown partition '{source.partition}'"
                            f"{suggestion(source.partition, partitions)}",
                            name_span(source.span, source.partition, diags))
                continue
            streamed = {
                edge.name
                for stage in producer.stages for w in stage.walks if w in walk_by_name
                for call in iter_calls(walk_by_name[w].body) for edge in call.edges if edge.is_stream
            }
            if source.edge not in streamed:
                diags.error(codes.UNKNOWN_STREAM_EDGE,
                            f"partition {producer.name} streams no edge '{source.edge}'"
                            f"{suggestion(source.edge, streamed)}",
                            name_span(source.span, source.edge, diags))
