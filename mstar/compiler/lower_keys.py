"""Lowering, part 2: scheduling keys of one node on one worker, with their mixture tables.

In:  a node's declaration, the walks of that node this worker runs (`walks_here`, spec order),
     the lowered walks, the TP size per walk on this worker, the row cap used when neither a cap
     nor a capture bounds a walk.
Out: `lower_node_keys(...) -> (keys: list[KeyPlan], walk_to_key: dict[walk, key name])`.

Rules (docs/plan.md, keys and mixture tables):
- A combined walk becomes one key `NODE:COMBINE` on a worker that runs at least two of its
  walks; its walks are those, in the combine's order (bit i of a mask = walks[i]). A walk that
  combines with nothing here (or whose partners run elsewhere, as in prefill/decode
  disaggregation) is its own key `NODE:WALK`.
- A one-walk step keeps that walk's cap (its `cap`, else its captures' largest batch, else the
  fallback) and replays one of the walk's capture families (`walk_families`: its own captures,
  then those of the walks it replays; the mixture's `capture` is the first, `also_captures` the
  rest, and the step takes the smallest (tokens, batch) that holds it); attention is "decode" for a walk that loops one
  token a row back into the node (see `_single_attention`), "prefill" otherwise, "none" for
  stateless nodes.
- A mixed step takes the combine's own cap when given, else the smallest cap among the walks
  present; it replays the combine's capture (or runs eagerly) with the combine's attention route
  (default "split").
- each family carries its guidance mode and the KV sequences its graphs touch (capture_keys.py);
  its memory estimate counts a row once per self-attention sequence it touches.
- batch_pad is a direct lookup sized to the largest batch any step of the key using the family may
  hold (a family replayed by walks of two keys is listed in both, with the same buckets).
"""
from __future__ import annotations

from typing import Collection, Literal

from mstar.compiler import capture_keys, capture_memory
from mstar.lang import ast
from mstar.plan.buckets import batch_pad_table
from mstar.plan.schema import CaptureFamily, KeyPlan, MixtureEntry

from mstar.compiler.walk_tree import WalkTree, loops_back_into

Attention = Literal["decode", "prefill", "split", "packed", "none"]  # MixtureEntry.attention
DEFAULT_MIXED_ATTENTION: Attention = "split"


def family_name(node: str, owner: str) -> str:
    """Capture family of a walk or combined walk of a node: `LLM:decode`, `LLM:mixed`."""
    return f"{node}:{owner}"


def own_families(node: ast.NodeDecl, walk: str) -> list[tuple[str, ast.CaptureDecl]]:
    """(family name, capture) of the walk's own `capture` lines, in declaration order: `NODE:WALK`,
    then `NODE:WALK#2`, `NODE:WALK#3`, ... (a position, never read for meaning)."""
    captures = [c for c in node.captures if c.walk == walk]
    return [(family_name(node.name, walk) + (f"#{i + 1}" if i else ""), c) for i, c in enumerate(captures)]


def walk_families(node: ast.NodeDecl, walk: str) -> list[tuple[str, ast.CaptureDecl]]:
    """(family name, capture) of every family a one-walk step of `walk` may replay: its own, then
    those of each walk it replays (`capture WALK replays OTHER`, in the order of those lines; only
    OTHER's own captures: check_captures refuses a replay of a walk that only replays)."""
    found = own_families(node, walk)
    for replay in node.capture_replays:
        if replay.walk == walk and replay.source != walk:
            names = {name for name, _ in found}
            found += [(name, c) for name, c in own_families(node, replay.source) if name not in names]
    return found


def walk_captures(node: ast.NodeDecl, walk: str) -> list[ast.CaptureDecl]:
    """The captures of `walk_families`, without their names."""
    return [c for _, c in walk_families(node, walk)]


def walk_cap(node: ast.NodeDecl, walk: str, fallback_cap: int) -> int:
    """Most rows of a one-walk step: the declared cap, else the largest captured batch (a capture
    that runs eagerly above its buckets, `eager_above`, does not bound the walk), else the fallback."""
    for cap in node.caps:
        if cap.walk == walk:
            return cap.value
    batches = [b for c in walk_captures(node, walk) if not c.is_eager_above for b in c.batch]
    return max(batches) if batches else fallback_cap


def single_attention(node: ast.NodeDecl, walk: WalkTree) -> Attention:
    """Attention kernels of a one-walk step. "decode" (one query token a row) when the walk
    feeds the node's output back to it and that token is one row's single input: its captures
    are all batched with one token a row, and, without a capture to say so, the loop-back stays
    on the device (a sampled token; a latent fed back through the host, as in image generation,
    is many tokens and runs on prefill kernels). The captures are those the walk's steps replay
    (its own and those of the walks it replays)."""
    if node.engine == "stateless":
        return "none"
    feedback = loops_back_into(walk, node.name)
    captures = walk_captures(node, walk.name)
    if not feedback:
        return "prefill"
    if captures:
        is_one_token = all(c.family == "batched" and c.tokens_per_row == 1 for c in captures)
    else:
        is_one_token = all(e.is_device for e in feedback)
    return "decode" if is_one_token else "prefill"


