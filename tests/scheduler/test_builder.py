"""The FIFO builder's rules on small hand-made keys (docs/runtime.md "## Scheduler")."""
import pytest
from plan_factory import assemble_worker, build_key

from mstar.plan.schema import DeploymentPlan, SpeculationPlan
from mstar.runtime.scheduler.key_tables import PlanTableError
from mstar.runtime.scheduler.scheduler import (
    DuplicateRowError,
    LostRowError,
    UnknownPlacementError,
    WorkerScheduler,
)

DEPLOYMENT = DeploymentPlan(max_seq_len=4096, kv_pools=[])


def scheduler(*keys, specs=()):
    return WorkerScheduler(assemble_worker(0, list(keys), list(specs), []), DEPLOYMENT, clock=lambda: 0.0)


def llm(combined_cap=None, rows_limits=None, caps=None, **captures):
    caps = caps or {"decode": 4, "prefill": 2}
    return build_key("LLM", ["decode", "prefill"], caps, "mixed", combined_cap, rows_limits, **captures)


def add(sched, walks, node="LLM", tokens=1):
    """Rows named by position: walks 'ddp' adds r0 decode, r1 decode, r2 prefill."""
    names = {"d": "decode", "p": "prefill", "a": "a", "b": "b", "c": "c"}
    for i, letter in enumerate(walks):
        sched.add_ready(f"r{i}", node, names[letter], tokens)


def test_one_walk_step_keeps_its_walks_cap_and_label():
    sched = scheduler(llm(combined_cap=16))
    add(sched, "dddddd")
    batch = sched.next_batch()
    assert batch.request_ids == ["r0", "r1", "r2", "r3"] and batch.label == "decode" and batch.mask == 1
    assert sched.num_ready() == 2  # the two pushed out by the cap are returned to the queue


def test_mixed_step_takes_the_combined_cap_when_given():
    sched = scheduler(llm(combined_cap=6))
    add(sched, "dpdddddd")
    batch = sched.next_batch()
    assert len(batch.request_ids) == 6 and batch.label is None and batch.mask == 3
    assert batch.walks == ["decode"] * 5 + ["prefill"]  # grouped by walk, FIFO within a walk


def test_mixed_step_without_combined_cap_takes_smallest_cap_among_walks_present():
    key = build_key("N", ["a", "b", "c"], {"a": 8, "b": 3, "c": 2}, "abc")
    sched = scheduler(key)
    add(sched, "aabaa", node="N")
    batch = sched.next_batch()
    # cap of {a, b} is 3 (c, with cap 2, is not present): a, a, b join; the next a would exceed 3.
    assert batch.request_ids == ["r0", "r1", "r2"]


def test_a_row_whose_walk_would_lower_the_cap_below_the_step_stays_out():
    sched = scheduler(llm())  # mixed cap = min(4, 2) = 2
    add(sched, "dddp")
    batch = sched.next_batch()
    assert batch.request_ids == ["r0", "r1", "r2"] and batch.label == "decode"
    assert sched.next_batch().request_ids == ["r3"]


def test_rows_limit_bounds_a_walk_in_a_mixed_step():
    sched = scheduler(llm(combined_cap=8, rows_limits={"prefill": 1}, caps={"decode": 8, "prefill": 4}))
    add(sched, "dppd")
    batch = sched.next_batch()
    assert sorted(batch.request_ids) == ["r0", "r1", "r3"]
    assert batch.walks.count("prefill") == 1


def test_rows_limit_is_checked_when_a_step_becomes_mixed():
    sched = scheduler(llm(combined_cap=8, rows_limits={"prefill": 2}, caps={"decode": 8, "prefill": 4}))
    add(sched, "pppd")
    batch = sched.next_batch()
    # three prompt rows already break `rows prefill <= 2` of a mixed step: the decode row waits.
    assert batch.request_ids == ["r0", "r1", "r2"] and batch.label == "prefill"


