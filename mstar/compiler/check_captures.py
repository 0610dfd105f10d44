"""Part of pass 5: several captures of one walk, and walks that replay another walk's captures.

In:  a `Spec` that passed resolve and check_graph, one of its nodes, the walks that run each node
     (`runs`: walk -> node names), the run's `Diagnostics`.
Out: nothing; adds
- MW414: two captures of one walk that are one family written twice: the same kind, options
  (`piecewise`, `eager_above`) and guidance mode (`guided`, `unguided` or neither) and, batched,
  the same tokens per row, or, packed, the same batch sizes or the same token buckets. One line
  with the union of their lists captures exactly the same graphs, and a step could only ever pick
  between equal keys.
- MW415: `capture W replays S` with nothing to replay: S has no `capture` line of its own on the
  node (a walk that only replays cannot be replayed in turn: name the walk that captures), or W
  is S.
- MW416: `capture W replays S` where a one-walk step of W computes something S's graphs do not:
  another attention route (decode kernels for one token a row, or prefill kernels), another
  attention mask (`bidirectional`), another sub-model, or other KV sequences read or written
  (`kv` lines). A captured graph bakes all four in.
- MW426: `unroll_prompts=N` where a step cannot unroll its prompt rows into one row per query token:
  on a packed family or a batched one of more than one token a row (its rows are not one-token
  rows), on a node without a KV cache or with a recurrent state (a recurrent state moves one token
  after another, and the rows of one step run side by side), with N below 2 (nothing to unroll),
  or with N above the largest batch size (a step of one N-token prompt needs N rows).
- MW434: a stream into a kv node whose chunks hold more items than a batched capture of a walk
  taking them holds tokens a row (each item is a position the row feeds).
- MW435 (a warning): a batched capture of a walk whose calls of the node, outside loops, take a
  text prompt input: its rows feed the prompt, any number of tokens, and a batched family holds
  `tokens_per_row` a row, so the runtime runs every step with a longer row eagerly (before, the
  scheduler padded such steps to the family and the engine refused every one of them). Not with
  `unroll_prompts=N`, where the author replays prompt rows of at most N tokens as one-token rows.
- MW427 (a warning): a packed capture held whole (no `piecewise`) on a node with a recurrent state.
  Its gated delta-net layers' conv and chunked rule take their grids and indices from the rows'
  lengths, which a whole graph would fix at capture, so the runtime runs those steps eagerly;
  `piecewise` captures everything around them (docs/engine.md).
(Several captures of one walk are allowed: the step takes the family whose key holds it with the
smallest (tokens, batch), docs/language.md "Several captures of one walk".)
"""
from __future__ import annotations

from typing import Optional

from mstar.compiler import codes
from mstar.compiler.chunking import node_calls
from mstar.compiler.lower_keys import single_attention
from mstar.compiler.lower_walks import lower_walks
from mstar.compiler.resolve import iter_calls, iter_sections, name_span
from mstar.compiler.walk_tree import WalkTree
from mstar.lang import ast
from mstar.lang.diagnostics import Diagnostics, Note


def check_node(spec: ast.Spec, node: ast.NodeDecl, runs: dict[str, set[str]], diags: Diagnostics) -> None:
    _check_mergeable(node, diags)
    if node.engine == "kv":
        _check_stream_rows(spec, node, diags)
        _check_prompt_rows(spec, node, diags)
    _check_unroll(node, diags)
    _check_whole_recurrent(node, diags)
    if not node.capture_replays:
        return
    trees: Optional[dict[str, WalkTree]] = None
    for replay in node.capture_replays:
        if not _runs_both(node, replay, runs):
            continue  # an unknown walk (MW103) or one that does not run the node (MW401)
        source_span = name_span(replay.span, replay.source, diags, skip=1 if replay.source == replay.walk else 0)
        if replay.walk == replay.source:
            diags.error(codes.REPLAY_WITHOUT_CAPTURE,
                        f"walk {replay.walk} replays its own captures on {node.name}; a replay names another walk",
                        source_span)
            continue
        if not any(c.walk == replay.source for c in node.captures):
            replayed = next((r for r in node.capture_replays if r.walk == replay.source), None)
            why = (f"it only replays those of {replayed.source}: name {replayed.source}" if replayed is not None
                   else "give it a `capture` line or replay a walk that has one")
            diags.error(codes.REPLAY_WITHOUT_CAPTURE,
                        f"walk {replay.walk} replays the captures of {replay.source} on {node.name}, but "
                        f"{replay.source} has no capture of its own there; {why}", source_span)
            continue
        if trees is None:
            params = ast.values_by_name(spec.params)
            if _names_unknown_loop_params(spec, params):
                return  # a loop names an unknown param (MW104): the walks cannot be compared
            trees = {tree.name: tree for tree in lower_walks(spec, params)}
        problem = _difference(node, replay, trees)
        if problem is not None:
            diags.error(codes.REPLAY_MISMATCH,
                        f"walk {replay.walk} cannot replay the captures of {replay.source} on {node.name}: {problem}; "
                        f"a graph captured for {replay.source} would compute another step",
                        name_span(replay.span, replay.walk, diags),
                        *(Note(f"a capture of {replay.source}", c.span) for c in node.captures
                          if c.walk == replay.source))


