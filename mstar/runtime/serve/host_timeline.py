"""Where a lone request's time to first token goes on the host: timestamps of the calls on its path.

A request that arrives alone waits for nothing but the host's Python and one device step, in
series: its admission, the scheduler's step, the runner, the executor's packing and staging, the
replay, the device, then the wait's return and post-processing. A profiler slows every call (a
wrapper a call adds about 1 us, and a cached request's admission walks 65 pages), so the figure
moves with the instrument. Here only a handful of calls are stamped, each once a step, on entry, on
the run's own clock: each watched object's bound method is replaced on that object alone (no class
is patched, no other engine or run is slowed).

In: `HostTimeline(clock)`, `watch_lone_path(driver, engine)` before the run. Out: `offsets_ms(windows)`,
per point the median offset (ms) from each window's start, a window being a request's arrival and
its first token (`mstar bench kv --scenario prefix`: the cached requests, in a run of their own).
"""
from __future__ import annotations

import statistics
from collections import Counter, defaultdict
from typing import Any, Callable

# (method, the point's label, stamped on its return rather than its entry), in the order a step
# passes them; the admission is stamped on its return, since the request's arrival is stamped inside it
CONDUCTOR_POINTS = (("submit", "admitted", True), ("build_step", "step built", False))
ENGINE_POINTS = (("launch", "engine launch", False), ("wait", "waiting for the device", False))
EXECUTOR_POINTS = (("launch", "executor launch", False), ("_stage", "inputs staged", False),
                   ("_mark_replay", "replay", False))
# the generated glue's packer of an executor that has one (`gpu/glue_packing.py`): its host array,
# then its kernel's launch (entered after the staged copy)
PACKER_POINTS = (("host_step", "glue host step", False), ("launch", "glue launch", False))
DRIVER_POINTS = (("_postprocess", "tokens back", False),)


class HostTimeline:
    def __init__(self, clock: Callable[[], float]) -> None:
        self.clock = clock
        self.stamps: list[tuple[float, str]] = []

    def watch(self, target: Any, method: str, label: str, on_return: bool = False) -> None:
        """Stamp `label` each time `target.method` is entered, or returns (on this object only)."""
        bound = getattr(target, method)
        stamps, clock = self.stamps, self.clock

        def stamped(*args: Any, **kwargs: Any) -> Any:
            if on_return:
                result = bound(*args, **kwargs)
                stamps.append((clock(), label))
                return result
            stamps.append((clock(), label))
            return bound(*args, **kwargs)

        setattr(target, method, stamped)

    def offsets_ms(self, windows: list[tuple[float, float]]) -> list[tuple[str, float]]:
        """Per point (a label's k-th stamp inside a window, "label" or "label #k" from the second)
        seen in at least half the windows: its median ms after the window's start, ordered by
        those medians; the windows' end ("first token") last."""
        offsets: dict[str, list[float]] = defaultdict(list)
        for start, end in windows:
            seen: Counter = Counter()
            for when, label in self.stamps:
                if start <= when <= end:
                    seen[label] += 1
                    point = label if seen[label] == 1 else f"{label} #{seen[label]}"
                    offsets[point].append((when - start) * 1e3)
        points = [(point, round(statistics.median(values), 3)) for point, values in offsets.items()
                  if 2 * len(values) >= len(windows)]
        points.sort(key=lambda point: point[1])
        if windows:
            points.append(("first token", round(statistics.median((end - start) * 1e3 for start, end in windows), 3)))
        return points


def watch_lone_path(driver: Any, engine: Any) -> HostTimeline:
    """A timeline on the driver's clock over its conductor, the engine, each of the engine's
    device fast-path executors (`gpu/executor.py`'s `StepExecutor`) and their glue packers, and the
    driver's post-processing."""
    timeline = HostTimeline(driver.clock)
    watched = [(driver.conductor, CONDUCTOR_POINTS), (engine, ENGINE_POINTS), (driver, DRIVER_POINTS)]
    for runner in getattr(engine, "runners", {}).values():
        executor = getattr(runner, "executor", None)
        if executor is not None and all(callable(getattr(executor, point[0], None)) for point in EXECUTOR_POINTS):
            watched.append((executor, EXECUTOR_POINTS))
            packer = getattr(executor, "packer", None)
            if packer is not None and all(callable(getattr(packer, point[0], None)) for point in PACKER_POINTS):
                watched.append((packer, PACKER_POINTS))
    for target, points in watched:
        for method, label, on_return in points:
            timeline.watch(target, method, label, on_return)
    return timeline
