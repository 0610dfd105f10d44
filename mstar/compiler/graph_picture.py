"""`mstarc graph`: a checked spec's walks drawn as one SVG picture (written directly, no
graphviz binary or plotting library needed).

In:  a `Spec` that passed resolve and check_graph. Out: `draw_walks(spec, path)` writes the SVG;
`walks_svg(spec) -> str` returns it.

One panel per walk, sections left to right, parallel members stacked. A call is a box; an edge
to another node is an arrow (loop-backs curve back underneath, dashed when they stay on the
device); edges to the conductor, the client or a stream are listed under their box with their
flags. Loops are dashed frames labelled with name, bound, stop and on-device. Then the partitions
and the streams between them (graph_partitions.py), and a last panel listing each node's combined
walks (cap, rows limits, attention) and the partitions.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from html import escape
from pathlib import Path

from mstar.compiler.graph_partitions import partitions_panel, policy_text, stage_text
from mstar.compiler.lower_walks import lower_partitions, lower_walks
from mstar.files import atomic_write_text, make_dirs
from mstar.lang import ast
from mstar.compiler.walk_tree import TreeCall, TreeEdge, TreeLoop, TreeParallel, WalkTree

BOX_W, BOX_H = 200, 46
COL_W, ROW_H = 290, 180
MARGIN = 30
TITLE_H = 34
LINE_H = 15
FONT = "font-family='DejaVu Sans, Arial, sans-serif'"


@dataclass
class _Box:
    call: TreeCall
    col: int
    row: int
    loop_depth: int

    @property
    def x(self) -> float:
        return MARGIN + self.col * COL_W

    def y(self, top: float) -> float:
        return top + TITLE_H + self.row * ROW_H + self.loop_depth * 4


@dataclass
class _Frame:
    loop: TreeLoop
    first_col: int
    last_col: int
    rows: int
    depth: int


@dataclass
class _Layout:
    boxes: list[_Box] = field(default_factory=list)
    frames: list[_Frame] = field(default_factory=list)
    num_rows: int = 1


def _place(sections: list, col: int, row: int, depth: int, out: _Layout) -> tuple[int, int]:
    """Place sections from column `col`; returns (next free column, rows used)."""
    rows_used = 1
    for section in sections:
        if isinstance(section, TreeCall):
            out.boxes.append(_Box(section, col, row, depth))
            col += 1
        elif isinstance(section, TreeParallel):
            next_col, member_row = col, row
            for member in section.body:
                end, used = _place([member], col, member_row, depth, out)
                next_col = max(next_col, end)
                member_row += used
            rows_used = max(rows_used, member_row - row)
            col = next_col
        elif isinstance(section, TreeLoop):
            start = col
            col, used = _place(section.body, col, row, depth + 1, out)
            out.frames.append(_Frame(section, start, col - 1, used, depth))
            rows_used = max(rows_used, used)
        else:
            col, used = _place(section.body, col, row, depth, out)
            rows_used = max(rows_used, used)
    out.num_rows = max(out.num_rows, row + rows_used)
    return col, rows_used


def _flags(edge: TreeEdge) -> str:
    flags = [n for n, on in (("persist", edge.is_persist), ("device", edge.is_device),
                             ("count_tokens", edge.is_count_tokens)) if on]
    if edge.modality:
        flags.append(edge.modality)
    return f" [{', '.join(flags)}]" if flags else ""


def _target(boxes: list[_Box], source: _Box, edge: TreeEdge) -> _Box | None:
    """The box an edge points at, among the calls of its node that take the edge's input (any call
    of the node where none does): for a loop-back the earliest at or before the source inside the
    source's loop (as deep as it), else the next one after the source. (Without the input and the
    loop, wan22's loop-backs pointed at a call outside the loop that takes neither.)"""
    same = [b for b in boxes if b.call.node == edge.dest]
    same = [b for b in same if edge.name in b.call.inputs] or same
    if edge.is_loop_back:
        earlier = [b for b in same if b.col <= source.col]
        inside = [b for b in earlier if b.loop_depth >= source.loop_depth]
        found = inside or earlier
        return found[0] if found else None
    later = [b for b in same if b.col > source.col]
    return later[0] if later else None


def _text_width(text: str, size: int) -> float:
    """A generous estimate of a sans-serif text's width, to size frames and the picture."""
    return len(text) * size * 0.62


def _wrap(text: str, size: int, width: float, max_lines: int) -> list[str]:
    """`text` cut at spaces into lines that fit `width`; the last line ends with "..." when the
    text does not fit in `max_lines`."""
    lines: list[str] = []
    for word in text.split(" "):
        if lines and _text_width(f"{lines[-1]} {word}", size) <= width:
            lines[-1] = f"{lines[-1]} {word}"
        else:
            lines.append(word)
    if len(lines) > max_lines:
        lines = lines[:max_lines]
        lines[-1] = lines[-1].rstrip(",") + " ..."
    return lines


def _text(x: float, y: float, text: str, size: int = 12, anchor: str = "start", weight: str = "normal") -> str:
    return (f"<text x='{x:.0f}' y='{y:.0f}' {FONT} font-size='{size}' text-anchor='{anchor}' "
            f"font-weight='{weight}'>{escape(text)}</text>")


