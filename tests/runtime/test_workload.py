"""Workload generation and the closed loop."""
import dataclasses
import re

import pytest

from mstar.runtime.serve.driver import Driver
from mstar.runtime.engine.sim import SimEngine
from mstar.runtime.step import RowResult, StepResult
from mstar.runtime.serve.workload import WorkloadError, generate, parse_range, parse_route

from runtime_plans import generated


def test_generate_is_seeded_and_within_ranges():
    a = generate(50, prompt_len=(3, 9), output_len=(2, 4), arrival="poisson", rate=10.0, seed=7)
    b = generate(50, prompt_len=(3, 9), output_len=(2, 4), arrival="poisson", rate=10.0, seed=7)
    assert [(r.prompt_tokens, r.max_tokens, r.arrival_s) for r in a.requests] == \
           [(r.prompt_tokens, r.max_tokens, r.arrival_s) for r in b.requests]
    assert all(3 <= len(r.prompt_tokens) <= 9 and 2 <= r.max_tokens <= 4 for r in a.requests)
    times = [r.arrival_s for r in a.requests]
    assert times == sorted(times) and times[0] > 0 and a.closed_concurrency is None
    staggered = generate(4, prompt_len=(1, 1), output_len=(1, 1), arrival="staggered", rate=4.0)
    assert [r.arrival_s for r in staggered.requests] == [0.0, 0.25, 0.5, 0.75]
    closed = generate(4, prompt_len=(1, 1), output_len=(1, 1), arrival="closed", concurrency=3)
    assert closed.closed_concurrency == 3


@pytest.mark.parametrize("text,message", [("5..2", "need 1 <= A <= B"), ("a..b", "expected A..B"), ("0", "need 1"),
                                          ("1..2..3", "expected")])
def test_bad_ranges(text, message):
    with pytest.raises(WorkloadError, match=message):
        parse_range(text, "--prompt-len")


def test_parse_route():
    expected = {"LLM": ["prefill_text", "image_gen"], "Talker": []}
    assert parse_route(["LLM=prefill_text, image_gen", "Talker="]) == expected
    with pytest.raises(WorkloadError):
        parse_route(["=x"])
    with pytest.raises(WorkloadError, match="partition 'LLM' is given twice"):  # the last one was taken
        parse_route(["LLM=prefill,decode", " LLM =prefill"])


def test_closed_loop_keeps_at_most_c_requests_in_flight():
    plan = generated("orpheus")
    driver = Driver(plan, SimEngine(plan))
    driver.run(generate(40, prompt_len=(4, 20), output_len=(5, 30), arrival="closed", concurrency=4))
    records = list(driver.conductor.records.values())
    events = sorted([(r.arrival_s, 1) for r in records] + [(r.finish_s, -1) for r in records])
    in_flight = peak = 0
    for _, delta in events:
        in_flight += delta
        peak = max(peak, in_flight)
    assert peak <= 4 and all(r.finish_reason == "length" for r in records)


class ErrorBesideOom(SimEngine):
    """An all-or-nothing engine: the first step holding r1 also fails r0 out of memory; nothing
    runs, r1's row fails alone."""

    is_done = False

    def run_step(self, step):
        ids = [row.request_id for row in step.rows]
        if not self.is_done and "r1" in ids and "r0" in ids:
            self.is_done = True
            return StepResult(rows=[RowResult("r1", error="bad input")], allocation_failed=["r0"])
        return super().run_step(step)


def test_rows_failed_alone_in_an_out_of_memory_step_still_fail():
    from mstar.runtime.serve.driver import Workload
    from mstar.runtime.conductor.request import Request

    plan = generated("llama")
    engine = ErrorBesideOom(plan, runs_partial_steps=False)
    driver = Driver(plan, engine)
    driver.run(Workload([Request(id=f"r{i}", prompt_tokens=[1, 2, 3], max_tokens=6) for i in range(3)]))
    records = driver.conductor.records
    assert engine.is_done
    assert records["r1"].finish_reason == "error: bad input"
    assert records["r0"].finish_reason == records["r2"].finish_reason == "length"
    assert records["r0"].num_output_tokens == 6


