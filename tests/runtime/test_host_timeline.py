"""The host timeline of a lone request's path (`serve/host_timeline.py`): stamps on one object's
calls only, offsets from each window's start as medians, a label's later stamps in a window as
points of their own; and on the CPU torch engine, `mstar bench kv --scenario prefix` reports the
cached requests' path in order, within their TTFT."""
import json
from types import SimpleNamespace

from mstar.runtime.serve import bench_kv
from mstar.runtime.serve.host_timeline import HostTimeline, watch_lone_path


class Ticking:
    """A clock the test moves by hand."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class Worker:
    def __init__(self, clock: Ticking, cost: float) -> None:
        self.clock, self.cost = clock, cost

    def run(self, value: int) -> int:
        self.clock.now += self.cost
        return value + 1


def test_a_watched_call_is_stamped_on_entry_or_return_on_that_object_alone():
    clock = Ticking()
    timeline = HostTimeline(clock)
    watched, other = Worker(clock, 0.001), Worker(clock, 0.001)
    timeline.watch(watched, "run", "entered")
    timeline.watch(watched, "run", "returned", on_return=True)
    assert watched.run(1) == 2 and other.run(1) == 2
    # the entry before the call's 1 ms, the return after it; the other worker's call not stamped
    assert timeline.stamps == [(0.0, "entered"), (0.001, "returned")]


def test_offsets_are_medians_from_each_window_start_with_repeats_numbered():
    clock = Ticking()
    timeline = HostTimeline(clock)
    # three windows of 10 ms; "launch" twice in each, "rare" in one only (under half: dropped)
    for start, (first, second) in zip((0.0, 1.0, 2.0), ((0.002, 0.006), (0.003, 0.007), (0.004, 0.005))):
        timeline.stamps += [(start + first, "launch"), (start + second, "launch")]
    timeline.stamps.append((2.009, "rare"))
    timeline.stamps.append((5.0, "launch"))  # outside every window
    points = timeline.offsets_ms([(0.0, 0.010), (1.0, 1.010), (2.0, 2.008)])
    assert [p for p, _ in points] == ["launch", "launch #2", "first token"]
    values = dict(points)
    assert abs(values["launch"] - 3.0) < 1e-9 and abs(values["launch #2"] - 6.0) < 1e-9
    assert abs(values["first token"] - 10.0) < 1e-9


def test_bench_kv_reports_a_cached_requests_host_path_on_the_cpu_torch_engine(capsys):
    assert bench_kv.main(["--engine", "torch", "--scenario", "prefix", "--prefix-requests", "3",
                          "--prefix-len", "64", "--prefix-rounds", "1", "--json"]) == 0
    prefix = json.loads(capsys.readouterr().out)["prefix"]
    points = dict(prefix["cached_host_timeline_ms"])
    order = ["admitted", "step built", "engine launch", "waiting for the device", "tokens back", "first token"]
    assert all(point in points for point in order), points
    assert [points[p] for p in order] == sorted(points[p] for p in order)
    assert points["admitted"] >= 0


def test_the_lone_path_watches_a_fast_path_executors_glue_packer():
    class Calls:
        def __init__(self, *names: str) -> None:
            for name in names:
                setattr(self, name, lambda *args, **kwargs: None)

    clock = Ticking()
    packer = Calls("host_step", "launch")
    executor = Calls("launch", "_stage", "_mark_replay")
    executor.packer = packer
    engine = Calls("launch", "wait")
    engine.runners = {"LLM": SimpleNamespace(executor=executor)}
    driver = Calls("_postprocess")
    driver.clock, driver.conductor = clock, Calls("submit", "build_step")
    timeline = watch_lone_path(driver, engine)
    for label, call in (("glue host step", packer.host_step), ("glue launch", packer.launch),
                        ("replay", executor._mark_replay)):
        clock.now += 0.001
        call()
        assert timeline.stamps[-1] == (clock.now, label)
