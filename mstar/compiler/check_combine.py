"""Pass 5, check combined walks, caps and captures, and the capture memory of each worker.

In:  a `Spec` that passed resolve and check_graph, its `Deployment` (None: only the spec-level
     checks run), the run's `Diagnostics`.
Out: nothing; adds MW401-MW419 and MW420-MW425 diagnostics (MW412, batching rules: check_batching.py;
MW414-MW416, several captures of a walk and capture replays: check_captures.py; MW417-MW419 and
MW425, captures' guidance modes and KV sequences: check_capture_keys.py;
MW420-MW424, step token budgets and the prefix cache: check_chunking.py; MW432-MW433, caps, rows
limits and capture lists of no rows or tokens: check_zero_sizes.py).

Spec-level rules, per node:
- caps and rows limits of at least one row, capture lists of positive, distinct sizes (MW432,
  MW433, check_zero_sizes.py: checked first with MW411);
- sizes the runtime can hold (MW411, checked first): caps and batch sizes at most MAX_STEP_ROWS,
  tokens a step at most MAX_STEP_TOKENS, at most MAX_CAPTURE_KEYS graphs a capture family and
  MAX_COMBINED_WALKS walks a combined walk (memory_bounds.py);
- a combined walk lists at least two distinct walks, each a walk that runs the node (and every
  cap and capture of the node is for a walk that runs it);
- a walk is in at most one combined walk of the node;
- no capture-key split: the walks of a combined walk without a capture of its own fall in one
  capture family (all eager, or all batched with the same tokens per row, or all packed);
- caps covered by captures: a walk's cap, and a combined walk's cap when it has its own capture,
  is at most the largest captured batch size (a larger cap means steps that run eagerly);
- `rows W <= n`: W is a walk of the combined walk, and n is at most the largest batch size of
  the combined walk's packed capture;
- a `piecewise` capture is on a node whose network has attention layers to run between the
  captured pieces (not an audio codec: the reference's audio_codec flavor has no piecewise runner).
Per worker (deployment):
- the walks of a combined walk that this worker runs share one node group (TP group), or all run
  at world size 1; walks the worker does not run are not judged, so a prefill/decode split needs
  no change to the spec;
- MW436 (a warning): a combined walk without a `cap` of its own whose walks on a rank that builds
  its mixed steps have different caps: its mixed steps take the smallest, so a step with a row of
  the small-cap walk (a prompt) holds fewer rows of the other (decode) than that walk's own cap (the
  "cap that throttles decode": a sim run of 200 requests at 64 clients lost 11% of its throughput
  and its p90 inter-token time went 1.68 -> 2.55 ms);
- the capture memory estimate (capture_memory.py) of every capture family the worker holds is
  within capture_memory_budget_mb, or without one within what the runtime can allocate (2 TiB);
- step token budgets, chunk sizes, caps and token buckets agree (check_chunking.py, MW420-MW424).
"""
from __future__ import annotations

import math

from dataclasses import dataclass
from typing import Optional

from mstar.compiler import (
    capture_keys, capture_memory, check_batching, check_capture_keys, check_captures, check_chunking, check_submodels,
    check_zero_sizes, codes,
)
from mstar.compiler.memory_bounds import (
    MAX_CAPTURE_KEYS, MAX_COMBINED_WALKS, MAX_NODE_BYTES, MAX_STEP_ROWS, MAX_STEP_TOKENS, format_bytes,
)
from mstar.compiler.check_deployment import spec_pairs
from mstar.compiler.deployment import Deployment
from mstar.compiler.lower_keys import family_name, placed_combines, walk_captures, walk_families
from mstar.compiler.resolve import name_span, walk_nodes
from mstar.lang import ast
from mstar.lang.diagnostics import Diagnostics, Note

# Model kinds of stateless nodes whose networks have no attention layers, so a piecewise graph
# would have nothing to leave out (SNAC-style codecs are convolutions).
ATTENTION_FREE_KINDS = ("audio_codec",)


@dataclass(frozen=True)
class WorkerCapture:
    """One capture family a worker holds: `node:walk` or `node:combined walk`."""

    name: str
    node: ast.NodeDecl
    capture: ast.CaptureDecl
    tp_size: int
    num_bytes: int