def _names_unknown_loop_params(spec: ast.Spec, params: dict[str, int]) -> bool:
    """Whether a walk's loop names a param (`max=`, `count=`) the spec lacks: resolve reports it
    (MW104), and `lower_walks` cannot lower such a walk."""
    return any(isinstance(name, str) and name not in params
               for walk in spec.walks for section in iter_sections(walk.body) if isinstance(section, ast.Loop)
               for name in (section.max_iters, section.count))


def _runs_both(node: ast.NodeDecl, replay: ast.CaptureReplay, runs: dict[str, set[str]]) -> bool:
    return all(w in runs and node.name in runs[w] for w in (replay.walk, replay.source))


def _difference(node: ast.NodeDecl, replay: ast.CaptureReplay, trees: dict[str, WalkTree]) -> Optional[str]:
    """What a step of replay.walk computes differently from one of replay.source, or None."""
    walk, source = replay.walk, replay.source
    routes = (single_attention(node, trees[walk]), single_attention(node, trees[source]))
    if routes[0] != routes[1]:
        return f"its steps run {routes[0]} attention kernels, those of {source} {routes[1]} kernels"
    bidirectional = set(node.bidirectional.walks) if node.bidirectional else set()
    if (walk in bidirectional) != (source in bidirectional):
        masks = ["bidirectional" if w in bidirectional else "causal" for w in (walk, source)]
        return f"its rows attend {masks[0]}ly, those of {source} {masks[1]}ly"
    # the models a graph of the walk bakes in: its sub-model (or the node's) and any depth model
    models = [" and ".join(f"sub-model {sub.name}" for sub in node.submodels if w in sub.walks) or "the node's model"
              for w in (walk, source)]
    if models[0] != models[1]:
        return f"its rows run {models[0]}, those of {source} {models[1]}"
    access = {a.walk: (sorted(a.reads), sorted(a.writes)) for a in node.kv_access}
    if access.get(walk) != access.get(source):
        return f"it reads and writes other KV sequences ({_access_text(access.get(walk))} against " \
               f"{_access_text(access.get(source))})"
    return None


def _access_text(access: Optional[tuple[list[str], list[str]]]) -> str:
    if access is None:
        return "the node's default"
    reads, writes = access
    return " ".join(part for part in (f"reads {' '.join(reads)}" if reads else "",
                                      f"writes {' '.join(writes)}" if writes else "") if part)


def _check_mergeable(node: ast.NodeDecl, diags: Diagnostics) -> None:
    """MW414: a second capture of a walk that is the same family as an earlier one."""
    seen: dict[str, list[ast.CaptureDecl]] = {}
    for capture in node.captures:
        if capture.walk is None:
            continue
        earlier = next((c for c in seen.get(capture.walk, []) if is_one_family(c, capture)), None)
        seen.setdefault(capture.walk, []).append(capture)
        if earlier is None:
            continue
        shared = ("tokens_per_row" if capture.family == "batched"
                  else "batch sizes" if sorted(earlier.batch) == sorted(capture.batch) else "token buckets")
        diags.error(codes.CAPTURES_MERGEABLE,
                    f"walk {capture.walk} has two {capture.family} captures on {node.name} with the same {shared} "
                    "and options: they are one family; write one line with both lists' sizes",
                    capture.span, Note("the first", earlier.span))


def _check_stream_rows(spec: ast.Spec, node: ast.NodeDecl, diags: Diagnostics) -> None:
    """MW434: a stream into this kv node whose chunks hold more items than a batched capture of a
    walk taking them holds tokens a row: each item is a position the row feeds, so every such step
    was refused at run time (`StepContractError: ... feeds 2 tokens, past the 1 tokens a row ...`)."""
    streamed = {d.name for d in node.inputs if d.is_stream}
    walks = {w.name: w for w in spec.walks}
    part_of = {walk: p for p in spec.partitions for stage in p.stages for walk in stage.walks}
    for walk_name, capture in _walks_captures(node):
        walk, partition = walks.get(walk_name or ""), part_of.get(walk_name or "")
        if capture.family != "batched" or walk is None or partition is None:
            continue
        taken = {i for call in iter_calls(walk.body) if call.node == node.name for i in call.inputs} & streamed
        for source in partition.streams:
            items = _most_items(source.policy)
            if source.edge in taken and items > capture.tokens_per_row:
                diags.error(codes.STREAM_CHUNK_PAST_ROW,
                            f"stream {source.partition}.{source.edge} feeds {node.name} chunks of up to {items} "
                            f"items, one position each, in walk {walk_name}, but a batched capture of it holds "
                            f"{capture.tokens_per_row} token{'s' if capture.tokens_per_row != 1 else ''} a row: "
                            "cut chunks of at most that many, or capture the walk with tokens_per_row of at least "
                            f"{items} (or packed)", source.policy.span, Note("the capture", capture.span))


