"""Batching rules in the scheduler: rows of a walk with rules share a step only with rows of an
equal batch class (KeyPlan.batch_rules; the classes come from the conductor)."""
from hypothesis import given, settings, strategies as st
from plan_factory import build_key

from mstar.plan.schema import DeploymentPlan, WorkerPlan
from mstar.runtime.scheduler.scheduler import WorkerScheduler


def scheduler(rules: dict[str, list[str]], token_budget: int | None = None) -> WorkerScheduler:
    key = build_key("dit", ["gen"], {"gen": 8}).model_copy(update={"batch_rules": rules,
                                                                   "token_budget": token_budget})
    worker = WorkerPlan(rank=0, placements=["dit/gen"], walk_to_key={"dit/gen": key.name}, keys=[key],
                        speculation=[], tp_groups=[], capture_memory_bytes=0)
    return WorkerScheduler(worker, DeploymentPlan(max_seq_len=64, kv_pools=[]), clock=lambda: 0.0)


def test_rows_of_one_iteration_share_a_step_in_fifo_order():
    sched = scheduler({"gen": ["iteration"]})
    sched.add_ready_many(["a", "b", "c", "d"], "dit", "gen", 1, classes=[(3,), (0,), (3,), (0,)])
    first = sched.next_batch()
    assert first is not None and first.request_ids == ["a", "c"]
    second = sched.next_batch()
    assert second is not None and second.request_ids == ["b", "d"]
    assert sched.next_batch() is None


def test_the_cap_still_bounds_a_class():
    sched = scheduler({"gen": ["shape"]})
    ids = [f"r{i}" for i in range(12)]
    sched.add_ready_many(ids, "dit", "gen", 1, classes=[(1,)] * 12)
    batch = sched.next_batch()
    assert batch is not None and batch.request_ids == ids[:8]


def test_without_rules_every_ready_row_joins():
    sched = scheduler({})
    sched.add_ready_many(["a", "b", "c"], "dit", "gen", 1)
    batch = sched.next_batch()
    assert batch is not None and batch.request_ids == ["a", "b", "c"]


def test_a_key_with_rules_does_not_speculate():
    sched = scheduler({"gen": ["iteration"]})
    sched.add_ready_many(["a", "b"], "dit", "gen", 1, classes=[(0,), (0,)])
    batch = sched.next_batch()
    assert batch is not None and sched.speculate(batch) is None


def test_a_class_keeps_to_the_step_token_budget_in_whole_rows():
    """Rows of a walk with rules are never cut: a step takes the class's rows in FIFO order while
    their tokens fit the key's budget (two 40-token rows passed a budget of 64 in one step before,
    which the engine refused, failing both requests); a row larger than the budget runs alone."""
    sched = scheduler({"gen": ["shape", "iteration"]}, token_budget=64)
    sched.add_ready_many(["a", "b", "c", "d"], "dit", "gen", [40, 40, 40, 90], classes=[(0,), (0,), (0,), (1,)])
    steps = []
    while (batch := sched.next_batch()) is not None:
        steps.append(batch.request_ids)
    assert steps == [["a"], ["b"], ["c"], ["d"]]
    sched.add_ready_many(["e", "f", "g"], "dit", "gen", [20, 30, 20], classes=[(0,)] * 3)
    batch = sched.next_batch()
    assert batch is not None and batch.request_ids == ["e", "f"]  # 50 tokens; g's 20 would pass 64



@settings(deadline=None)
@given(st.lists(st.tuples(st.integers(0, 2), st.integers(1, 100)), min_size=1, max_size=30), st.integers(1, 120))
def test_steps_of_a_key_with_rules_keep_to_the_budget_and_lose_no_row(rows, budget):
    """Random rows (class, tokens): every step is one class, within the cap, within the budget
    unless it is one row, and every row runs exactly once, each class in FIFO order."""
    sched = scheduler({"gen": ["shape"]}, token_budget=budget)
    ids = [f"r{i}" for i in range(len(rows))]
    sched.add_ready_many(ids, "dit", "gen", [tokens for _, tokens in rows], classes=[(c,) for c, _ in rows])
    info = dict(zip(ids, rows))
    ran: list[str] = []
    while (batch := sched.next_batch()) is not None:
        picked = batch.request_ids
        assert 1 <= len(picked) <= 8 and len({info[r][0] for r in picked}) == 1
        assert len(picked) == 1 or sum(info[r][1] for r in picked) <= budget
        ran.extend(picked)
    assert sorted(ran) == sorted(ids)
    for cls in range(3):
        assert [r for r in ran if info[r][0] == cls] == [r for r in ids if info[r][0] == cls]
