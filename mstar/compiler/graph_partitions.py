"""The partitions panel of `mstarc graph`: partitions as boxes, the streams between them as arrows.

In:  a checked `Spec` and the panel's top y. Out: `partitions_panel(spec, top) -> (svg elements,
height, width)`, appended by graph_picture.walks_svg after the walk panels.

Each partition is a box holding its name, its stages as the spec writes them (`prefill -> decode |
image_gen`, `w?` or `(a | b)?` for an optional stage, `(a -> b | c)?` for sequences inside
alternatives) and what its walks send to the client (`client: audio`). Boxes stand in columns by
stream depth: a partition no stream feeds is in column 0, a consumer one column right of its
deepest producer, so Qwen3-Omni reads Thinker -> Talker -> Code2Wav left to right. Each stream
`<- P.edge policy` is an arrow from its producer to its consumer, labelled with the edge and the
chunk policy (several streams between one pair stack their labels).
"""
from __future__ import annotations

from html import escape

from mstar.compiler.lower_walks import lower_partitions, lower_walks
from mstar.lang import ast
from mstar.plan.schema import ChunkPolicyPlan, PartitionPlan, StagePlan

BOX_W = 250
COL_GAP, ROW_GAP = 190, 40
MARGIN, TITLE_H, LINE_H = 30, 34, 14
FONT = "font-family='DejaVu Sans, Arial, sans-serif'"


def policy_text(policy: ChunkPolicyPlan) -> str:
    """A chunk policy as the language writes it: window(28, stride=7), fixed(1, continue_after_done)."""
    args = [f"chunk={policy.size}" if policy.kind == "left_context" else str(policy.size)]
    if policy.stride is not None:
        args.append(f"stride={policy.stride}")
    if policy.context is not None:
        args.append(f"context={policy.context}")
    if policy.is_continue_after_done:
        args.append("continue_after_done")
    return f"{policy.kind}({', '.join(args)})"


def stage_text(stage: StagePlan) -> str:
    """A stage as the spec writes it: `a | b`, `w?`, `(a | b)?`, `(a -> b | c)?`.

    Parentheses wherever the walks are more than one and the stage is optional or holds a
    sequence, so a sequence's arrows never read as the partition's own stages."""
    if len(stage.walks) == 1:
        return stage.walks[0] + ("?" if stage.is_optional else "")
    choices = " | ".join(" -> ".join(walks) for walks in _alternatives(stage))
    if stage.sequence_lengths or stage.is_optional:
        return f"({choices})" + ("?" if stage.is_optional else "")
    return choices


def _alternatives(stage: StagePlan) -> list[list[str]]:
    """The stage's alternatives, each its walks in order (the language's reading of the plan's stage)."""
    return ast.alternatives(ast.Stage(walks=stage.walks, is_optional=stage.is_optional,
                                      sequence_lengths=stage.sequence_lengths))


def _text(x: float, y: float, text: str, size: int = 11, anchor: str = "start", weight: str = "normal") -> str:
    return (f"<text x='{x:.0f}' y='{y:.0f}' {FONT} font-size='{size}' text-anchor='{anchor}' "
            f"font-weight='{weight}'>{escape(text)}</text>")


def _fit(text: str, size: int, width: float) -> str:
    """`text` cut with "..." to about `width` pixels (0.62 em per character, generous)."""
    limit = max(4, int(width / (size * 0.62)))
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _stage_lines(partition: PartitionPlan, size: int, width: float, max_lines: int = 3) -> list[str]:
    """The stages as `a -> (b | c)? -> d`, broken after an arrow where a line would not fit."""
    stages = [stage_text(s) for s in partition.stages]
    lines: list[str] = []
    for stage in stages:
        if lines and len(f"{lines[-1]} -> {stage}") * size * 0.62 <= width:
            lines[-1] = f"{lines[-1]} -> {stage}"
        else:
            lines.append(stage if not lines else f"-> {stage}")
    if len(lines) > max_lines:
        lines = lines[: max_lines - 1] + ["..."]
    return [_fit(line, size, width) for line in lines] or ["(no walks)"]


def _columns(partitions: list[PartitionPlan]) -> dict[str, int]:
    """Partition -> column: 0 when no stream feeds it, else one past its deepest producer (the
    streams are acyclic: check_graph refuses a cycle of partitions)."""
    producers = {p.name: [s.producer_partition for s in p.streams] for p in partitions}
    column: dict[str, int] = {}

    def depth(name: str, seen: frozenset) -> int:
        if name not in column:
            known = [q for q in producers.get(name, []) if q in producers and q not in seen]
            column[name] = 1 + max((depth(q, seen | {name}) for q in known), default=-1)
        return column[name]

    for partition in partitions:
        depth(partition.name, frozenset())
    return column