class ErrorBesideOomPartial(SimEngine):
    """A partial step: the first step holding r0, r1 and r2 fails r0 out of memory, r1 alone
    with an error, and runs r2."""

    is_done = False

    def run_step(self, step):
        ids = [row.request_id for row in step.rows]
        if not self.is_done and {"r0", "r1", "r2"} <= set(ids):
            self.is_done = True
            others = [row for row in step.rows if row.request_id not in ("r0", "r1")]
            ran = super().run_step(dataclasses.replace(step, rows=others))
            self.ran_rows = [r.request_id for r in ran.rows]
            rows = [RowResult("r1", error="bad input")] + ran.rows
            return StepResult(rows=rows, allocation_failed=["r0"], elapsed_s=ran.elapsed_s)
        return super().run_step(step)


def test_partial_step_runs_the_rows_that_got_memory_and_fails_errors_alone():
    from mstar.runtime.serve.driver import Workload
    from mstar.runtime.conductor.request import Request

    plan = generated("llama")
    engine = ErrorBesideOomPartial(plan)
    driver = Driver(plan, engine)
    driver.run(Workload([Request(id=f"r{i}", prompt_tokens=[1, 2, 3], max_tokens=6) for i in range(3)]))
    records = driver.conductor.records
    assert engine.is_done and engine.ran_rows == ["r2"]
    assert records["r1"].finish_reason == "error: bad input"
    assert records["r0"].finish_reason == records["r2"].finish_reason == "length"
    assert records["r0"].num_output_tokens == records["r2"].num_output_tokens == 6
    # r2 advanced in the failing step; r0 waited out its hold.
    assert records["r2"].first_token_s < records["r0"].first_token_s
    assert sum(driver.log.num_held_rows) == 1


class DropsR1(SimEngine):
    """Answers without r1's row once."""

    is_done = False

    def run_step(self, step):
        result = super().run_step(step)
        if not self.is_done and any(r.request_id == "r1" for r in result.rows):
            self.is_done = True
            result.rows = [r for r in result.rows if r.request_id != "r1"]
        return result


def test_a_row_the_engine_did_not_answer_fails_its_request_alone():
    from mstar.runtime.serve.driver import Workload
    from mstar.runtime.conductor.request import Request

    plan = generated("orpheus")
    driver = Driver(plan, DropsR1(plan))
    driver.run(Workload([Request(id=f"r{i}", prompt_tokens=[1, 2], max_tokens=8) for i in range(3)]))
    records = driver.conductor.records
    assert records["r1"].finish_reason == "error: the engine returned no result for the row"
    assert records["r0"].finish_reason == records["r2"].finish_reason == "length"


def test_prompt_lines_take_stop_tokens_and_repetition_penalty():
    from mstar.runtime.engine.sampling import SamplingParams
    from mstar.runtime.serve.workload import parse_prompt_line

    request = parse_prompt_line(
        '{"id": "a", "prompt_tokens": [1], "max_tokens": 3, "stop_tokens": [7, 9], "repetition_penalty": 1.3}', "f:1")
    assert request.stop_tokens == [7, 9] and request.repetition_penalty == 1.3
    params = SamplingParams.from_request(request)  # the names the engine reads
    assert params.stop_tokens == frozenset({7, 9}) and params.repetition_penalty == 1.3
    plain = SamplingParams.from_request(parse_prompt_line('{"id": "b", "prompt_tokens": [1], "max_tokens": 3}', "f:2"))
    assert plain.stop_tokens == frozenset() and plain.repetition_penalty == 1.0
    for text, message in [
        ('"stop_tokens": [1, -2]', "'stop_tokens' must be a list of non-negative integers"),
        ('"stop_tokens": 5', "field 'stop_tokens' must be list"),
        ('"repetition_penalty": 0', "'repetition_penalty' must be > 0"),
        ('"repetition_penalty": "x"', "field 'repetition_penalty' must be int or float"),
        # the engines' own ranges: the simulated engine ran past them with exit 0 (an audit)
        ('"repetition_penalty": 1e-300', "f:1: repetition_penalty must be in [0.0001, 10000] (1 is none), got 1e-300"),
        ('"temperature": 10001', "f:1: temperature must be at most 10000"),
    ]:
        with pytest.raises(WorkloadError, match=re.escape(message)):
            parse_prompt_line('{"id": "a", "prompt_tokens": [1], "max_tokens": 3, ' + text + '}', "f:1")