def run(spec: ast.Spec, deployment: Optional[Deployment], diags: Diagnostics) -> None:
    runs = {w.name: set(walk_nodes(w)) for w in spec.walks}
    for node in spec.nodes:
        # the later checks and lowering take a capture's largest batch: only for usable sizes
        if all([check_zero_sizes.check_node(node, diags), _step_sizes_fit(node, diags)]):
            _check_node(node, runs, diags)
            check_captures.check_node(spec, node, runs, diags)
            check_capture_keys.check_node(node, runs, diags)
        check_batching.check_node(spec, node, runs, diags)
        check_submodels.check_node(spec, node, runs, diags)
    if deployment is None:
        return
    for node in spec.nodes:
        _check_tp_groups(node, deployment, diags)
        _check_mixed_caps(node, deployment, diags)
    _check_memory(spec, deployment, diags)
    check_chunking.run(spec, deployment, diags)


def _step_sizes_fit(node: ast.NodeDecl, diags: Diagnostics) -> bool:
    """MW411: caps, captures and combined walks within what the plan's tables and the runtime can
    hold (memory_bounds.py); checked first, since the later checks and lowering enumerate them."""
    problems: list[tuple[str, ast.AstNode]] = []
    captures = list(node.captures) + [c.capture for c in node.combines if c.capture is not None]
    for cap in node.caps:
        if cap.value > MAX_STEP_ROWS:
            problems.append((f"cap {cap.walk} {cap.value} is more rows than a step may hold ({MAX_STEP_ROWS})", cap))
    for combine in node.combines:
        if combine.cap is not None and combine.cap > MAX_STEP_ROWS:
            problems.append((f"combined walk {combine.name}: cap {combine.cap} is more rows than a step "
                             f"may hold ({MAX_STEP_ROWS})", combine))
        if len(combine.walks) > MAX_COMBINED_WALKS:
            problems.append((f"combined walk {combine.name} mixes {len(combine.walks)} walks; at most "
                             f"{MAX_COMBINED_WALKS} (the plan lists each of the 2**n mixtures)", combine))
    for capture in captures:
        num_keys = len(capture.batch) * max(1, len(capture.tokens))
        tokens = max([*capture.tokens, capture.tokens_per_row * max(capture.batch, default=1)])
        if max(capture.batch, default=0) > MAX_STEP_ROWS:
            problems.append((f"capture batch size {max(capture.batch)} is more rows than a step may hold "
                             f"({MAX_STEP_ROWS})", capture))
        elif tokens > MAX_STEP_TOKENS:
            problems.append((f"capture of {tokens} tokens a step is more than a step may hold "
                             f"({MAX_STEP_TOKENS})", capture))
        elif num_keys > MAX_CAPTURE_KEYS:
            problems.append((f"capture of {num_keys} graphs (batch sizes x token buckets); at most "
                             f"{MAX_CAPTURE_KEYS} per family", capture))
    for message, where in problems:
        diags.error(codes.STEP_SIZE_TOO_LARGE, f"node {node.name}: {message}", where.span)
    return not problems


def capture_family(node: ast.NodeDecl, walk: str) -> tuple:
    """The capture families of a walk on a node (its own and those it replays), each ("batched",
    tokens per row) or ("packed",), sorted; ("eager",) alone for none."""
    kinds = {("batched", c.tokens_per_row) if c.family == "batched" else ("packed",)
             for c in walk_captures(node, walk)}
    return tuple(sorted(kinds)) or (("eager",),)


def _family_text(families: tuple) -> str:
    return " + ".join(f"batched ({f[1]} token{'s' if f[1] != 1 else ''} a row)" if f[0] == "batched" else f[0]
                      for f in families)


def _check_node(node: ast.NodeDecl, runs: dict[str, set[str]], diags: Diagnostics) -> None:
    _check_named_walks(node, runs, diags)
    _check_piecewise(node, diags)
    for cap in node.caps:
        # with several families (own or replayed) the largest batch of any bounds the walk's steps
        captures = [c for c in walk_captures(node, cap.walk) if c.batch]
        capture = max(captures, key=lambda c: max(c.batch), default=None)
        if capture is not None and cap.value > max(capture.batch) and not any(c.is_eager_above for c in captures):
            _cap_error(f"cap {cap.walk} {cap.value}", cap.value, capture, cap.span, diags)
    owner: dict[str, ast.CombineDecl] = {}
    caps = {c.walk: c.value for c in node.caps}
    for combine in node.combines:
        _check_combine(node, combine, runs, owner, diags)
        _check_combine_caps(combine, caps, diags)


