"""Faults of an engine fail the requests they touch, never the run: found by a fault-injection
audit (each case stopped `Driver.run` for every request, or held a caller for ever).

- `end_request` raising for one request (its output was lost, the queued requests never ran, the
  Python API closed for good);
- a step whose results the conductor cannot apply (a stop row past the step's rows);
- a tensor-parallel follower's copy of a step failing (the leader's failure already failed alone);
- `LLM.close(timeout)` while a step does not return (it waited for the step);
- a result for a request the step did not hold (that request was failed for the engine's mistake);
- an exception without a message (the reason said nothing after "engine failed the step: ");
- a second Ctrl-C while `mstar run` tears its engine down after reporting (it said "before the run
  started; nothing was written")."""
from __future__ import annotations

import dataclasses
import threading
import time
from pathlib import Path
from typing import Any, Callable, Optional

from mstar.cli.mstar import _Signals
from mstar.plan.io import load_plan
from mstar.runtime.conductor.request import Request
from mstar.runtime.engine.sim import SimEngine
from mstar.runtime.serve.api import LLM, SamplingParams
from mstar.runtime.serve.driver import Driver
from mstar.runtime.serve.workload import Workload

ROOT = Path(__file__).resolve().parents[2]


class Faulty:
    """An engine whose launch, wait and end_request can be made to fail (hooks raise or rewrite)."""

    def __init__(self, inner: Any, on_launch: Optional[Callable] = None, on_result: Optional[Callable] = None,
                 on_end: Optional[Callable] = None):
        self.inner, self.caps = inner, inner.caps
        self.on_launch, self.on_result, self.on_end = on_launch, on_result, on_end
        self.num_launches = 0

    def add_request(self, request_id: str, spec: Any) -> Any:
        return self.inner.add_request(request_id, spec)

    def end_request(self, request_id: str) -> None:
        self.inner.end_request(request_id)  # freed first: a raising release still frees, as most would
        if self.on_end is not None:
            self.on_end(request_id)

    def end_node(self, request_id: str, node: str) -> None:
        self.inner.end_node(request_id, node)

    def claim_prefix(self, request_id: str, node: str, tokens: list[int]) -> int:
        return self.inner.claim_prefix(request_id, node, tokens)

    def kv_pages(self) -> dict:
        return self.inner.kv_pages()

    def launch(self, step: Any) -> Any:
        self.num_launches += 1
        if self.on_launch is not None:
            self.on_launch(step, self.num_launches)
        return step, self.inner.launch(step)

    def wait(self, handle: Any) -> Any:
        step, inner = handle
        result = self.inner.wait(inner)
        return self.on_result(step, result) if self.on_result is not None else result


def _requests(num: int, max_tokens: int = 12) -> list[Request]:
    return [Request(id=f"r{i}", prompt_tokens=[1 + i, 2, 3, 4], max_tokens=max_tokens) for i in range(num)]


def _run(plan_name: str, engine: Any, requests: list[Request]) -> tuple[Driver, list[str]]:
    """The run's driver and every id on_finish reported, in order; the run must return."""
    plan = load_plan(ROOT / "generated" / f"{plan_name}.plan")
    finished: list[str] = []
    driver = Driver(plan, engine, on_finish=finished.extend)
    driver.run(Workload(requests, closed_concurrency=2))
    return driver, finished


def test_end_request_raising_for_one_request_fails_nothing_else():
    def on_end(request_id: str) -> None:
        if request_id == "r2":
            raise RuntimeError("end boom")

    plan = load_plan(ROOT / "generated" / "llama.plan")
    engine = Faulty(SimEngine(plan), on_end=on_end)
    requests = _requests(6)
    driver, finished = _run("llama", engine, requests)
    assert sorted(finished) == sorted(r.id for r in requests)  # each reported once, r2's output kept
    assert {driver.conductor.records[r.id].finish_reason for r in requests} == {"length"}
    assert all(in_use == 0 for in_use, _ in engine.kv_pages().values())


def test_a_result_the_conductor_cannot_apply_fails_that_steps_requests_alone():
    def bad_stop_row(step: Any, result: Any) -> Any:
        if any(row.request_id == "r0" for row in step.rows) and result.token_ids is not None:
            return dataclasses.replace(result, stop_rows=[len(step.rows) + 5])
        return result

    plan = load_plan(ROOT / "generated" / "llama.plan")
    engine = Faulty(SimEngine(plan), on_result=bad_stop_row)
    requests = _requests(4)
    driver, finished = _run("llama", engine, requests)
    assert sorted(finished) == sorted(r.id for r in requests)
    reasons = {r.id: driver.conductor.records[r.id].finish_reason for r in requests}
    assert "could not be applied" in reasons["r0"] and "IndexError" in reasons["r0"]
    assert reasons["r2"] == reasons["r3"] == "length"  # later requests ran as ever


