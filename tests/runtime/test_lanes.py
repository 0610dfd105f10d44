"""Decode lanes (conductor/lanes.py, lane_pass.py) against the loop pass without them.

A laned run must be the run without lanes: the same steps (rows, order, tokens, contexts,
iterations) and per request the same record (tokens, times, emissions, counts, ending), also
when lanes fill their buffers and sync often, when a reader looks at records after each step,
and when the run stops half way. And the lanes are really taken: a plain decode takes one lane
for its whole decode.
"""
import pytest

from mstar.runtime.conductor import lanes as lanes_module
from mstar.runtime.conductor.request import Request
from mstar.runtime.engine.sim import SimEngine
from mstar.runtime.serve.driver import Driver, Workload

from runtime_plans import generated


class _Recording(SimEngine):
    def __init__(self, *args, has_columns: bool = True, **kwargs):
        super().__init__(*args, **kwargs)
        self.steps = []
        self.has_columns = has_columns

    def run_step(self, step):
        self.steps.append([(r.request_id, r.walk, r.num_tokens, r.context_len, r.loop_iter, r.loop_count)
                           for r in step.rows])
        result = super().run_step(step)
        if not self.has_columns:
            result.token_ids = None
        return result


def _requests(num=6, max_tokens=40, stop_tokens=False):
    return [Request(id=f"r{i}", prompt_tokens=list(range(3 + i)), max_tokens=max_tokens - 3 * i, arrival_s=0.001 * i)
            for i in range(num)]


def _record(r):
    return (r.finish_reason, r.num_output_tokens, r.output_tokens, r.token_times_s, r.first_token_s, r.finish_s,
            [(e.time_s, e.edge, e.modality, e.value) for e in r.emissions])


def _run(plan_name, *, is_laned, requests, closed=None, has_columns=True, stop_after=None, seen=None):
    plan = generated(plan_name)
    engine = _Recording(plan, has_columns=has_columns)
    driver = None

    def on_step(launch):
        if seen is not None:  # what a server would read after each step
            seen.append({rid: (r.num_output_tokens, list(r.output_tokens), len(r.emission_values))
                         for rid, r in driver.conductor.records.items()})
        if stop_after is not None and len(engine.steps) >= stop_after:
            driver.stop()

    is_watched = seen is not None or stop_after is not None  # else no callback: lanes sync only when they must
    driver = Driver(plan, engine, on_step=on_step if is_watched else None)
    driver.conductor.is_laned = is_laned
    driver.run(Workload([Request(**vars(r)) for r in requests], closed_concurrency=closed))
    records = {rid: _record(r) for rid, r in driver.conductor.records.items()}
    return records, engine.steps, driver.conductor


@pytest.mark.parametrize("plan_name", ["llama", "qwen3_omni", "orpheus"])
def test_laned_run_is_the_run_without_lanes(plan_name):
    laned = _run(plan_name, is_laned=True, requests=_requests())
    plain = _run(plan_name, is_laned=False, requests=_requests())
    assert laned[1] == plain[1]
    assert laned[0] == plain[0]


def test_a_plain_decode_takes_one_lane_for_its_whole_decode():
    requests = _requests()
    records, _, conductor = _run("llama", is_laned=True, requests=requests)
    assert all(r[0] == "length" for r in records.values())
    # one lane per request (its first decode row goes through the loop pass, then it takes one),
    # and every lane is free again once the requests ended
    assert conductor.lanes.num_serials == len(requests)
    assert conductor.lanes.num_attached == 0


def test_without_the_engine_columns_no_lane_is_taken():
    laned = _run("llama", is_laned=True, requests=_requests(), has_columns=False)
    plain = _run("llama", is_laned=False, requests=_requests())
    assert laned[2].lanes.num_serials == 0
    assert laned[:2] == plain[:2]


def test_full_lane_buffers_sync_and_give_the_same_run(monkeypatch):
    monkeypatch.setattr(lanes_module, "WIDTH", 3)
    laned = _run("llama", is_laned=True, requests=_requests(), closed=3)
    assert laned[2].lanes.num_serials > 3 * len(_requests())  # each request re-took a lane many times
    monkeypatch.undo()
    plain = _run("llama", is_laned=False, requests=_requests(), closed=3)
    assert laned[:2] == plain[:2]


def test_records_read_after_each_step_are_up_to_date():
    laned_seen, plain_seen = [], []
    _run("llama", is_laned=True, requests=_requests(), seen=laned_seen)
    _run("llama", is_laned=False, requests=_requests(), seen=plain_seen)
    assert laned_seen == plain_seen and len(laned_seen) > 10


def test_a_run_stopped_half_way_leaves_complete_records():
    laned = _run("llama", is_laned=True, requests=_requests(), stop_after=12)
    plain = _run("llama", is_laned=False, requests=_requests(), stop_after=12)
    assert any(r[0] is None and r[1] > 2 for r in laned[0].values())  # unfinished, tokens on the way
    assert laned[:2] == plain[:2]


def test_common_rows_of_several_walks_leave_in_one_group_per_run_of_a_walk():
    from types import SimpleNamespace

    import numpy as np

    from mstar.runtime.conductor.lane_pass import _ready
    from mstar.runtime.conductor.lanes import LaneRows

    walks = ["a", "a", "b", "a", "b", "b"]
    rows = [SimpleNamespace(walk=walk) for walk in walks]
    ids = [f"r{i}" for i in range(len(walks))]
    conductor = SimpleNamespace(ready_out=[])
    lane_rows = LaneRows(np.arange(6), np.ones(6, dtype=np.int64), 0, None, ids, None)
    _ready(conductor, "N", rows, lane_rows, 1, 6)
    assert conductor.ready_out == [("N", "a", ["r1"], [1]), ("N", "b", ["r2"], [1]), ("N", "a", ["r3"], [1]),
                                   ("N", "b", ["r4", "r5"], [1, 1])]


def test_the_torch_engine_answers_in_columns_and_its_laned_run_is_the_same():
    """The torch engine (CPU, tiny dims) gives the step's tokens in columns when every row answered
    one token in order, so its decode rows take lanes, and the run equals the run without them."""
    from mstar.runtime.engine.torch_engine import TorchEngine

    runs = {}
    for is_laned in (True, False):
        plan = generated("llama")
        driver = Driver(plan, TorchEngine(plan))
        driver.conductor.is_laned = is_laned
        driver.run(Workload([Request(**vars(r)) for r in _requests(num=4, max_tokens=20)]))
        runs[is_laned] = ({rid: _record(r)[:3] for rid, r in driver.conductor.records.items()}, driver.conductor)
    assert runs[True][0] == runs[False][0]
    assert runs[True][1].lanes.num_serials == 4  # each request decoded in a lane