def _bidirectional(node: ast.NodeDecl) -> tuple[set[str], ast.Span]:
    """The node's bidirectional walks, and where they are declared (the node, when none are)."""
    if node.bidirectional is None:
        return set(), node.span
    return set(node.bidirectional.walks), node.bidirectional.span


def _check_named_walks(node: ast.NodeDecl, runs: dict[str, set[str]], diags: Diagnostics) -> None:
    """MW401: a cap, capture, capture replay or bidirectional declaration naming a walk that does
    not run the node."""
    decls: list[ast.CapDecl | ast.CaptureDecl] = [*node.caps, *node.captures]
    for decl in decls:
        if decl.walk in runs and node.name not in runs[decl.walk]:
            what = "cap" if isinstance(decl, ast.CapDecl) else "capture"
            diags.error(codes.NOT_A_WALK_OF_NODE,
                        f"{what} for walk {decl.walk}, which does not run {node.name}",
                        name_span(decl.span, decl.walk, diags))
    for replay in node.capture_replays:
        for walk, skip in ((replay.walk, 0), (replay.source, 1 if replay.source == replay.walk else 0)):
            if walk in runs and node.name not in runs[walk]:
                diags.error(codes.NOT_A_WALK_OF_NODE,
                            f"capture replay names walk {walk}, which does not run {node.name}",
                            name_span(replay.span, walk, diags, skip=skip))
    bidirectional, bidirectional_span = _bidirectional(node)
    for walk in sorted(bidirectional):
        if walk in runs and node.name not in runs[walk]:
            diags.error(codes.NOT_A_WALK_OF_NODE, f"bidirectional walk {walk}, which does not run {node.name}",
                        name_span(bidirectional_span, walk, diags))


def _check_combine(node: ast.NodeDecl, combine: ast.CombineDecl, runs: dict[str, set[str]],
                   owner: dict[str, ast.CombineDecl], diags: Diagnostics) -> None:
    """One combined walk: two or more distinct walks of the node, none in an earlier combine
    (`owner`: walk -> its combine so far), one attention mask, one capture family or its own."""
    distinct = list(dict.fromkeys(combine.walks))
    if len(distinct) < 2:
        diags.error(codes.COMBINE_TOO_FEW_WALKS,
                    f"combined walk {combine.name} needs at least two distinct walks, got "
                    f"{' + '.join(combine.walks)}", name_span(combine.span, combine.name, diags))
    for walk in distinct:
        if walk in runs and node.name not in runs[walk]:
            diags.error(codes.NOT_A_WALK_OF_NODE,
                        f"walk {walk} does not run {node.name}, so it cannot be part of "
                        f"{node.name}'s combined walk {combine.name}",
                        name_span(combine.span, walk, diags, skip=1 if walk == combine.name else 0))
        if walk in owner:
            diags.error(codes.WALK_IN_TWO_COMBINES,
                        f"walk {walk} is already in combined walk {owner[walk].name} of "
                        f"{node.name}; a walk joins at most one",
                        name_span(combine.span, walk, diags), Note("first here", owner[walk].span))
        else:
            owner[walk] = combine
    bidirectional, bidirectional_span = _bidirectional(node)
    masked = [w for w in distinct if w in bidirectional]
    if masked and len(masked) < len(distinct):
        causal = [w for w in distinct if w not in bidirectional]
        diags.error(codes.COMBINE_MIXES_MASKS,
                    f"combined walk {combine.name} mixes bidirectional {', '.join(masked)} with causal "
                    f"{', '.join(causal)}: one packed attention call has one mask",
                    name_span(combine.span, combine.name, diags),
                    Note("the bidirectional walks", bidirectional_span))
    families = {w: capture_family(node, w) for w in distinct if w in runs}
    if combine.capture is None and len(set(families.values())) > 1:
        listed = ", ".join(f"{w}: {_family_text(f)}" for w, f in families.items())
        diags.error(codes.CAPTURE_KEY_SPLIT,
                    f"capture-key split: the walks of {combine.name} fall in different capture "
                    f"families ({listed}) and {combine.name} has no capture of its own, so no "
                    f"single capture can replay a mixed step; give it a `capture`",
                    name_span(combine.span, combine.name, diags))