def _client_outputs(spec: ast.Spec) -> dict[str, list[str]]:
    """Partition -> the modalities its walks send to the client, in first-seen order."""
    params = ast.values_by_name(spec.params)
    found: dict[str, list[str]] = {}

    def visit(sections: list, partition: str) -> None:
        for section in sections:
            for edge in getattr(section, "edges", []):
                if edge.dest_kind == "client" and edge.modality not in found.setdefault(partition, []):
                    found[partition].append(edge.modality)
            visit(getattr(section, "body", []), partition)

    for walk in lower_walks(spec, params):
        visit(walk.body, walk.partition)
    return found


def _start_lines(partition: PartitionPlan) -> list[str]:
    """Where a request starts the partition: the first walk of the first stage that is not optional
    (a request's default), and those it may ask for instead (an optional stage before it, another
    alternative). The plan's `initial_walk` is the first stage's first walk, which for BAGEL is its
    optional `prefill_vae`: "starts at prefill_vae" said what a default request never does."""
    if partition.initial_walk is None:
        return ["started by its streams"]
    asked: list[str] = []
    for stage in partition.stages:
        firsts = [walks[0] for walks in _alternatives(stage)]
        if stage.is_optional:
            asked += firsts
            continue
        others = [walk for walk in asked + firsts[1:] if walk != firsts[0]]
        return [f"starts at {firsts[0]}"] + ([f"or asked: {' / '.join(others)}"] if others else [])
    return ["starts at the stage asked:", " / ".join(asked)]


def _box_lines(partition: PartitionPlan, outputs: list[str]) -> list[str]:
    """What a partition's box says under its name: stages, how it starts, what the client gets."""
    lines = _stage_lines(partition, 10, BOX_W - 12) + [_fit(line, 10, BOX_W - 12) for line in _start_lines(partition)]
    if partition.repeat is not None:  # the spec's `repeat while VALUE max=N`
        lines.append(_fit(f"repeats while {partition.repeat.value} (at most {partition.repeat.max_rounds})", 10,
                          BOX_W - 12))
    if outputs:
        lines.append("client: " + ", ".join(m or "-" for m in outputs))
    return lines


def _box(name: str, lines: list[str], x: float, y: float, height: float) -> list[str]:
    parts = [f"<rect x='{x:.0f}' y='{y:.0f}' width='{BOX_W}' height='{height:.0f}' rx='8' fill='#eef6ec' "
             "stroke='#2e7d32'/>",
             _text(x + BOX_W / 2, y + 18, f"partition {name}", 13, "middle", "bold")]
    parts += [_text(x + BOX_W / 2, y + 36 + i * LINE_H, line, 10, "middle") for i, line in enumerate(lines)]
    return parts


def partitions_panel(spec: ast.Spec, top: float) -> tuple[list[str], float, float]:
    partitions = lower_partitions(spec)
    column = _columns(partitions)
    outputs = _client_outputs(spec)
    lines = {p.name: _box_lines(p, outputs.get(p.name, [])) for p in partitions}
    box_h = 30 + LINE_H * max((len(text) for text in lines.values()), default=1)
    rows: dict[int, int] = {}
    place: dict[str, tuple[float, float]] = {}
    for partition in partitions:
        col = column[partition.name]
        row = rows.get(col, 0)
        rows[col] = row + 1
        place[partition.name] = (MARGIN + col * (BOX_W + COL_GAP), top + TITLE_H + 10 + row * (box_h + ROW_GAP))
    parts = [_text(MARGIN, top + 18, "partitions and streams", 15, weight="bold")]
    for partition in partitions:
        parts += _box(partition.name, lines[partition.name], *place[partition.name], box_h)
    for partition in partitions:
        num_from: dict[str, int] = {}
        for stream in partition.streams:
            if stream.producer_partition not in place:
                continue
            index = num_from.get(stream.producer_partition, 0)
            num_from[stream.producer_partition] = index + 1
            (px, py), (cx, cy) = place[stream.producer_partition], place[partition.name]
            sy, ey = py + box_h / 2 + index * 8, cy + box_h / 2 + index * 8
            parts.append(f"<line x1='{px + BOX_W:.0f}' y1='{sy:.0f}' x2='{cx - 2:.0f}' y2='{ey:.0f}' "
                         "stroke='#2e7d32' stroke-width='1.5' marker-end='url(#arrow-stream)'/>")
            # labels stack upwards from above the first arrow between the pair, two lines each
            mid_x, mid_y = (px + BOX_W + cx) / 2, (py + cy + box_h) / 2 - 6 - index * (2 * LINE_H + 4)
            parts.append(_text(mid_x, mid_y - LINE_H, stream.edge, 10, "middle", "bold"))
            parts.append(_text(mid_x, mid_y, _fit(policy_text(stream.policy), 9, COL_GAP + 40), 9, "middle"))
    num_cols = 1 + max(column.values(), default=0)
    height = TITLE_H + 20 + max(rows.values(), default=1) * (box_h + ROW_GAP)
    width = 2 * MARGIN + num_cols * BOX_W + (num_cols - 1) * COL_GAP
    return parts, height, width
