"""The driver's collector policy (serve/collector.py): Python's automatic passes are off during a
run and the due pass runs where the loop waits for the device; cyclic garbage made during the run
is still collected, the collector is on again after it, and a process that had it off keeps it off."""
import gc
import weakref

from mstar.plan.io import load_plan
from mstar.runtime.conductor.request import Request
from mstar.runtime.engine.sim import SimEngine
from mstar.runtime.serve.collector import PassesWhenBusy
from mstar.runtime.serve.driver import Driver
from mstar.runtime.serve.workload import Workload


class _Cycle:
    pass


def _run_making_cycles(num_requests: int = 8) -> tuple[Driver, list, list]:
    """A sim run of llama's plan whose every step leaves one garbage reference cycle; returns the
    driver, weak references to the cycles, and the automatic passes seen while the loop ran."""
    plan = load_plan("generated/llama.plan")
    driver = Driver(plan, SimEngine(plan))
    cycles: list = []
    passes: list = []

    def on_step(_launch) -> None:
        cycle = _Cycle()
        cycle.me = cycle
        cycles.append(weakref.ref(cycle))
        for _ in range(800):  # enough container allocations to make a young pass due every step
            kept.append([])
        passes.append(gc.isenabled())

    kept: list = []
    driver.on_step = on_step
    requests = [Request(id=f"r{i}", prompt_tokens=[1 + i, 2, 3], max_tokens=12) for i in range(num_requests)]
    driver.run(Workload(requests))
    return driver, cycles, passes


def test_automatic_passes_are_off_during_the_run_and_garbage_is_still_collected():
    assert gc.isenabled()
    driver, cycles, enabled_during = _run_making_cycles()
    assert enabled_during and not any(enabled_during)  # the loop ran with automatic passes off
    assert gc.isenabled()  # and on again after it
    assert all(r.finish_reason in ("stop", "length", "done") for r in driver.conductor.records.values())
    collected = sum(ref() is None for ref in cycles)
    assert collected >= len(cycles) - 2, (collected, len(cycles))  # the due passes ran inside the loop
    # the passes' host time is in the step log, each pass with the step logged after it
    log = driver.log
    assert len(log.gc_s) == len(log.launch_s) == len(log.wait_s) == len(log)
    assert sum(log.gc_s) > 0 and min(log.gc_s) >= 0 and sum(1 for s in log.gc_s if s > 0) >= len(cycles) // 2
    assert min(log.launch_s) >= 0 and min(log.wait_s) >= 0


def test_a_process_with_the_collector_off_keeps_it_off():
    gc.disable()
    try:
        _, cycles, enabled_during = _run_making_cycles(2)
        assert not gc.isenabled() and not any(enabled_during)
        assert all(ref() is not None for ref in cycles)  # nothing collected for it
    finally:
        gc.enable()
        gc.collect()


def _passes(policy: PassesWhenBusy, num: int, kept: list) -> list[int]:
    """Keep enough new containers to make a young pass due, `num` times; the generations collected."""
    generations = []
    for _ in range(num):
        kept.extend([] for _ in range(gc.get_threshold()[0] + 1))
        generations.append(policy.collect_if_due())
    return generations


def test_a_full_pass_waits_until_a_quarter_more_objects_reached_the_oldest_generation():
    policy = PassesWhenBusy()
    with policy:
        gc.collect()
        policy.long_lived = len(gc.get_objects(generation=2)) + 10 ** 6  # as if a million survived the last
        kept: list = []
        generations = _passes(policy, 130, kept)
        assert 2 not in generations and 1 in generations  # the middle generation's pass instead
        policy.long_lived = 0  # nothing survived the last full pass: the next due one runs
        assert 2 in _passes(policy, 130, kept)


def test_the_due_generation_follows_pythons_thresholds():
    policy = PassesWhenBusy()
    with policy:
        gc.collect()  # counts from zero
        assert policy.collect_if_due() == -1  # nothing allocated: no pass
        generations = []
        kept = []
        for _ in range(12):
            kept.extend([] for _ in range(gc.get_threshold()[0] + 1))
            generations.append(policy.collect_if_due())
        # ten young passes, then the middle generation once its count passed its threshold
        assert generations[:10] == [0] * 10 and 1 in generations[10:]
    assert gc.isenabled()


def test_bench_kv_automatic_gc_leaves_pythons_passes_on_during_the_run(monkeypatch):
    """`mstar bench kv --automatic-gc`: the what-if run keeps Python's automatic passes on."""
    from mstar.runtime.serve import bench_kv

    seen: list = []
    real_run = Driver.run

    def run(self, workload):
        seen.append(type(self.collector).__name__)
        return real_run(self, workload)

    monkeypatch.setattr(Driver, "run", run)
    plan = load_plan("generated/llama_chunked.plan")
    requests = [Request(id="a", prompt_tokens=[1, 2, 3], max_tokens=3)]
    bench_kv._run(plan, bench_kv.EngineChoice("sim", is_gc_deferred=False), requests)
    bench_kv._run(plan, bench_kv.EngineChoice("sim"), requests)
    assert seen == ["AutomaticPasses", "PassesWhenBusy"]


def test_refreeze_frees_old_garbage_and_freezes_what_lives():
    """What a process that builds another engine calls before its run (collector.refreeze): cyclic
    garbage left from before is collected, even garbage that an earlier freeze held, and what is
    still referenced leaves the young generations."""
    from mstar.runtime.serve.collector import refreeze

    held_garbage = _Cycle()
    held_garbage.me = held_garbage
    held_ref = weakref.ref(held_garbage)
    gc.freeze()  # as the driver's first run freezes what exists
    del held_garbage  # garbage now, but frozen: no pass sees it
    gc.collect()
    assert held_ref() is not None
    live = [_Cycle() for _ in range(100)]
    try:
        refreeze()
        assert held_ref() is None  # the frozen garbage went back to the collector and was freed
        young = {id(o) for o in gc.get_objects(0) + gc.get_objects(1) + gc.get_objects(2)}
        assert not any(id(o) in young for o in live)  # the live objects are frozen
        assert gc.get_freeze_count() > 0
    finally:
        gc.unfreeze()


def test_a_process_that_froze_its_start_up_exits_without_leak_reports():
    """The start-up freeze is undone at exit: objects the interpreter's last collection skipped
    made Triton's bindings print a leak report of some hundred lines at the exit of every command."""
    import subprocess
    import sys

    child = ("import triton, triton.language\n"
             "from mstar.runtime.serve import driver\n"
             "driver.freeze_start_up()\n")
    done = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "leaked" not in done.stderr
