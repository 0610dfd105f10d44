"""A request's client emissions hold no object per decoded token (RequestRecord's columns).

A one-token list is kept as its int and flagged, so the tokens of a long decode are not objects
the cyclic collector scans in every middle pass (docs/runtime.md, "Python's collector during a
run"); readers get the values back as emitted.
"""
import gc

import pytest
import torch

from mstar.runtime.conductor.request import Request, RequestRecord
from mstar.runtime.engine.sim import SimEngine
from mstar.runtime.serve.driver import Driver, Workload

from runtime_plans import generated


def _records(plan_name: str, is_laned: bool, has_columns: bool = True):
    plan = generated(plan_name)
    engine = SimEngine(plan)
    if not has_columns:  # the row-by-row results path
        run_step = engine.run_step

        def rows_only(step):
            result = run_step(step)
            result.token_ids = None
            return result
        engine.run_step = rows_only
    driver = Driver(plan, engine)
    driver.conductor.is_laned = is_laned
    requests = [Request(id=f"r{i}", prompt_tokens=list(range(3 + i)), max_tokens=30 + i) for i in range(5)]
    driver.run(Workload(requests))
    return driver.conductor.records


@pytest.mark.parametrize("is_laned", [True, False])
@pytest.mark.parametrize("has_columns", [True, False])
def test_decoded_tokens_leave_no_object_for_the_collector(is_laned, has_columns):
    for record in _records("llama", is_laned, has_columns).values():
        assert record.finish_reason == "length" and record.num_output_tokens >= 30
        assert len(record.emission_values) == len(record.emission_is_token) == len(record.emission_times_s)
        assert all(record.emission_is_token) and not any(map(gc.is_tracked, record.emission_values))
        # read back as emitted: one list of one token id per decode step, the counted tokens in order
        values = [emission.value for emission in record.emissions]
        assert all(type(value) is list and len(value) == 1 for value in values)
        assert [value[0] for value in values] == record.output_tokens
        assert [record.emission_value(i) for i in range(len(values))] == values


def test_other_values_are_kept_as_emitted():
    record = RequestRecord(Request(id="a", prompt_tokens=[1], max_tokens=4), arrival_s=0.0)
    tensor = torch.arange(3)
    values = [[5], [6, 7], [], tensor, ["x"], 8]
    for index, value in enumerate(values):
        record.emit(0.1 * index, ("out", "text"), value)
    assert list(record.emission_is_token) == [1, 0, 0, 0, 0, 0]
    assert record.emission_values[0] == 5 and record.emission_values[3] is tensor
    assert [e.value for e in record.emissions][:3] == [[5], [6, 7], []]
    assert record.emission_value(3) is tensor and record.emission_value(5) == 8
    assert record.first_token_s == 0.0