def _walk_panel(walk: WalkTree, top: float) -> tuple[list[str], float, float]:
    """SVG elements of one walk; returns (elements, height, width)."""
    layout = _Layout()
    num_cols, _ = _place(walk.body, 0, 0, 0, layout)
    parts = [_text(MARGIN, top + 18, f"walk {walk.name}  (partition {walk.partition})", 15, weight="bold")]
    for frame in sorted(layout.frames, key=lambda f: f.depth):
        reach = max((_reach(b, layout) for b in layout.boxes if frame.first_col <= b.col <= frame.last_col),
                    default=0.0)
        parts.extend(_loop_frame(frame, top, reach))
    for box in layout.boxes:
        parts.extend(_call_box(box, layout, top))
    height = TITLE_H + layout.num_rows * ROW_H + 10
    width = 2 * MARGIN + max(1, num_cols) * COL_W
    return parts, height, width


def _loop_frame(frame, top: float, reach: float) -> list[str]:
    """A loop's dashed frame around its calls (`reach`: how far right their drawings go), with its
    bound and flags."""
    pad = 14 - 4 * frame.depth
    x0 = MARGIN + frame.first_col * COL_W - pad
    x1: float = MARGIN + frame.last_col * COL_W + BOX_W + pad
    y0 = top + TITLE_H - pad + 8
    y1 = top + TITLE_H + frame.rows * ROW_H - 12
    loop = frame.loop
    label = f"loop {loop.name} max={loop.max_iters}" + (" stop" if loop.has_stop else "") + (
        " on-device" if loop.is_on_device else "")
    x1 = max(x1, x0 + _text_width(label, 11) + 12, reach + pad)
    return [f"<rect x='{x0:.0f}' y='{y0:.0f}' width='{x1 - x0:.0f}' height='{y1 - y0:.0f}' "
            "fill='none' stroke='#7a5195' stroke-dasharray='6 4' rx='8'/>",
            _text(x0 + 6, y1 - 5, label, 11)]


def _call_box(box, layout, top: float) -> list[str]:
    """A call's box (node, inputs), the edges it lists below itself (to the client, the conductor,
    a stream, a node not drawn) and the arrows to the boxes its other edges reach."""
    x, y = box.x, box.y(top)
    call = box.call
    parts = [f"<rect x='{x:.0f}' y='{y:.0f}' width='{BOX_W}' height='{BOX_H}' rx='6' "
             "fill='#e8f1fa' stroke='#1f4e79'/>",
             _text(x + BOX_W / 2, y + 16, call.node, 13, "middle", "bold")]
    for i, line in enumerate(_wrap(f"({', '.join(call.inputs)})", 9, BOX_W - 8, 2)):
        parts.append(_text(x + BOX_W / 2, y + 29 + i * 11, line, 9, "middle"))
    targets = [(e, _target(layout.boxes, box, e) if e.dest_kind == "node" else None) for e in call.edges]
    listed = _listed_labels(box, layout)
    for row, label in enumerate(listed):
        parts.append(_text(x, y + BOX_H + 14 + row * LINE_H, label, 10))
    listed_width = max((_text_width(label, 10) for label in listed), default=0.0)
    parts.extend(_edge_arrows(x, y, [(e, t) for e, t in targets if t is not None], len(listed), listed_width, top))
    return parts


def _listed_labels(box: _Box, layout: _Layout) -> list[str]:
    """The edges a box lists below itself (those reaching no box drawn: the client, the conductor,
    a stream, a node not drawn), one label each."""
    labels = []
    for edge in box.call.edges:
        if edge.dest_kind == "node" and _target(layout.boxes, box, edge) is not None:
            continue
        dest = {"conductor": "conductor", "client": "client"}.get(edge.dest_kind, edge.dest)
        if edge.dest_kind == "stream":
            dest = f"{edge.dest} (stream to {edge.stream_partition})"
        labels.append(f"-> {edge.name}: {dest}{_flags(edge)}")
    return labels


def _reach(box: _Box, layout: _Layout) -> float:
    """How far right a box's drawing goes: its box, the edges it lists, and room for two loop-backs
    around them (`_edge_arrows`)."""
    widths = [_text_width(label, 10) for label in _listed_labels(box, layout)]
    return box.x + max([BOX_W, *widths]) + 26