def _check_prompt_rows(spec: ast.Spec, node: ast.NodeDecl, diags: Diagnostics) -> None:
    """MW435 (a warning): a batched capture of a walk whose rows feed a text prompt (module docstring)."""
    prompts = {d.name for d in node.inputs if d.prompt == "text"}
    walks = {w.name: w for w in spec.walks}
    for walk_name, capture in _walks_captures(node):
        walk = walks.get(walk_name or "")
        if capture.family != "batched" or walk is None or capture.unroll_prompts:
            continue  # (unroll_prompts: the author replays short prompt rows as one-token rows)
        taken = sorted({i for call, is_in_loop in node_calls(walk.body, node.name) if not is_in_loop
                        for i in call.inputs} & prompts)
        if taken:
            per_row = f"{capture.tokens_per_row} token{'s' if capture.tokens_per_row != 1 else ''} a row"
            diags.warning(codes.PROMPT_ROW_PAST_BATCHED,
                          f"walk {walk_name}'s rows feed {node.name} the request's text prompt ({taken[0]}), any "
                          "number of tokens up to max_seq_len (a chunk with chunking), but a batched capture holds "
                          f"{per_row}: every step with a longer row runs eagerly; capture {walk_name} packed (with "
                          "token buckets) to replay its prompt steps", capture.span)


def _walks_captures(node: ast.NodeDecl) -> list[tuple[Optional[str], ast.CaptureDecl]]:
    """(walk, capture) for each capture line of the node and, for each walk of a combined walk, the
    combine's capture: the families a step of that walk may replay."""
    return [*((c.walk, c) for c in node.captures),
            *((walk, c.capture) for c in node.combines if c.capture is not None for walk in c.walks)]


def _most_items(policy: ast.ChunkPolicy) -> int:
    """The most items one chunk of the policy holds (a left_context chunk carries its context too)."""
    return policy.size + (policy.context or 0) if policy.kind == "left_context" else policy.size


def _check_unroll(node: ast.NodeDecl, diags: Diagnostics) -> None:
    """MW426: `unroll_prompts=N` on a capture whose steps cannot unroll prompt rows (module docstring)."""
    for capture in [*node.captures, *(c.capture for c in node.combines if c.capture is not None)]:
        n = capture.unroll_prompts
        if not n:
            continue
        if capture.family != "batched" or capture.tokens_per_row != 1:
            kind = "a packed" if capture.family != "batched" else f"a {capture.tokens_per_row}-token-a-row"
            why = (f"{kind} family: unrolled prompt rows are one-token rows, which a batched family of one "
                   "token a row holds")
        elif node.engine != "kv":
            why = f"node {node.name} keeps no KV cache for each unrolled row to read its own length of"
        elif any(s.kind == "recurrent" for s in node.states):
            why = (f"node {node.name} keeps a recurrent state, which moves one token after another, while the "
                   "rows of one step run side by side")
        elif n < 2:
            why = "a prompt row of one token is a one-token row already: give 2 or more, or drop the option"
        elif n > max(capture.batch, default=0):
            largest = max(capture.batch, default=0)  # `batch=[]` is MW433's (check_zero_sizes), reported first
            why = (f"a step of one {n}-token prompt needs {n} rows, above the largest captured batch size "
                   f"{largest}: give at most {largest}")
        else:
            continue
        diags.error(codes.UNROLL_CANNOT_APPLY, f"unroll_prompts={n} cannot apply here: {why}", capture.span)


def _check_whole_recurrent(node: ast.NodeDecl, diags: Diagnostics) -> None:
    """MW427: a packed capture held whole on a node with a recurrent state (module docstring)."""
    state = next((s for s in node.states if s.kind == "recurrent"), None)
    if state is None:
        return
    for capture in [*node.captures, *(c.capture for c in node.combines if c.capture is not None)]:
        if capture.family == "packed" and not capture.is_piecewise:
            diags.warning(codes.WHOLE_PACKED_RECURRENT,
                          f"this packed capture is held whole, but node {node.name} keeps a recurrent state: "
                          "its layers' kernels follow each step's row lengths, which a whole graph would fix, so "
                          "these steps run eagerly; add `piecewise` to capture everything around those layers",
                          capture.span, Note("the recurrent state is declared here", state.span))


def is_one_family(a: ast.CaptureDecl, b: ast.CaptureDecl, is_mode_ignored: bool = False) -> bool:
    """Whether one line with both lists would capture the same graphs: the same kind, options and
    guidance mode (unless `is_mode_ignored`: check_capture_keys.py's MW425 compares the rest)."""
    if ((a.family, a.is_piecewise, a.is_eager_above, a.unroll_prompts)
            != (b.family, b.is_piecewise, b.is_eager_above, b.unroll_prompts)):
        return False
    if not is_mode_ignored and a.guidance != b.guidance:
        return False
    if a.family == "batched":
        return a.tokens_per_row == b.tokens_per_row
    return sorted(a.batch) == sorted(b.batch) or sorted(a.tokens) == sorted(b.tokens)