def test_prompt_lines_take_presence_and_frequency_penalties():
    from mstar.runtime.engine.sampling import SamplingParams
    from mstar.runtime.serve.workload import parse_prompt_line

    request = parse_prompt_line('{"id": "a", "prompt_tokens": [1], "max_tokens": 3, "presence_penalty": -2, '
                                '"frequency_penalty": 0.75}', "f:1")
    assert (request.presence_penalty, request.frequency_penalty) == (-2.0, 0.75)
    params = SamplingParams.from_request(request)  # the names the engine reads
    assert (params.presence_penalty, params.frequency_penalty) == (-2.0, 0.75)
    plain = SamplingParams.from_request(parse_prompt_line('{"id": "b", "prompt_tokens": [1], "max_tokens": 3}', "f:2"))
    assert (plain.presence_penalty, plain.frequency_penalty) == (0.0, 0.0)
    for text, message in [
        ('"presence_penalty": 2.5', "'presence_penalty' must be in [-2, 2], got 2.5"),
        ('"frequency_penalty": NaN', "field 'frequency_penalty' must be a finite number, got nan"),
        ('"frequency_penalty": "x"', "field 'frequency_penalty' must be int or float"),
    ]:
        with pytest.raises(WorkloadError, match=re.escape(message)):
            parse_prompt_line('{"id": "a", "prompt_tokens": [1], "max_tokens": 3, ' + text + '}', "f:1")


def test_arrivals_and_timeline_are_relative_to_the_run_start(monkeypatch, tmp_path):
    """On a clock that does not start at 0 (a real engine's monotonic clock), workload arrival
    times count from the run start, and the timeline's x axis is seconds since then."""
    import matplotlib.pyplot as plt

    from mstar.runtime.serve import timeline

    plan = generated("orpheus")
    engine = SimEngine(plan)
    engine.clock.now = 3000.0
    driver = Driver(plan, engine)
    workload = generate(6, prompt_len=(4, 4), output_len=(3, 3), arrival="staggered", rate=10.0)
    driver.run(workload)
    assert driver.origin_s == 3000.0
    records = list(driver.conductor.records.values())
    assert [r.arrival_s - 3000.0 for r in records] == pytest.approx([r.arrival_s for r in workload.requests])
    figures = []
    monkeypatch.setattr(plt, "close", figures.append)
    timeline.draw(driver.log, records, str(tmp_path / "t.png"), origin_s=driver.origin_s)
    low, high = figures[0].axes[1].get_xlim()
    assert -1.0 < low and high < 10.0  # seconds since the start, not 3000 s


def test_check_route_names_unknown_partitions_and_walks():
    from mstar.runtime.serve.workload import check_route, route_names

    names = route_names(generated("llama"))
    assert names == {"LLM": ["prefill", "decode"]}
    check_route({"LLM": ["prefill", "decode"]}, names, "--route")
    with pytest.raises(WorkloadError, match="x.jsonl:3: unknown partition 'Nope'"):
        check_route({"Nope": ["prefill"]}, names, "x.jsonl:3")
    with pytest.raises(WorkloadError, match="no walk 'decod'; did you mean 'decode'"):
        check_route({"LLM": ["decod"]}, names, "--route")


