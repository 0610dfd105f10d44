"""Python's cyclic collector during a run: its passes moved to where the device is busy.

Python starts a collection pass whenever enough container objects were allocated since the last
one (`gc.get_threshold()`), so in a run loop a pass lands at an arbitrary point, often while the
host prepares the next step and the device waits for it. Under `mstar run` on the H200 (64
concurrent, Llama-3.2-1B shape) the process ran 407 young passes, 36 middle ones (up to 3.5 ms
each) and 4 full ones; a pass longer than the work the host has queued ahead is device idle time.

`PassesWhenBusy` turns the automatic passes off for the run and `collect_if_due()` runs the pass
Python would have run by then: the same thresholds, the oldest generation whose count is past its
threshold, and for a full pass Python's own extra condition (gcmodule.c): the objects that reached
the oldest generation since the last full pass must be at least a quarter of those that survived
it (counted here with `gc.get_objects(2)`, which leaves out what start-up froze), else the middle
generation's pass runs. The run loop calls it right before it waits for a step in flight (the
device then holds that step and any launched ahead of it, so the pass overlaps device work) and
before it sleeps. A process that had the collector off keeps it off: nothing is collected then.
"""
from __future__ import annotations

import gc
from typing import Any


def refreeze() -> None:
    """For a process that builds another engine after its first run (the benchmarks run each
    workload on a fresh engine): the driver moves what exists at its first run out of the
    collector's reach once a process (`driver.freeze_start_up`), so a later engine's objects
    (thousands of tensors, graphs, wrappers, its request tables) stay in the young generations,
    where the run's middle passes scan them: on the H200 one such pass took 2.66 ms in the
    middle of `mstar bench kv`'s chunk scenario and set its inter-token p99 (docs/runtime.md),
    a cost a process of one engine (`mstar run`, `mstar serve`) does not pay. This does for the
    new engine what the first run did: the earlier engines' objects go back to the collector,
    which frees what nothing holds any more, and the rest is frozen again."""
    gc.unfreeze()
    gc.collect()
    gc.freeze()


class PassesWhenBusy:
    def __init__(self) -> None:
        self.is_active = False
        self.long_lived = 0  # objects of the oldest generation after its last full pass

    def __enter__(self) -> "PassesWhenBusy":
        self.is_active = gc.isenabled()
        gc.disable()
        self.long_lived = len(gc.get_objects(generation=2))
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.is_active:
            gc.enable()
        self.is_active = False

    def collect_if_due(self) -> int:
        """Run the pass that is due, if any; returns its generation, or -1 when none was due."""
        if not self.is_active:
            return -1
        counts, thresholds = gc.get_count(), gc.get_threshold()
        if thresholds[0] == 0 or counts[0] <= thresholds[0]:
            return -1
        generation = 1 if counts[1] > thresholds[1] else 0
        if counts[2] > thresholds[2] and self._full_pass_pays():
            generation = 2
        gc.collect(generation)
        if generation == 2:
            self.long_lived = len(gc.get_objects(generation=2))
        return generation

    def _full_pass_pays(self) -> bool:
        """Python's condition on a full pass: what reached the oldest generation since the last
        one is at least a quarter of what survived it."""
        return len(gc.get_objects(generation=2)) - self.long_lived >= self.long_lived // 4


class AutomaticPasses:
    """Python's own automatic passes, left where they fall: the what-if of `mstar bench kv
    --automatic-gc` (the same interface as `PassesWhenBusy`)."""

    def __enter__(self) -> "AutomaticPasses":
        return self

    def __exit__(self, *exc: Any) -> None:
        pass

    def collect_if_due(self) -> int:
        return -1