def _check_piecewise(node: ast.NodeDecl, diags: Diagnostics) -> None:
    """MW413: `piecewise` leaves attention out of the graphs; a node without attention layers has
    nothing to leave out."""
    if node.model_kind not in ATTENTION_FREE_KINDS:
        return
    for capture in [*node.captures, *(c.capture for c in node.combines if c.capture is not None)]:
        if capture.is_piecewise:
            diags.error(codes.PIECEWISE_WITHOUT_ATTENTION,
                        f"node {node.name} is an {node.model_kind}: its network has no attention layers to run "
                        f"eagerly between captured pieces; drop `piecewise` (a whole-step capture holds it all)",
                        capture.span)


def _cap_error(what: str, cap: int, capture: ast.CaptureDecl, span: ast.Span,
               diags: Diagnostics) -> None:
    largest = max(capture.batch)
    diags.error(codes.CAP_ABOVE_CAPTURE,
                f"{what} is above the largest captured batch size {largest}: steps of "
                f"{largest + 1}-{cap} rows would run eagerly; capture batch {cap} or lower the cap "
                f"to {largest}", span, *([] if span == capture.span else [Note("the capture", capture.span)]))


def _largest_mixed_cap(combine: ast.CombineDecl, caps: dict[str, int]) -> Optional[int]:
    """Without its own cap a mixed step takes the smallest cap among the walks in it
    (docs/plan.md), so the largest a mixed step can take is the second largest walk cap; a walk
    with no `cap` of its own may have any, so then the largest declared cap is the bound."""
    declared = sorted((caps[w] for w in set(combine.walks) if w in caps), reverse=True)
    if not declared:
        return None
    if len(declared) == len(set(combine.walks)) and len(declared) > 1:
        return declared[1]
    return declared[0]


def _check_mixed_caps(node: ast.NodeDecl, deployment: Deployment, diags: Diagnostics) -> None:
    """MW436 (module docstring), for the combined walks whose mixed steps some rank builds (a
    prefill/decode split builds none), each judged once by its walks on the first such rank."""
    caps = {c.walk: c.value for c in node.caps}
    judged: set[str] = set()
    for placed in deployment.placements((node.name, w) for c in node.combines for w in c.walks).values():
        for combine, members in placed_combines(node, {walk for _, walk, _ in placed}):
            if combine.name not in judged:
                judged.add(combine.name)
                _check_mixed_cap(combine, members, caps, diags)


def _check_mixed_cap(combine: ast.CombineDecl, walks: list[str], caps: dict[str, int], diags: Diagnostics) -> None:
    if combine.cap is not None or not all(w in caps for w in walks):
        return
    small, large = min(walks, key=lambda w: caps[w]), max(walks, key=lambda w: caps[w])
    if caps[small] < caps[large]:
        diags.warning(codes.MIXED_CAP_THROTTLES,
                      f"combined walk {combine.name} has no cap of its own, so its mixed steps take the smallest cap "
                      f"of its walks, {small}'s {caps[small]}: a step holding a {small} row holds at most "
                      f"{caps[small] - 1} {large} rows, where {large} alone takes {caps[large]}; give the block "
                      f"`cap {caps[large]}` (and a `rows {small} <= N` limit)",
                      name_span(combine.span, combine.name, diags))


def _check_combine_caps(combine: ast.CombineDecl, caps: dict[str, int], diags: Diagnostics) -> None:
    capture = combine.capture
    cap = combine.cap if combine.cap is not None else _largest_mixed_cap(combine, caps)
    if capture is not None and capture.batch and cap is not None and cap > max(capture.batch) \
            and not capture.is_eager_above:
        what = f"cap {cap} of combined walk {combine.name}"
        span = combine.cap_span or combine.span
        if combine.cap is None:
            what += " (a mixed step's default: the smallest cap of the walks in it)"
            span = capture.span
        _cap_error(what, cap, capture, span, diags)
    for rows in combine.rows:
        if rows.walk not in combine.walks:
            diags.error(codes.ROWS_NOT_IN_COMBINE,
                        f"rows limit for {rows.walk}, which is not a walk of {combine.name} "
                        f"({' + '.join(combine.walks)})", rows.span)
        elif capture is not None and capture.family == "packed" and capture.batch \
                and rows.limit > max(capture.batch):
            diags.error(codes.ROWS_ABOVE_CAPTURE,
                        f"rows {rows.walk} <= {rows.limit} is above the largest batch size "
                        f"{max(capture.batch)} of {combine.name}'s packed capture",
                        rows.span, Note("the capture", capture.span))