def _family(node, capture, name, max_rows, tp_size, walks: list[str]) -> CaptureFamily:
    """The plan's family of one capture line, replayed by steps of `walks` (the capture's own walk,
    or the combined walk's walks)."""
    labels = capture_keys.family_labels(node, capture, walks)
    return CaptureFamily(
        name=name,
        kind=capture.family,
        batch_sizes=sorted(capture.batch),
        token_buckets=sorted(capture.tokens) if capture.family == "packed" else [],
        tokens_per_row=capture.tokens_per_row if capture.family == "batched" else 1,
        batch_pad=batch_pad_table(capture.batch, max_rows),
        num_graphs=capture_memory.num_graphs(capture),
        memory_bytes=capture_memory.estimate_family_bytes(node, capture, tp_size,
                                                          capture_keys.num_self_sequences(node, labels)),
        guidance=capture_keys.plan_guidance(capture),
        labels=labels,
        is_eager_above=capture.is_eager_above,
        is_piecewise=capture.is_piecewise,
        unroll_prompts=capture.unroll_prompts,
    )


def _key(
    node: ast.NodeDecl,
    name: str,
    walks: list[str],
    combine: ast.CombineDecl | None,
    walk_plans: dict[str, WalkTree],
    tp_size: int,
    fallback_cap: int,
) -> KeyPlan:
    caps = {w: walk_cap(node, w, fallback_cap) for w in walks}
    mixtures = [MixtureEntry(mask=0, walks=[], cap=0, attention="none")]
    family_rows: dict[str, int] = {}  # family name -> largest cap of a step that replays it
    for mask in range(1, 1 << len(walks)):
        present = [w for i, w in enumerate(walks) if mask >> i & 1]
        if len(present) == 1:
            walk = present[0]
            cap = caps[walk]
            names = [name for name, _ in walk_families(node, walk)]
            entry = MixtureEntry(
                mask=mask, walks=present, cap=cap, label=walk, capture=names[0] if names else None,
                also_captures=names[1:], attention=single_attention(node, walk_plans[walk]),
            )
        else:
            assert combine is not None  # a key of several walks is a combined walk's
            cap = combine.cap if combine.cap is not None else min(caps[w] for w in present)
            capture = family_name(node.name, combine.name) if combine.capture else None
            attention: Attention
            if node.engine == "stateless":
                attention = "none"
            else:
                attention = combine.attention or DEFAULT_MIXED_ATTENTION
            entry = MixtureEntry(mask=mask, walks=present, cap=cap, capture=capture, attention=attention)
        mixtures.append(entry)
        for replayed in ([entry.capture] if entry.capture is not None else []) + entry.also_captures:
            family_rows[replayed] = max(family_rows.get(replayed, 0), cap)

    families: list[CaptureFamily] = []
    for walk in walks:
        for fname, decl in walk_families(node, walk):
            if all(f.name != fname for f in families):
                families.append(_family(node, decl, fname, family_rows.get(fname, 0), tp_size, [decl.walk or walk]))
    if combine is not None and combine.capture is not None and len(walks) > 1:
        fname = family_name(node.name, combine.name)
        families.append(_family(node, combine.capture, fname, family_rows.get(fname, 0), tp_size,
                                list(combine.walks)))

    batch_rules = {b.walk: list(b.rules) for b in node.batching if b.walk in walks}
    rows_limits = {}
    if combine is not None and len(walks) > 1:
        rows_limits = {r.walk: r.limit for r in combine.rows if r.walk in walks}
    return KeyPlan(
        name=name,
        node=node.name,
        walks=walks,
        is_combined=len(walks) > 1,
        mixtures=mixtures,
        rows_limits=rows_limits,
        batch_rules=batch_rules,
        captures=sorted(families, key=lambda f: f.name),
    )


def placed_combines(node: ast.NodeDecl, walks_here: Collection[str]) -> list[tuple[ast.CombineDecl, list[str]]]:
    """The combined walks of `node` that are keys on a worker running `walks_here`, each with its
    walks there (combine order): those with at least two walks here, a walk going to the first
    combine that takes it. The one rule for where a combined key, and so its capture family,
    exists: lowering and the compile-time capture estimate (check_combine.worker_captures, MW408)
    both read it."""
    placed: list[tuple[ast.CombineDecl, list[str]]] = []
    taken: set[str] = set()
    for combine in node.combines:
        members = [w for w in combine.walks if w in walks_here and w not in taken]
        if len(members) >= 2:
            placed.append((combine, members))
            taken.update(members)
    return placed


def lower_node_keys(
    node: ast.NodeDecl,
    walks_here: list[str],
    walk_plans: dict[str, WalkTree],
    tp_sizes: dict[str, int],
    fallback_cap: int,
) -> tuple[list[KeyPlan], dict[str, str]]:
    """Keys of `node` on one worker and the walk -> key name map (see the module docstring)."""
    keys: list[KeyPlan] = []
    walk_to_key: dict[str, str] = {}
    for combine, members in placed_combines(node, walks_here):
        name = family_name(node.name, combine.name)
        keys.append(_key(node, name, members, combine, walk_plans, tp_sizes[members[0]], fallback_cap))
        walk_to_key.update({w: name for w in members})
    for walk in walks_here:
        if walk not in walk_to_key:
            name = family_name(node.name, walk)
            keys.append(_key(node, name, [walk], None, walk_plans, tp_sizes[walk], fallback_cap))
            walk_to_key[walk] = name
    return keys, walk_to_key
