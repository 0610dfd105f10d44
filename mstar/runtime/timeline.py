"""`--timeline FILE.png`: step composition and latency over the run, drawn with matplotlib (Agg).

Top: rows per step over time, stacked by walk (one point per non-follower step, at its start).
Bottom: each request's TTFT (at its first token) and the mean inter-token gap (at its finish).
"""
from __future__ import annotations

from typing import Any

from mstar.runtime.metrics import StepLog


def draw(log: StepLog, records: list[Any], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    walks = sorted({walk for rows in log.walk_rows for walk in rows})
    figure, (top, bottom) = plt.subplots(2, 1, figsize=(11, 7), sharex=True)
    times = [t for t, f in zip(log.start_s, log.is_follower) if not f]
    base = [0] * len(times)
    for walk in walks:
        counts = [rows.get(walk, 0) for rows, f in zip(log.walk_rows, log.is_follower) if not f]
        top.bar(times, counts, bottom=base, width=_bar_width(times), label=walk, align="edge")
        base = [b + c for b, c in zip(base, counts)]
    top.set_ylabel("rows per step")
    top.set_title("step composition")
    if walks:
        top.legend(loc="upper right", fontsize="small", ncol=min(len(walks), 4))
    ttft = [(r.first_token_s, (r.first_token_s - r.arrival_s) * 1000.0) for r in records if r.first_token_s is not None]
    itl = []
    for record in records:
        times_s = record.token_times_s
        if len(times_s) > 1 and record.finish_s is not None:
            itl.append((record.finish_s, (times_s[-1] - times_s[0]) / (len(times_s) - 1) * 1000.0))
    if ttft:
        bottom.scatter(*zip(*ttft), s=6, label="TTFT (at first token)")
    if itl:
        bottom.scatter(*zip(*itl), s=6, label="mean inter-token (at finish)")
    bottom.set_xlabel("run time (s)")
    bottom.set_ylabel("ms")
    bottom.set_title("latency")
    if ttft or itl:
        bottom.legend(loc="upper right", fontsize="small")
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)


def _bar_width(times: list[float]) -> float:
    if len(times) < 2:
        return 0.001
    return max((times[-1] - times[0]) / len(times), 1e-6)