def test_a_followers_failed_step_fails_its_requests_alone():
    plan = load_plan(ROOT / "generated" / "orpheus_tp2.plan")
    hit: dict[str, int] = {}

    def on_launch(step: Any, num: int) -> None:
        if not hit and not step.rows and num > 6:  # a follower's row-less copy of its leader's step
            hit["at"] = num
            raise RuntimeError("follower boom")

    engine = Faulty(SimEngine(plan), on_launch=on_launch)
    requests = _requests(4, max_tokens=40)
    driver, finished = _run("orpheus_tp2", engine, requests)
    assert hit and sorted(finished) == sorted(r.id for r in requests)
    reasons = [driver.conductor.records[r.id].finish_reason for r in requests]
    assert any("on rank" in reason and "follower boom" in reason for reason in reasons)
    assert any(not reason.startswith("error") for reason in reasons)  # the others went on


def test_an_exception_without_a_message_is_named():
    def on_launch(step: Any, num: int) -> None:
        if num >= 3 and any(row.request_id == "r0" for row in step.rows):  # r0's step run alone raises too
            raise RuntimeError()

    plan = load_plan(ROOT / "generated" / "llama.plan")
    driver, _ = _run("llama", Faulty(SimEngine(plan), on_launch=on_launch), _requests(2))
    reasons = [record.finish_reason for record in driver.conductor.records.values()]
    assert "error: engine failed the step: RuntimeError" in reasons


def test_close_returns_while_a_step_does_not():
    from mstar.runtime.serve.engine_setup import build_engine, load

    release = threading.Event()
    plan = load(str(ROOT / "generated" / "llama.plan"))

    def hang(step: Any, num: int) -> None:
        if num == 3:
            release.wait(30)

    llm = LLM(plan, engine=Faulty(build_engine(plan, "sim", sim_pace=0), on_launch=hang))
    answers: list = []
    caller = threading.Thread(target=lambda: answers.extend(llm.generate([[1, 2, 3]], SamplingParams(max_tokens=50))))
    caller.start()
    time.sleep(0.3)  # the run loop is inside step 3 now
    started = time.monotonic()
    llm.close(0.2)
    took = time.monotonic() - started
    caller.join(10)
    release.set()
    assert took < 5  # it waited for the step before (30 s here)
    assert len(answers) == 1 and answers[0].finish_reason.startswith("error: the LLM stopped")


def test_a_signal_after_the_run_is_reported_changes_nothing():
    signals = _Signals()
    signals.is_reported = True
    signals._handle(2, None)  # raised _Interrupted: "before the run started; nothing was written"
    assert signals.signum is None


def test_a_result_for_a_request_outside_the_step_is_ignored():
    """One KV page: r0 runs while r1 waits, held out of memory (active, in no step). r0's steps also
    answer for r1: r1 runs on as ever (it failed). A second answer for a row is ignored too."""
    def foreign_then_twice(step: Any, result: Any) -> Any:
        ids = [row.request_id for row in step.rows]
        if ids == ["r0"] and result.rows:
            foreign = dataclasses.replace(result.rows[0], request_id="r1")
            return dataclasses.replace(result, rows=result.rows + [foreign])
        if ids == ["r2"] and result.rows:
            return dataclasses.replace(result, rows=result.rows + [result.rows[0]])
        return result

    plan = load_plan(ROOT / "generated" / "llama.plan")
    engine = Faulty(SimEngine(plan, num_pages=1), on_result=foreign_then_twice)
    requests = _requests(4)
    driver, finished = _run("llama", engine, requests)
    assert sorted(finished) == sorted(r.id for r in requests)
    reasons = {r.id: driver.conductor.records[r.id].finish_reason for r in requests}
    assert set(reasons.values()) == {"length"}


def test_a_failed_step_fails_its_own_requests_and_no_other_active_one():
    """A step the engine fails while other requests are active outside it (waiting for their own
    step), and every later step of its requests (run alone too, test_step_isolation.py): the step's
    requests fail, every other request, active then or admitted later, finishes."""
    plan = load_plan(ROOT / "generated" / "llama.plan")
    seen: dict[str, set[str]] = {}
    driver: Optional[Driver] = None

    def on_launch(step: Any, num: int) -> None:
        assert driver is not None
        ids = {row.request_id for row in step.rows}
        others = set(driver.conductor.active) - ids
        if not seen and ids and others:
            seen["failed"], seen["others"] = ids, others
        if seen and ids & seen["failed"]:  # each of its requests' steps raises, run alone too
            raise RuntimeError("boom")

    engine = Faulty(SimEngine(plan), on_launch=on_launch)
    requests = [Request(id=f"r{i}", prompt_tokens=[1 + i] * (3 + 5 * i), max_tokens=4 + 3 * i) for i in range(6)]
    driver = Driver(plan, engine)
    driver.run(Workload(requests, closed_concurrency=3))
    assert seen, "no step left an active request out"
    reasons = {r.id: driver.conductor.records[r.id].finish_reason for r in requests}
    for request_id, reason in reasons.items():
        if request_id in seen["failed"]:
            assert reason == "error: engine failed the step: RuntimeError: boom", (request_id, reason)
        else:
            assert reason == "length", (request_id, reason, seen)
