"""A long-running scheduler keeps no per-request memory of requests that came and went.

`mstar serve` removes every ended request from every worker's scheduler; the scheduler may keep
a removal tombstone only while a batch that can still come back (the last two built: step N and
its speculative N+1) names the request. Sizes are asserted, never times.
"""
from plan_factory import assemble_worker, build_key
from trace_harness import Runner

from mstar.plan.schema import DeploymentPlan, SpeculationPlan
from mstar.runtime.scheduler.scheduler import WorkerScheduler

DEPLOYMENT = DeploymentPlan(max_seq_len=4096, kv_pools=[])


def two_key_worker():
    llm = build_key("LLM", ["decode", "prefill"], {"decode": 4, "prefill": 2}, "mixed", 4, {"prefill": 1})
    codec = build_key("codec", ["chunk"], {"chunk": 3})
    specs = [
        SpeculationPlan(node="LLM", walk="decode", can_speculate=True, mixes_walks=False),
        SpeculationPlan(node="LLM", walk="prefill", can_speculate=False, mixes_walks=False),
        SpeculationPlan(node="codec", walk="chunk", can_speculate=True, mixes_walks=False),
    ]
    return assemble_worker(0, [llm, codec], specs, [])


def ids_in_last_two_batches(runner: Runner) -> set[str]:
    built = [batch for op, batch in runner.log if op in ("build", "spec") and batch is not None]
    return {rid for batch in built[-2:] for rid in batch.request_ids}


def test_requests_that_come_and_go_leave_nothing_behind():
    runner = Runner(WorkerScheduler, two_key_worker(), DEPLOYMENT, remove_finished=True)
    sched = runner.sched
    num_requests = 600
    for i in range(num_requests):
        # key 0: a prompt then three decode steps; key 1: four chunks
        runner.arrive(i % 2, [1, 0, 0, 0], [12, 1, 1, 1])
        if i % 3 != 2:
            runner.speculate()
        runner.complete(0b1 if i % 7 == 6 else 0)  # now and then a step fails out of memory
        runner.build()
        if i % 5 == 4:
            runner.remove(i)  # a cancellation, often of a request in flight
        runner.advance(0.02)
        tracked = sched.num_tracked()
        assert tracked["removed"] <= len(ids_in_last_two_batches(runner)), (i, tracked)
    runner.drain()
    num_removed = sum(1 for op in runner.log if op[0] == "remove")
    assert num_removed >= num_requests // 5  # the trace did remove requests on the way
    tracked = sched.num_tracked()
    assert tracked["present"] == tracked["classes"] == tracked["guided"] == tracked["follow"] == 0, tracked
    assert tracked["removed"] <= len(ids_in_last_two_batches(runner)) <= 2 * 4, tracked


def test_a_worker_that_never_ran_the_request_keeps_no_tombstone():
    """The driver removes an ended request from every scheduler, also from workers that never
    had a row of it: nothing of theirs can come back, so they remember nothing."""
    sched = WorkerScheduler(two_key_worker(), DEPLOYMENT, clock=lambda: 0.0)
    for i in range(1000):
        sched.remove(f"elsewhere-{i}")
    assert sched.num_tracked() == {"present": 0, "classes": 0, "guided": 0, "removed": 0, "follow": 0, "contexts": 0}


def test_a_removed_request_never_comes_back_from_the_steps_that_name_it():
    """The guarantee the tombstone keeps: removed while its step N runs and while the
    speculative N+1 holds it, the request is dropped when N fails (hold), when N+1 is discarded,
    and from a late row; then, two steps later, it is forgotten."""
    sched = WorkerScheduler(two_key_worker(), DEPLOYMENT, clock=lambda: 0.0)
    sched.add_ready_many(["a", "b"], "LLM", "decode")
    running = sched.next_batch()
    sched.add_ready("c", "LLM", "decode")
    spec = sched.speculate(running)
    assert spec.request_ids == ["a", "b", "c"]
    sched.remove("a")
    sched.remove("c")
    assert sched.num_tracked()["removed"] == 2
    sched.hold(running, [])  # step N failed: b comes back, a does not
    sched.discard(spec)  # c does not come back either
    sched.add_ready("a", "LLM", "decode")  # a late row of a removed request: dropped
    assert sched.num_ready() == 1
    assert sched.next_batch().request_ids == ["b"]
    assert sched.num_tracked()["removed"] == 2  # in the window: spec, which names a and c
    sched.add_ready("b", "LLM", "decode")
    assert sched.next_batch().request_ids == ["b"]
    assert sched.num_tracked()["removed"] == 0


def test_a_request_removed_while_only_step_n_names_it_never_comes_back():
    """Step N names a and b; its speculative N+1 continues only b (a's loop ended). a is removed
    while N runs; N then fails: b comes back, a does not (the tombstone covers step N as well as
    N+1)."""
    sched = WorkerScheduler(two_key_worker(), DEPLOYMENT, clock=lambda: 0.0)
    sched.add_ready_many(["a", "b"], "LLM", "decode")
    running = sched.next_batch()
    spec = sched.speculate(running, continuing=["b"])
    assert spec is not None and spec.request_ids == ["b"]
    sched.remove("a")
    sched.hold(running, [])
    sched.discard(spec)
    assert sched.num_ready() == 1 and sched.next_batch().request_ids == ["b"]


def test_removed_requests_leave_no_batch_class_or_kv_depth():
    """A row's batch class (a walk with rules) and KV depth (a budget that counts context) outlive
    the step that took the row, until its request's next row replaces them; removing the request
    forgets them, so neither grows with the requests that came and went."""
    rules = build_key("dit", ["gen"], {"gen": 8}).model_copy(update={"batch_rules": {"gen": ["iteration"]}})
    llm = build_key("LLM", ["decode", "prefill"], {"decode": 4, "prefill": 2}, "mixed", 4,
                    mixed_capture=([1, 4], [16, 64]))
    llm = llm.model_copy(update={"token_budget": 64, "chunk_sizes": {"prefill": 16}, "chunk_context_scale": 100})
    sched = WorkerScheduler(assemble_worker(0, [rules, llm], [], []), DEPLOYMENT, clock=lambda: 0.0)
    for i in range(50):
        sched.add_ready_many([f"g{i}"], "dit", "gen", 1, classes=[(i % 3,)])
        sched.add_ready_many([f"p{i}"], "LLM", "prefill", [10], contexts=[5])
        while sched.next_batch() is not None:
            pass
        sched.remove(f"g{i}")
        sched.remove(f"p{i}")
    tracked = sched.num_tracked()
    assert tracked["classes"] == tracked["contexts"] == 0, tracked