def _check_tp_groups(node: ast.NodeDecl, deployment: Deployment, diags: Diagnostics) -> None:
    for combine in node.combines:
        by_rank = deployment.placements((node.name, w) for w in dict.fromkeys(combine.walks))
        for rank, placed in sorted(by_rank.items()):
            groups = {g.index: g for _, _, g in placed}
            if len(groups) < 2 or all(g.world_size == 1 for g in groups.values()):
                continue
            described = "; ".join(
                f"{', '.join(w for _, w, g2 in placed if g2.index == i)} in node group {i} "
                f"(world size {g.world_size})" for i, g in sorted(groups.items()))
            diags.error(codes.COMBINE_TP_GROUPS,
                        f"on rank {rank} the walks of {node.name}'s combined walk {combine.name} run "
                        f"in different TP groups: {described}; a mixed step needs one lockstep group: list "
                        "those walks in one node group, or run them on different ranks (a prefill/decode split)",
                        name_span(combine.span, combine.name, diags),
                        *(Note(f"node group {i}", g.span) for i, g in sorted(groups.items())))


def worker_captures(spec: ast.Spec, deployment: Deployment) -> dict[int, list[WorkerCapture]]:
    """rank -> the capture families it holds, with their estimated bytes on that rank. A combined
    walk's capture is held only where the rank runs at least two of its walks: elsewhere (a
    prefill/decode split) lowering makes each walk its own key, without the combined family."""
    nodes = {n.name: n for n in spec.nodes}
    out: dict[int, list[WorkerCapture]] = {}
    for rank, placed in deployment.placements(spec_pairs(spec)).items():
        families: dict[str, WorkerCapture] = {}
        for node_name, walk, group in placed:
            node = nodes.get(node_name)
            if node is None:  # an unresolved name: resolve has reported it
                continue
            walks_here = {w for n, w, _ in placed if n == node_name}
            found = [(name, c, [c.walk or walk]) for name, c in walk_families(node, walk)]
            found += [(family_name(node_name, c.name), c.capture, list(c.walks))
                      for c, members in placed_combines(node, walks_here)
                      if walk in members and c.capture is not None]
            for name, capture, walks in found:
                if name not in families:
                    labels = capture_keys.family_labels(node, capture, walks)
                    num_bytes = capture_memory.estimate_family_bytes(node, capture, group.tp_size,
                                                                     capture_keys.num_self_sequences(node, labels))
                    families[name] = WorkerCapture(name, node, capture, group.tp_size, num_bytes)
        out[rank] = list(families.values())
    return out


def _check_memory(spec: ast.Spec, deployment: Deployment, diags: Diagnostics) -> None:
    """MW408: each worker's capture estimate within capture_memory_budget_mb, else within what the
    runtime can allocate (MAX_NODE_BYTES): the plan holds the estimates as int64, and absurd dims
    (a 2**31-wide node with 4,096 batch sizes) once gave one past 2**63."""
    budget = deployment.capture_memory_budget_bytes
    limit = MAX_NODE_BYTES if budget is None else budget
    for rank, families in sorted(worker_captures(spec, deployment).items()):
        total = sum(f.num_bytes for f in families)
        if total <= limit:
            continue
        largest = max(families, key=lambda f: f.num_bytes)
        by_node: dict[str, list[WorkerCapture]] = {}
        for family in sorted(families, key=lambda f: -f.num_bytes):
            by_node.setdefault(family.node.name, []).append(family)
        parts = "; ".join(
            f"{node} {sum(capture_memory.num_graphs(f.capture) for f in fams)} buckets: "
            + ", ".join(f"{f.name} {capture_memory.num_graphs(f.capture)} buckets "
                        f"{capture_memory.format_mib(f.num_bytes)}" for f in fams)
            for node, fams in by_node.items())
        if budget is None:
            diags.error(codes.CAPTURE_MEMORY_OVER_BUDGET,
                        f"capture memory estimate on rank {rank} is {format_bytes(total)}, more than the "
                        f"runtime can allocate ({format_bytes(MAX_NODE_BYTES)}; {parts})", largest.capture.span)
            continue
        diags.error(codes.CAPTURE_MEMORY_OVER_BUDGET,
                    f"capture memory estimate on rank {rank} is {capture_memory.format_mib(total)}, "
                    f"over capture_memory_budget_mb {deployment.capture_memory_budget_mb:g} "
                    f"({parts}): raise the budget to at least {math.ceil(total / 2**20)}, or capture fewer "
                    "batch sizes or token buckets (this one is the largest)", largest.capture.span,
                    Note("the budget", deployment.span_of("capture_memory_budget_mb")))
