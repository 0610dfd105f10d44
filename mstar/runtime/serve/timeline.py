"""`--timeline FILE.png`: step composition and latency over the run, drawn with matplotlib (Agg).

Top: mean rows per step over time, stacked by walk (steps binned by start time; TP follower
copies left out).
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
    return f"cannot draw a .{suffix} file; name it .png (or .{', .'.join(sorted(formats))})"


def draw(log: StepLog, records: list[Any], path: str, origin_s: float = 0.0) -> None:
    """Write the PNG to `path` (replaced atomically: see results.write_output_file, whose
    OutputError names the file); times on the run clock are drawn as seconds since `origin_s`."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    walks = sorted({walk for rows in log.walk_rows for walk in rows})
    figure, (top, bottom) = plt.subplots(2, 1, figsize=(11, 7), sharex=True)
    steps = [(t - origin_s, rows) for t, rows, f in zip(log.start_s, log.walk_rows, log.is_follower) if not f]
    if steps and walks:
        centers, means = _binned(steps, walks)
        top.stackplot(centers, [means[walk] for walk in walks], labels=walks, step="mid")
        top.legend(loc="upper right", fontsize="small", ncol=min(len(walks), 4))
    top.set_ylabel("mean rows per step")
    top.set_title("step composition (rows per walk, averaged over time bins)")
    ttft = [(r.first_token_s - origin_s, (r.first_token_s - r.arrival_s) * 1000.0)
            for r in records if r.first_token_s is not None]
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
        bottom.legend(loc="upper right", fontsize="small")
    figure.tight_layout()
    # no suffix: a PNG at exactly `path` (matplotlib would otherwise write `path`.png)
    buffer = io.BytesIO()
    figure.savefig(buffer, dpi=100, format=os.path.splitext(path)[1][1:].lower() or "png")
    plt.close(figure)
    write_output_file(path, buffer.getvalue())


def _binned(steps: list[tuple[float, dict[str, int]]], walks: list[str]) -> tuple[list[float], dict[str, list[float]]]:
    """Mean rows of each walk per step, in up to NUM_BINS equal time bins (empty bins: 0)."""
    start, end = steps[0][0], max(t for t, _ in steps)
    num_bins = min(NUM_BINS, len(steps))
    width = max((end - start) / num_bins, 1e-9)
    sums = {walk: [0.0] * num_bins for walk in walks}
    counts = [0] * num_bins
    for t, rows in steps:
        index = min(int((t - start) / width), num_bins - 1)
        counts[index] += 1
        for walk, num in rows.items():
            sums[walk][index] += num
    centers = [start + (i + 0.5) * width for i in range(num_bins)]
    means = {walk: [s / c if c else 0.0 for s, c in zip(sums[walk], counts)] for walk in walks}
    return centers, means