def test_rows_of_one_walk_keep_fifo_order_once_one_is_pushed_out():
    key = build_key("N", ["a", "b"], {"a": 1, "b": 4}, "ab", 4)
    sched = scheduler(key)
    add(sched, "aaba", node="N")
    batch = sched.next_batch()
    # r1 (a) is pushed out by a's cap 1; r2 (b) mixes the step (cap 4); r3 (a) must not overtake r1.
    assert batch.request_ids == ["r0", "r2"]


def test_keys_run_least_recently_run_first_and_small_caps_do_not_starve_others():
    small = build_key("S", ["s"], {"s": 1})
    other = build_key("O", ["o"], {"o": 4})
    sched = scheduler(small, other)
    for i in range(4):
        sched.add_ready(f"s{i}", "S", "s")
    sched.add_ready("o0", "O", "o")
    keys = [sched.next_batch().key for _ in range(3)]
    assert keys == ["S:s", "O:o", "S:s"]


def test_padded_batch_and_token_bucket_come_from_the_capture_tables():
    sched = scheduler(llm(combined_cap=8, caps={"decode": 8, "prefill": 4},
                          walk_captures={"decode": [1, 2, 4, 8]}, mixed_capture=([4, 8], [64, 128])))
    for i in range(3):
        sched.add_ready(f"d{i}", "LLM", "decode")
    batch = sched.next_batch()
    assert (batch.capture, batch.padded_batch, batch.token_bucket) == ("LLM:decode", 4, 0)
    sched.add_ready_many(batch.request_ids, "LLM", "decode")
    sched.add_ready("p", "LLM", "prefill", 70)
    batch = sched.next_batch()
    assert (batch.capture, batch.padded_batch, batch.token_bucket) == ("LLM:mixed", 4, 128)
    sched.add_ready_many(["d0"], "LLM", "decode")
    sched.add_ready("q", "LLM", "prefill", 500)
    batch = sched.next_batch()
    assert (batch.capture, batch.padded_batch, batch.token_bucket) == (None, 0, 0)  # over every bucket: eager


def test_unknown_placement_and_duplicate_rows_are_errors():
    sched = scheduler(llm())
    with pytest.raises(UnknownPlacementError, match="vision"):
        sched.add_ready("r", "LLM", "vision")
    sched.add_ready("r", "LLM", "decode")
    with pytest.raises(DuplicateRowError, match="'r'"):
        sched.add_ready("r", "LLM", "prefill")
    with pytest.raises(DuplicateRowError):
        sched.add_ready_many(["x", "x"], "LLM", "decode")
    assert sched.num_ready() == 1


def test_a_refused_add_leaves_no_trace():
    """A request id repeated within one add is refused as a whole: none of its rows is ready or
    counted present, so each may be added again (a leftover `present` entry would refuse the row
    as a duplicate, or be reported lost)."""
    sched = scheduler(llm())
    with pytest.raises(DuplicateRowError):
        sched.add_ready_many(["x", "y", "x"], "LLM", "decode")
    assert sched.num_ready() == 0 and sched.num_tracked()["present"] == 0
    sched.add_ready_many(["x", "y"], "LLM", "decode")
    batch = sched.next_batch()
    assert batch is not None and batch.request_ids == ["x", "y"]


def test_a_lost_row_raises_an_error_naming_it():
    sched = scheduler(llm())
    add(sched, "dd")
    queue = sched._queues[0]
    # Simulate a builder bug: a row vanishes from the columns but is still accounted present.
    del queue.ids[0][1], queue.tokens[0][1]
    with pytest.raises(LostRowError, match="r1"):
        sched.next_batch()


def test_speculation_plan_defaults_do_not_matter_for_building():
    spec = SpeculationPlan(node="LLM", walk="decode", can_speculate=True, mixes_walks=False)
    sched = scheduler(llm(), specs=[spec])
    assert sched.next_batch() is None and sched.is_idle()


def test_a_plan_with_a_missing_mixture_is_refused_with_a_clear_error():
    key = llm()
    broken = key.model_copy(update={"mixtures": key.mixtures[:3]})
    with pytest.raises(PlanTableError, match=r"LLM:mixed: no mixture entry for masks \[3\]"):
        scheduler(broken)
