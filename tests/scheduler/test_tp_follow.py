"""TP followers run the leader's batches in order, all rows or none, and at most N in a row
while local work waits."""
import pytest
from hypothesis import given
from hypothesis import strategies as st
from plan_factory import assemble_worker, build_key, worker_cases

from mstar.plan.schema import DeploymentPlan, TPGroup
from mstar.runtime.scheduler.baseline import BaselineScheduler
from mstar.runtime.scheduler.scheduler import SchedulerError, WorkerScheduler


def pair(max_follow=1):
    tp = build_key("LLM", ["decode"], {"decode": 4})
    local = build_key("codec", ["chunk"], {"chunk": 4})
    group = TPGroup(node="LLM", walks=["decode"], ranks=[0, 1], tp_size=2, sp_size=1, leader=0)
    deployment = DeploymentPlan(max_seq_len=4096, kv_pools=[], max_consecutive_follower_batches=max_follow)
    leader = WorkerScheduler(assemble_worker(0, [tp, local], [], [group]), deployment, clock=lambda: 0.0)
    follower = WorkerScheduler(assemble_worker(1, [tp, local], [], [group]), deployment, clock=lambda: 0.0)
    return leader, follower


def test_follower_waits_for_every_row_then_runs_the_leaders_batch():
    leader, follower = pair()
    assert follower.is_follower_of("LLM", "decode") and not leader.is_follower_of("LLM", "decode")
    leader.add_ready_many(["a", "b"], "LLM", "decode")
    batch = leader.next_batch()
    follower.register_follow(batch)
    follower.add_ready("a", "LLM", "decode")
    assert follower.next_batch() is None  # b not ready here yet: nothing of the batch runs
    follower.add_ready("b", "LLM", "decode")
    run = follower.next_batch()
    assert run.is_follower and run.request_ids == batch.request_ids and run.mask == batch.mask
    assert follower.is_idle()


def test_follower_never_composes_its_followed_key_and_leader_cannot_follow():
    leader, follower = pair()
    follower.add_ready("a", "LLM", "decode")
    assert follower.next_batch() is None
    leader.add_ready("a", "LLM", "decode")
    with pytest.raises(SchedulerError, match="leads"):
        leader.register_follow(leader.next_batch())


def test_at_most_n_follower_batches_in_a_row_while_local_work_waits():
    leader, follower = pair(max_follow=2)
    for i in range(3):
        leader.add_ready(f"t{i}", "LLM", "decode")
        follower.add_ready(f"t{i}", "LLM", "decode")
        follower.register_follow(leader.next_batch())
    follower.add_ready("c", "codec", "chunk")
    kinds = [follower.next_batch().is_follower for _ in range(4)]
    assert kinds == [True, True, False, True]


def test_a_local_step_ends_the_followers_run_even_while_local_work_still_waits():
    """After N follower batches in a row one local step runs; then the follower's count starts
    again, so local work arriving all the time cannot keep the leader's batches waiting."""
    leader, follower = pair(max_follow=2)
    for i in range(4):
        leader.add_ready(f"t{i}", "LLM", "decode")
        follower.add_ready(f"t{i}", "LLM", "decode")
        follower.register_follow(leader.next_batch())
    follower.add_ready("c1", "codec", "chunk")
    kinds = [follower.next_batch().is_follower for _ in range(3)]
    follower.add_ready("c2", "codec", "chunk")
    kinds += [follower.next_batch().is_follower for _ in range(3)]
    assert kinds == [True, True, False, True, True, False]


def test_a_follower_keeps_a_ready_row_a_queued_leader_batch_names_after_its_request_ends():
    """The leader ran (or committed) the step; the request ended before the follower ran its
    share. Dropping the row would leave the follower waiting for it forever."""
    leader, follower = pair()
    leader.add_ready_many(["a", "b"], "LLM", "decode")
    batch = leader.next_batch()
    follower.register_follow(batch)
    follower.add_ready_many(["a", "b"], "LLM", "decode")
    follower.remove("a")
    run = follower.next_batch()
    assert run is not None and run.request_ids == batch.request_ids


def test_a_follower_takes_a_late_row_a_queued_leader_batch_names_after_its_request_ends():
    """As above with the row arriving after the removal, while the follower still remembers the
    request (its last step named it): the queued leader batch still needs the row."""
    leader, follower = pair()
    leader.add_ready("a", "LLM", "decode")
    follower.register_follow(leader.next_batch())
    follower.add_ready("a", "LLM", "decode")
    assert follower.next_batch().request_ids == ["a"]
    leader.add_ready_many(["a", "b"], "LLM", "decode")
    second = leader.next_batch()
    follower.register_follow(second)
    follower.add_ready("b", "LLM", "decode")
    follower.remove("a")
    follower.add_ready("a", "LLM", "decode")
    run = follower.next_batch()
    assert run is not None and run.request_ids == second.request_ids


@given(worker_cases(with_tp=True), st.lists(st.tuples(st.integers(0, 3), st.booleans()), max_size=60))
def test_followers_run_whole_leader_batches_in_order(case, ops):
    """Random arrivals reach leader and follower (the follower's rows may lag); every follower
    batch is exactly the next leader batch of the TP key, never part of one."""
    for make in (WorkerScheduler, BaselineScheduler):
        check_follow_trace(make, case, ops)


def check_follow_trace(make, case, ops):
    leader = make(case.leader, case.deployment, clock=lambda: 0.0)
    follower = make(case.follower, case.deployment, clock=lambda: 0.0)
    tp_key = next(key for key in case.leader.keys if key.name == case.tp_key)
    sent, lagging, followed = [], [], []
    for count, (burst, is_lagging) in enumerate(ops):
        for i in range(burst):
            rid, walk = f"r{count}_{i}", tp_key.walks[i % len(tp_key.walks)]
            leader.add_ready(rid, tp_key.node, walk)
            if is_lagging:
                lagging.append((rid, walk))
            else:
                follower.add_ready(rid, tp_key.node, walk)
        if not is_lagging:
            for rid, walk in lagging:
                follower.add_ready(rid, tp_key.node, walk)
            lagging.clear()
        batch = leader.next_batch()
        if batch is not None and batch.key == tp_key.name:
            follower.register_follow(batch)
            sent.append(batch)
        run = follower.next_batch()
        if run is not None and run.is_follower:
            followed.append(run)
    for rid, walk in lagging:
        follower.add_ready(rid, tp_key.node, walk)
    while (run := follower.next_batch()) is not None:
        followed.append(run)
    assert [(b.request_ids, b.walks, b.mask) for b in followed] == [(b.request_ids, b.walks, b.mask) for b in sent]
