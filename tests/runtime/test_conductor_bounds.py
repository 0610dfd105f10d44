"""The conductor's own bounds on a decode loop (conductor/loop_pass.py), on both of its paths for
such rows (the steady case per row, and the general kernel `_fast_row` that a request with stop
strings takes) and as the row-by-row reference (`is_columnar = False`) keeps them:

- a loop ends at its limit (`max_iters`), not an iteration later. The generated plans' decode
  loops run 2048 iterations, past any test's max_tokens, so there the engine's stop at max_tokens
  always came first and a limit one iteration late went unseen;
- a request ends at its max_tokens by the conductor's count, also when the engine does not report
  the last token as a cut (the engines all do today, which hid a count one token late).
"""

from __future__ import annotations

import pytest

from mstar.runtime.conductor.request import Request
from mstar.runtime.engine.sim import SimEngine
from mstar.runtime.serve.driver import Driver, Workload
from mstar.runtime.step import RowResult
from runtime_plans import generated

LIMIT = 4
PATHS = pytest.mark.parametrize("is_columnar, stop_strings", [(True, []), (True, ["never said"]), (False, [])])


def short_loop_plan():
    """llama with its decode loop limited to LIMIT iterations."""
    plan = generated("llama")
    walks = [
        walk.model_copy(update={"loops": [loop.model_copy(update={"max_iters": LIMIT}) for loop in walk.loops]})
        for walk in plan.walks
    ]
    return plan.model_copy(update={"walks": walks})


class _NoCutReported(SimEngine):
    """Reports no row's max_tokens cut (its model stops, none here, would still be reported)."""

    def run_step(self, step):
        result = super().run_step(step)
        result.rows = [
            RowResult(r.request_id, r.outputs, r.is_stop and not r.is_length, r.error, r.is_input_fault)
            for r in result.rows
        ]
        result.stop_rows = [i for i, r in enumerate(result.rows) if r.is_stop]
        return result


def _run(plan, engine, is_columnar: bool, requests: list[Request]) -> dict[str, int]:
    driver = Driver(plan, engine, decode=lambda tokens: "".join(chr(ord("a") + t % 8) for t in tokens))
    driver.conductor.is_columnar = is_columnar
    driver.run(Workload(requests))
    records = driver.conductor.records
    assert all(records[r.id].finish_reason is not None for r in requests)
    return {r.id: records[r.id].num_output_tokens for r in requests}


@PATHS
def test_a_decode_loop_runs_its_limit_and_no_more(is_columnar, stop_strings):
    plan = short_loop_plan()
    requests = [
        Request(id=f"r{i}", prompt_tokens=list(range(3 + i)), max_tokens=50, stop_strings=stop_strings)
        for i in range(3)
    ]
    # the prefill's token, then one a decode iteration
    assert _run(plan, SimEngine(plan), is_columnar, requests) == {r.id: 1 + LIMIT for r in requests}


@PATHS
def test_max_tokens_ends_a_request_when_the_engine_reports_no_cut(is_columnar, stop_strings):
    plan = generated("llama")
    requests = [
        Request(id=f"r{i}", prompt_tokens=list(range(3 + i)), max_tokens=5 + i, stop_strings=stop_strings)
        for i in range(3)
    ]
    assert _run(plan, _NoCutReported(plan), is_columnar, requests) == {r.id: r.max_tokens for r in requests}