def _edge_arrows(x: float, y: float, targets: list, num_listed: int, listed_width: float, top: float) -> list[str]:
    """Arrows from the box at (x, y) to the boxes its edges reach: loop-backs go around the edges
    listed under the box (`listed_width` wide), forward edges are straight with labels stacked per
    target."""
    parts: list[str] = []
    num_curves = 0
    num_forward: dict[int, int] = {}  # target box -> forward edges drawn to it so far
    for edge, target in targets:
        tx, ty = target.x, target.y(top)
        dash = " stroke-dasharray='4 3'" if edge.is_device else ""
        if edge.is_loop_back:
            # From the source's right side out past the edges listed below the box, under them, and
            # into the target's left side (for a self edge: around the box and its list). A curve
            # between the two sides crossed the listed edges' text where it ran past the box.
            sx, sy = x + BOX_W, y + BOX_H * 0.75
            ex, ey = tx, ty + BOX_H * 0.75
            drop = BOX_H * 0.25 + 18 + LINE_H * num_listed + 16 * num_curves
            right = x + max(BOX_W, listed_width) + 10 + 8 * num_curves
            left = ex - 10 - 8 * num_curves
            num_curves += 1
            path = (f"M{sx:.0f},{sy:.0f} H{right:.0f} V{sy + drop:.0f} H{left:.0f} V{ey:.0f} H{ex:.0f}")
            parts.append(f"<path d='{path}' fill='none' stroke='#c0392b'{dash} marker-end='url(#arrow-back)'/>")
            parts.append(_text((sx + ex) / 2, sy + drop + 12, f"{edge.name}{_flags(edge)} (loop-back)", 10,
                               "middle"))
        else:
            index = num_forward.get(id(target), 0)
            num_forward[id(target)] = index + 1
            sx, sy = x + BOX_W, y + BOX_H / 2
            ex, ey = tx, ty + BOX_H / 2
            parts.append(f"<line x1='{sx:.0f}' y1='{sy:.0f}' x2='{ex - 2:.0f}' y2='{ey:.0f}' "
                         f"stroke='#1f4e79'{dash} marker-end='url(#arrow)'/>")
            # labels of several edges to one box stack upwards, one line each
            label_y = (sy + ey) / 2 - 6 - index * 12
            parts.append(_text((sx + ex) / 2, label_y, f"{edge.name}{_flags(edge)}", 10, "middle"))
    return parts


def _legend(spec: ast.Spec, top: float) -> tuple[list[str], float, float]:
    lines = []
    for node in spec.nodes:
        for combine in node.combines:
            extras = []
            if combine.cap is not None:
                extras.append(f"cap {combine.cap}")
            extras += [f"rows {r.walk} <= {r.limit}" for r in combine.rows]
            if combine.attention:
                extras.append(f"attention {combine.attention}")
            if combine.capture is not None:
                extras.append(f"capture {combine.capture.family}")
            lines.append(f"{node.name}: combine {combine.name} = {' + '.join(combine.walks)}"
                         + (f"  ({', '.join(extras)})" if extras else ""))
    if not lines:
        lines.append("(no combined walks)")
    for partition in lower_partitions(spec):
        stages = " -> ".join(stage_text(s) for s in partition.stages)
        streams = "; ".join(f"<- {s.producer_partition}.{s.edge} {policy_text(s.policy)}"
                            for s in partition.streams)
        lines.append(f"partition {partition.name} = {stages} {streams}".rstrip())
    parts = [_text(MARGIN, top + 18, "combined walks and partitions", 15, weight="bold")]
    for i, line in enumerate(lines):
        parts.append(_text(MARGIN, top + TITLE_H + 8 + i * (LINE_H + 3), line, 12))
    width = 2 * MARGIN + max(_text_width(line, 12) for line in lines)
    return parts, TITLE_H + 16 + len(lines) * (LINE_H + 3), width


def walks_svg(spec: ast.Spec) -> str:
    params = ast.values_by_name(spec.params)
    walks = {w.name: w for w in lower_walks(spec, params)}
    parts: list[str] = []
    top, width = 0.0, 600.0
    for walk_decl in spec.walks:  # source order reads better than sorted
        panel, height, panel_width = _walk_panel(walks[walk_decl.name], top)
        parts += panel
        top += height
        width = max(width, panel_width)
    panel, height, panel_width = partitions_panel(spec, top)
    parts += panel
    top += height
    width = max(width, panel_width)
    legend, height, legend_width = _legend(spec, top)
    parts += legend
    top += height
    width = max(width, legend_width)
    head = (
        f"<svg xmlns='http://www.w3.org/2000/svg' width='{width:.0f}' height='{top:.0f}' "
        f"viewBox='0 0 {width:.0f} {top:.0f}'>\n"
        f"<title>{escape(spec.model)} walks</title>\n"
        "<defs><marker id='arrow' markerWidth='10' markerHeight='8' refX='9' refY='4' orient='auto'>"
        "<path d='M0,0 L10,4 L0,8 z' fill='#1f4e79'/></marker>"
        "<marker id='arrow-back' markerWidth='10' markerHeight='8' refX='9' refY='4' orient='auto'>"
        "<path d='M0,0 L10,4 L0,8 z' fill='#c0392b'/></marker>"
        "<marker id='arrow-stream' markerWidth='10' markerHeight='8' refX='9' refY='4' orient='auto'>"
        "<path d='M0,0 L10,4 L0,8 z' fill='#2e7d32'/></marker></defs>\n"
        f"<rect width='100%' height='100%' fill='white'/>\n"
    )
    return head + "\n".join(parts) + "\n</svg>\n"


def draw_walks(spec: ast.Spec, path: Path) -> None:
    make_dirs(path.parent)
    atomic_write_text(path, walks_svg(spec))

