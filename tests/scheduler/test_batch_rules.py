"""Batching rules in the scheduler: rows of a walk with rules share a step only with rows of an
equal batch class (KeyPlan.batch_rules; the classes come from the conductor)."""
from hypothesis import given, settings, strategies as st
from plan_factory import build_key

from mstar.plan.schema import DeploymentPlan, WorkerPlan
from mstar.runtime.scheduler.scheduler import WorkerScheduler


def scheduler(rules: dict[str, list[str]], token_budget: int | None = None,
              walks: tuple[str, ...] = ("gen",)) -> WorkerScheduler:
    key = build_key("dit", list(walks), {walk: 8 for walk in walks}).model_copy(update={
        "batch_rules": rules, "token_budget": token_budget})
    placements = [f"dit/{walk}" for walk in walks]
    worker = WorkerPlan(rank=0, placements=placements, walk_to_key={p: key.name for p in placements}, keys=[key],
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



def test_a_row_that_fills_the_budget_exactly_joins():
    sched = scheduler({"gen": ["shape"]}, token_budget=64)
    sched.add_ready_many(["a", "b", "c"], "dit", "gen", [24, 40, 1], classes=[(0,)] * 3)
    batch = sched.next_batch()
    assert batch is not None and batch.request_ids == ["a", "b"]  # 64 tokens: the whole budget, not past it


def test_the_walk_of_the_oldest_ready_row_runs_first():
    """Steps of a key with rules never mix walks; the next one is the walk of the oldest ready row,
    also after a step took rows from the middle of a walk's queue (a class), so a walk whose rows
    came later cannot keep an older walk's rows waiting."""
    sched = scheduler({"gen": ["iteration"], "edit": ["iteration"]}, walks=("gen", "edit"))
    sched.add_ready_many(["e1"], "dit", "edit", 1, classes=[(0,)])
    sched.add_ready_many(["g1"], "dit", "gen", 1, classes=[(0,)])
    sched.add_ready_many(["e2", "e3"], "dit", "edit", 1, classes=[(1,), (0,)])
    steps = []
    while (batch := sched.next_batch()) is not None:
        steps.append(batch.request_ids)
    assert steps == [["e1", "e3"], ["g1"], ["e2"]]


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
