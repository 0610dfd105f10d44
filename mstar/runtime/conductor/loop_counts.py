"""Per-request loop counts: which a plan accepts, checked when a request is admitted.

In: a `Plan` (its loops' `count_param` and `max_iters`). Out: `LoopCounts(plan).problem(counts)`
-> None when a request's `loop_counts` ({param: iterations}) fit, else a message saying which
count is unknown or out of range, or that they are not such a dict. A loop with `count=PARAM` runs
the request's count of that name (default: the param's value in the plan), so every such count must
be 1..max_iters of each loop that reads it; a name no loop reads is refused rather than ignored (a
misspelt name would else run the default silently). The request's names and counts are echoed
clipped (`shown`: a 10,000-character name was echoed whole).
"""
from __future__ import annotations

import difflib
from typing import Optional

from mstar.arg_types import shown
from mstar.plan.schema import Plan


class LoopCounts:
    def __init__(self, plan: Plan):
        # param -> (the smallest max_iters among loops reading it, one such loop's walk/name)
        self.bounds: dict[str, tuple[int, str]] = {}
        for walk in plan.walks:
            for loop in walk.loops:
                if loop.count_param is None:
                    continue
                bound = self.bounds.get(loop.count_param)
                if bound is None or loop.max_iters < bound[0]:
                    self.bounds[loop.count_param] = (loop.max_iters, f"{walk.name}/{loop.name}")

    def problem(self, counts: dict[str, int]) -> Optional[str]:
        if not isinstance(counts, dict):  # (a hand-built Request's `None` failed the run loop, every request)
            return (f"loop_counts must map a loop's count param to its iterations ({{'steps': 4}}; {{}} for the "
                    f"defaults), got {shown(counts)}")
        for name, value in counts.items():
            bound = self.bounds.get(name) if isinstance(name, str) else None
            if bound is None:
                close = difflib.get_close_matches(name, list(self.bounds), n=1) if isinstance(name, str) else []
                hint = f"; did you mean {close[0]!r}?" if close else ""
                known = ", ".join(sorted(self.bounds)) or "none"
                return f"loop_counts names {shown(name)}, which no loop of this plan counts by (counts: {known}){hint}"
            if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= bound[0]:
                return (f"loop_counts {name}={shown(value)} is outside 1..{bound[0]}, the most iterations loop "
                        f"{bound[1]} may run")
        return None
