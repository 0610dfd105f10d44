"""`mstar bench kv`'s chunk steps on the device (torch engine on a GPU, CUDA events: GPU tests run
the events): picked out of a run's steps by carrying more tokens than rows, their device spans and
the gaps before them (gpu/step_events.step_table), the slowest first."""
from mstar.runtime.engine.gpu.step_events import step_table
from mstar.runtime.serve.bench_kv import chunk_steps_on_device


class _Timed:
    """Stand-in for StepEvents after a run: its steps() from fixed device times."""

    def __init__(self, spans, shapes):
        self.spans, self.shapes = spans, shapes

    def steps(self):
        return step_table(self.spans, self.shapes, [f"path {i}" for i in range(len(self.spans))])


def test_the_slowest_chunk_step_shows_as_device_time_or_as_waiting_for_the_host():
    # the decode rows' own prompts (16 rows, 256 tokens), decode steps of 40 rows, then chunk
    # steps of 40 rows + 216 tokens; the third chunk step waits 2 ms for the host, the fourth
    # runs 7 ms on the device
    spans = [(-9.0, 0.0), (0.0, 2.0), (2.0, 4.0), (4.0, 8.0), (8.0, 12.0), (14.0, 18.0), (18.0, 25.0),
             (25.0, 27.0)]
    shapes = [(16, 256), (40, 40), (40, 40), (41, 256), (41, 256), (41, 256), (41, 256), (40, 40)]
    found = chunk_steps_on_device([_Timed(spans, shapes)], num_decode=40)
    assert found["num_chunk_steps"] == 5
    assert found["beside_decode_span_max_ms"] == 7.0 and found["beside_decode_span_p90_ms"] > 4.0
    slowest = found["slowest"]
    assert [(s["index"], s["span_ms"], s["gap_before_ms"]) for s in slowest] == [(0, 9.0, 0.0), (4, 7.0, 0.0),
                                                                                 (3, 4.0, 2.0)]
    # beside the decode rows only (the prompt wave of 16 rows left out), the slowest first
    assert [(s["index"], s["span_ms"]) for s in found["slowest_beside_decode"]] == [(4, 7.0), (1, 4.0), (2, 4.0)]
    assert found["slowest_beside_decode"][0]["path"] == "path 6"  # the step's own path (its 7th launch)


def test_a_step_says_how_much_of_its_span_came_before_its_replay():
    """`StepEvents.replay`'s event gives each step the part of its span before its graph replay (the
    device waiting for the host inside the step shows there); steps that marked none say None, and
    `mstar bench kv` prints it beside the slowest chunk steps."""
    from mstar.runtime.serve.bench_kv import _before_replay

    table = step_table([(0.0, 2.0), (2.0, 5.5)], [(40, 40), (41, 256)], ["decode graph 64", "whole 256x64 split"],
                       [0.03, 0.7125])
    assert [step["before_replay_ms"] for step in table] == [0.03, 0.713]
    assert step_table([(0.0, 1.0)], [(1, 1)])[0]["before_replay_ms"] is None
    assert _before_replay(table[1]) == ", 0.71 ms of it before the replay" and _before_replay({}) == ""
    # the median over the chunk steps beside the decode rows (the decode step has none to count)
    found = chunk_steps_on_device([_TimedWithReplays(table)], num_decode=40)
    assert found["beside_decode_before_replay_p50_ms"] == 0.713


class _TimedWithReplays:
    def __init__(self, table):
        self.table = table

    def steps(self):
        return self.table


def test_a_run_without_device_events_reports_no_chunk_steps():
    assert chunk_steps_on_device([]) == {"num_chunk_steps": 0, "span_p50_ms": None, "slowest": [],
                                         "beside_decode_span_p90_ms": None, "beside_decode_span_max_ms": None,
                                         "beside_decode_before_replay_p50_ms": None,
                                         "slowest_beside_decode": []}


def test_each_step_names_how_the_executor_ran_it():
    from mstar.runtime.engine.gpu.executor import path_of

    assert path_of(8, None, 0) == "decode graph 8"
    assert path_of(0, (256, 64, "split"), 0) == "whole 256x64 split"
    assert path_of(0, None, 384) == "piecewise 384"
    assert path_of(0, None, 0) == "eager"


def test_a_prefix_run_s_cached_first_steps_are_its_last_steps_of_more_than_one_token():
    from mstar.runtime.serve.bench_kv import cached_first_steps

    # the first request: two 512-token chunks, its 16-token tail, a decode step; then three cached
    # requests, each its 16-token tail unrolled over 16 rows, then a decode step
    shapes = [(1, 512), (1, 512), (1, 16), (1, 1)] + [(16, 16), (1, 1)] * 3
    spans, start = [], 0.0
    for length in [3.0, 3.0, 1.5, 1.2] + [1.4, 1.2, 1.3, 1.2, 1.6, 1.2]:
        spans.append((start, start + length))
        start += length + 0.5
    paths = ["piecewise 512"] * 2 + ["decode graph 1"] * 2 + ["decode graph 16", "decode graph 1"] * 3
    timed = _Timed(spans, shapes)
    timed.steps = lambda: step_table(spans, shapes, paths)
    found = cached_first_steps([timed], [2.0, 2.1, 2.4])
    assert found["cached_first_step_span_ms"] == [1.3, 1.4, 1.6]
    assert found["cached_ttft_beside_step_ms"] == [0.6, 0.8, 0.8]  # 2.0 - 1.4, 2.1 - 1.3, 2.4 - 1.6
    assert found["cached_first_step_paths"] == ["decode graph 16"]
    # fewer such steps than cached requests (a run that lost its events): nothing rather than a wrong pairing
    assert cached_first_steps([timed], [2.0] * 9) == {}
