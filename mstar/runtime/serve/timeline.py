"""`--timeline FILE.png`: step composition and latency over the run, drawn with matplotlib (Agg).

Top: rows per step over time, for each scheduling key its steps' mean rows by walk, the keys'
stacked (a step counts in every time bin it overlaps; TP follower copies left out). Each key's mean
is over its own steps: averaged over every step in a bin, a 27-row decode step beside a 3-row codec
step read as 13.5 + 1.5 rows, a step that never ran.
Bottom: each request's TTFT (at its first token) and the mean inter-token gap (at its finish).
The x axis is seconds since the run started (`origin_s`, the run clock at the start: 0 under the
simulated engine, a monotonic reading under a real one).
"""
from __future__ import annotations

import io
import os
from typing import Any, Optional

from mstar.runtime.serve.metrics import StepLog
from mstar.runtime.serve.results import write_output_file

NUM_BINS = 150


NEEDS_LATEX = {"pgf"}


def format_problem(path: str) -> Optional[str]:
    """Why matplotlib cannot write `path` (its suffix names no image format it knows), else None;
    checked before the run so a typo costs no run time. No suffix writes a PNG."""
    suffix = os.path.splitext(path)[1][1:].lower()
    if not suffix:
        return None
    from matplotlib.backend_bases import FigureCanvasBase

    # matplotlib writes .pgf through an installed LaTeX (xelatex): it failed after the whole run
    formats = set(FigureCanvasBase.get_supported_filetypes()) - NEEDS_LATEX
    if suffix in formats:
        return None
    # (.png first, then the others: the list named .png twice)
    return f"cannot draw a .{suffix} file; name it .png (or .{', .'.join(sorted(formats - {'png'}))})"


def draw(log: StepLog, records: list[Any], path: str, origin_s: float = 0.0) -> None:
    """Write the PNG to `path` (replaced atomically: see results.write_output_file, whose
    OutputError names the file); times on the run clock are drawn as seconds since `origin_s`."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (top, bottom) = plt.subplots(2, 1, figsize=(13, 7), sharex=True)
    # (a step whose every row was short of memory ran none: it pulled its key's mean rows down)
    steps = [(start - origin_s, end - origin_s, key, rows)
             for start, end, key, rows, follows in zip(log.start_s, log.end_s, log.key, log.walk_rows, log.is_follower)
             if not follows and rows]
    series = sorted({(key, walk) for _, _, key, rows in steps for walk in rows})
    if series:
        edges, means = _binned(steps, series)
        # each bin's value over its whole width, the last one's too (step="mid" over bin centres
        # dropped half a bin at each end, and a run of one step drew nothing)
        top.stackplot(edges, [means[one] + means[one][-1:] for one in series],
                      labels=[f"{walk} ({key})" for key, walk in series], step="post")
        _legend_beside(top)
    top.set_ylabel("rows per step")
    top.set_title("step composition (each key's mean rows per step by walk, over time bins; keys stacked)")
    # finished requests only, as the report's figures and outputs.jsonl (an interrupted run drew the
    # TTFT of requests neither holds)
    ttft = [(r.first_token_s - origin_s, (r.first_token_s - r.arrival_s) * 1000.0)
            for r in records if r.is_finished and r.first_token_s is not None]
    itl = []
    for record in records:
        times_s = record.token_times_s
        if len(times_s) > 1 and record.finish_s is not None:
            itl.append((record.finish_s - origin_s, (times_s[-1] - times_s[0]) / (len(times_s) - 1) * 1000.0))
    if ttft:
        bottom.scatter(*zip(*ttft), s=6, label="TTFT (at first token)")
    if itl:
        bottom.scatter(*zip(*itl), s=6, label="mean inter-token (at finish)")
    bottom.set_xlabel("seconds since the run started")
    bottom.set_ylabel("ms")
    bottom.set_title("latency")
    if ttft or itl:
        _legend_beside(bottom)
    figure.tight_layout()
    # no suffix: a PNG at exactly `path` (matplotlib would otherwise write `path`.png)
    buffer = io.BytesIO()
    figure.savefig(buffer, dpi=100, format=os.path.splitext(path)[1][1:].lower() or "png")
    plt.close(figure)
    write_output_file(path, buffer.getvalue())


def _legend_beside(axes: Any) -> None:
    """The legend to the right of the axes, one entry a line: inside them (upper right, in up to
    four columns) it ran off the figure's left edge with six series and covered the latest points."""
    axes.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize="small", borderaxespad=0.0)


def _binned(steps: list[tuple[float, float, str, dict[str, int]]], series: list[tuple[str, str]]
            ) -> tuple[list[float], dict[tuple[str, str], list[float]]]:
    """The edges of up to NUM_BINS equal time bins from the first step's start to the last step's
    end, and for each (key, walk) of `series` per bin the walk's mean rows over the key's steps that
    overlap the bin (0 where none does)."""
    start = min(begin for begin, _, _, _ in steps)
    end = max(finish for _, finish, _, _ in steps)
    num_bins = min(NUM_BINS, len(steps))
    width = max((end - start) / num_bins, 1e-9)
    sums = {one: [0.0] * num_bins for one in series}
    counts: dict[str, list[int]] = {key: [0] * num_bins for key, _ in series}
    for begin, finish, key, rows in steps:
        first = min(int((begin - start) / width), num_bins - 1)
        last = min(int((finish - start) / width), num_bins - 1)
        for index in range(first, last + 1):
            counts[key][index] += 1
            for walk, num in rows.items():
                sums[key, walk][index] += num
    edges = [start + i * width for i in range(num_bins + 1)]
    means = {(key, walk): [total / count if count else 0.0 for total, count in zip(sums[key, walk], counts[key])]
             for key, walk in series}
    return edges, means
