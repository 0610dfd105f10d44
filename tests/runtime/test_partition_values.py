"""A partition's hand-off of values and its ending marks (conductor/partition_state.py), on the
state alone (walks stood in by what the methods read):

- an input takes the partition's own persisted value of its name first, else another partition's
  of the same request;
- a persisted value a walk used is gone once that walk ends (a later walk taking that name does
  not get a value already consumed), and so is the latest persisted value a "prompt" input fell
  back to;
- "latest persisted value last": a value persisted again moves to the end, so the prompt
  fallback takes the newest one, not the one first persisted under that name;
- a repeat rule's value that is not a number (a bool) ends the partition rather than repeating;
- a partition cut once (max_tokens, a loop's limit) stays cut when a later walk ends plainly or the
  partition is ended afterwards (its request then ends "length");
- with no walk running, the stage about to start is one that may still count;
- a walk run that ends is cancelled, so a call still active in it never runs (nor is ready).
"""

from __future__ import annotations

import logging
from types import SimpleNamespace

from mstar.plan.schema import EdgePlan, PartitionPlan, RepeatPlan, StagePlan
from mstar.runtime.conductor.partition_state import PartitionState
from mstar.runtime.conductor.request import Request, RequestRecord
from mstar.runtime.conductor.tables import OUTSIDE, PROMPT

PROMPT_TOKENS = [7, 8, 9]


def state(num_stages: int = 3, repeat: RepeatPlan | None = None, counts: tuple[bool, ...] = ()) -> PartitionState:
    plan = PartitionPlan(
        name="P", stages=[StagePlan(walks=[f"w{i}"]) for i in range(num_stages)], initial_walk="w0", repeat=repeat
    )
    walks = [
        SimpleNamespace(
            name=f"w{i}", counts_output=i < len(counts) and counts[i], counts_once=True, stop_ends_counts=()
        )
        for i in range(num_stages)
    ]
    record = RequestRecord(Request(id="r", prompt_tokens=PROMPT_TOKENS, max_tokens=10), arrival_s=0.0)
    return PartitionState(plan, walks, record, {}, clock=lambda: 0.0)


def persist(ps: PartitionState, name: str, value) -> None:
    ps.deliver(EdgePlan(name=name, dest_kind="conductor", is_persist=True, action="sink"), value)


def ended_walk(is_cut: bool = False) -> SimpleNamespace:
    run = SimpleNamespace(is_cut=is_cut, is_cancelled=False)
    run.cancel = lambda: setattr(run, "is_cancelled", True)
    return run


def test_a_persisted_value_a_walk_used_is_gone_once_that_walk_ends():
    ps = state()
    persist(ps, "v", 41)
    assert ps.take("v", OUTSIDE) == 41
    ps.finish_run()
    assert ps.take("v", OUTSIDE) is None and ps.store == {}


def test_the_prompt_fallback_takes_the_newest_persisted_value_and_uses_it_up():
    ps = state()
    assert ps.take("text_inputs", PROMPT) == PROMPT_TOKENS  # the prompt, the first time
    persist(ps, "a", 1)
    persist(ps, "b", 2)
    persist(ps, "a", 3)  # a again: now the newest
    assert ps.take("text_inputs", PROMPT) == 3
    ps.finish_run()
    assert ps.store == {"b": 2}


def test_a_repeat_value_that_is_not_a_number_ends_the_partition(caplog):
    ps = state(num_stages=1, repeat=RepeatPlan(value="left", max_rounds=5))
    persist(ps, "left", True)
    with caplog.at_level(logging.WARNING):
        ps.finish_run()
    assert ps.is_done and ps.num_rounds == 1 and "not a number" in caplog.text


def test_a_cut_partition_stays_cut():
    ps = state()
    ps.run = ended_walk(is_cut=True)
    ps.finish_run()
    ps.run = ended_walk(is_cut=False)
    ps.finish_run()
    assert ps.is_length
    ps.end()  # e.g. its streams ran dry, or the request ended
    assert ps.is_done and ps.is_length


def test_between_walks_the_next_stage_may_count():
    ps = state(counts=(False, True, False))
    ps.run = ended_walk()
    ps.finish_run()  # stage 0 done, stage 1 (which counts) not started yet
    assert ps.run is None and ps.may_count_more()


def test_a_walk_that_ends_is_cancelled():
    ps = state()
    run = ps.run = ended_walk()
    ps.finish_run()
    assert run.is_cancelled and ps.run is None and ps.stage == 1


def test_an_input_takes_its_own_persisted_value_first_then_another_partitions():
    ps, other = state(), state()
    ps.other_stores = [other.store]
    persist(other, "v", 5)
    assert ps.take("v", OUTSIDE) == 5
    persist(ps, "v", 6)
    assert ps.take("v", OUTSIDE) == 6