def test_error_lines_are_one_line_each_deduplicated_and_capped():
    from types import SimpleNamespace

    from mstar.runtime.serve.metrics import error_lines

    def record(request_id, reason):
        return SimpleNamespace(is_failed=reason.startswith("error"), finish_reason=reason,
                               request=SimpleNamespace(id=request_id))

    records = [record("a", "error: boom\n  at line 2"), record("b", "error: boom\n  at line 2"),
               record("c", "length")] + [record(f"x{i}", f"error: other {i}") for i in range(6)]
    lines = error_lines(records, limit=5, width=40)
    assert lines[0] == "2 requests failed (first a): error: boom at line 2"
    assert len(lines) == 6 and lines[-1].startswith("and 2 more")
    assert all("\n" not in line for line in lines)
    assert error_lines([record("c", "length")]) == []


def test_the_timelines_composition_averages_each_keys_steps_apart():
    """A bin holding a 27-row decode step of one key and a 3-row step of another: 27 + 3 stacked,
    not 13.5 + 1.5 (averaged over both keys' steps); a long step counts in every bin it overlaps."""
    from mstar.runtime.serve.timeline import _binned

    steps = [(0.0, 0.1, "LLM", {"decode": 27}), (0.05, 0.1, "codec", {"chunk": 3}),
             (0.25, 0.7, "LLM", {"prefill": 8}), (0.8, 1.0, "codec", {"chunk": 2})]
    series = [("LLM", "decode"), ("LLM", "prefill"), ("codec", "chunk")]
    edges, means = _binned(steps, series)
    assert edges == pytest.approx([0.0, 0.25, 0.5, 0.75, 1.0])  # the first step's start to the last one's end
    assert means["LLM", "decode"][0] == 27 and means["codec", "chunk"][0] == 3
    # the 0.45 s prefill step shows in each bin it ran through, not in its first bin alone
    assert means["LLM", "prefill"] == [0, 8, 8, 0] and means["LLM", "decode"][1:] == [0, 0, 0]
    assert means["codec", "chunk"] == [3, 0, 0, 2]


def test_the_timelines_latency_holds_finished_requests_only(tmp_path, monkeypatch):
    """An interrupted run drew the TTFT of requests that outputs.jsonl and the report leave out."""
    from types import SimpleNamespace

    import matplotlib.axes

    from mstar.runtime.serve import timeline
    from mstar.runtime.serve.metrics import StepLog

    drawn = []
    scatter = matplotlib.axes.Axes.scatter
    monkeypatch.setattr(matplotlib.axes.Axes, "scatter",
                        lambda self, x, y, **kw: drawn.append((kw.get("label"), len(x))) or scatter(self, x, y, **kw))
    finished = SimpleNamespace(is_finished=True, first_token_s=1.0, arrival_s=0.5, token_times_s=[1.0, 1.1],
                               finish_s=1.1)
    cut = SimpleNamespace(is_finished=False, first_token_s=2.0, arrival_s=1.5, token_times_s=[2.0, 2.1, 2.2],
                          finish_s=None)
    timeline.draw(StepLog(), [finished, cut], str(tmp_path / "t.png"))
    assert drawn == [("TTFT (at first token)", 1), ("mean inter-token (at finish)", 1)]


def test_a_timeline_of_one_step_fills_its_bin(monkeypatch, tmp_path):
    """One step: its composition spans the step, not a zero-width point at the bin's centre (the
    panel was empty); the legends sit beside the axes (inside, six series ran off the figure)."""
    import matplotlib.pyplot as plt

    from mstar.runtime.serve import timeline

    plan = generated("llama")
    driver = Driver(plan, SimEngine(plan))
    driver.run(generate(1, prompt_len=(4, 4), output_len=(1, 1)))
    figures = []
    monkeypatch.setattr(plt, "close", figures.append)
    timeline.draw(driver.log, list(driver.conductor.records.values()), str(tmp_path / "t.png"),
                  origin_s=driver.origin_s)
    top = figures[0].axes[0]
    (filled,) = top.collections
    x0, x1 = filled.get_paths()[0].vertices[:, 0].min(), filled.get_paths()[0].vertices[:, 0].max()
    assert x1 - x0 == pytest.approx(driver.log.end_s[0] - driver.log.start_s[0])
    legend = top.get_legend()
    assert legend is not None and legend.get_bbox_to_anchor().x0 > top.get_window_extent().x1 - 1
