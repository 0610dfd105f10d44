"""Out-of-memory holds (injected clock), pending removal, discards, and speculation chains."""
from plan_factory import assemble_worker, build_key

from mstar.plan.schema import DeploymentPlan, SpeculationPlan
from mstar.runtime.scheduler.scheduler import HOLD_BACKOFF_S, WorkerScheduler

DEPLOYMENT = DeploymentPlan(max_seq_len=4096, kv_pools=[])


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def llm_scheduler(mixes_walks=False, decode_cap=4, extra_keys=(), clock=None):
    key = build_key("LLM", ["decode", "prefill"], {"decode": decode_cap, "prefill": 2}, "mixed",
                    decode_cap, {"prefill": 1})
    specs = [
        SpeculationPlan(node="LLM", walk="decode", can_speculate=True, mixes_walks=mixes_walks),
        SpeculationPlan(node="LLM", walk="prefill", can_speculate=False, mixes_walks=False),
    ]
    worker = assemble_worker(0, [key, *extra_keys], specs, [])
    return WorkerScheduler(worker, DEPLOYMENT, clock=clock or Clock())


# ---------------------------------------------------------------- holds


def test_held_rows_wait_out_the_backoff_then_return():
    clock = Clock()
    sched = llm_scheduler(clock=clock)
    sched.add_ready_many(["a", "b"], "LLM", "decode")
    batch = sched.next_batch()
    sched.hold(batch)
    assert (sched.num_ready(), sched.num_held()) == (0, 2)
    assert sched.next_batch() is None and not sched.is_idle()
    assert sched.next_hold_deadline() == HOLD_BACKOFF_S
    clock.now = 0.049
    assert sched.next_batch() is None
    clock.now = 0.05
    assert sched.next_batch().request_ids == ["a", "b"]


def test_woken_holds_return_before_their_deadline():
    """The driver wakes the holds when a request ends (its pages came back): held rows rejoin the
    end of their ready queue at once."""
    clock = Clock()
    sched = llm_scheduler(clock=clock)
    sched.add_ready_many(["a", "b"], "LLM", "decode")
    sched.hold(sched.next_batch(), ["a"])
    sched.add_ready_many(["c"], "LLM", "decode")
    sched.wake_holds()
    assert (sched.num_held(), sched.next_hold_deadline()) == (0, None)
    assert sched.next_batch().request_ids == ["b", "c", "a"]


def test_only_the_named_rows_are_held():
    clock = Clock()
    sched = llm_scheduler(clock=clock)
    sched.add_ready_many(["a", "b", "c"], "LLM", "decode")
    sched.hold(sched.next_batch(), ["b"])
    assert sched.next_batch().request_ids == ["a", "c"]
    clock.now = 1.0
    assert sched.next_batch().request_ids == ["b"]


def test_removal_drops_ready_and_held_rows_and_later_rows():
    sched = llm_scheduler()
    sched.add_ready_many(["a", "b", "c"], "LLM", "decode")
    sched.hold(sched.next_batch(), ["a"])
    sched.remove("a")
    sched.remove("b")
    sched.add_ready("b", "LLM", "prefill", 5)  # arrives after its removal: dropped
    assert sched.num_held() == 0 and sched.num_ready() == 1
    assert sched.next_batch().request_ids == ["c"]
    assert sched.is_idle()


def test_a_discarded_batch_gives_its_rows_back_once():
    sched = llm_scheduler()
    sched.add_ready_many(["a", "b"], "LLM", "decode")
    running = sched.next_batch()
    sched.add_ready("c", "LLM", "decode")
    spec = sched.speculate(running)
    assert spec.request_ids == ["a", "b", "c"]
    sched.hold(running, [])  # step N failed: a, b back to ready, none held
    sched.discard(spec)  # its continuing rows are already back; c returns
    assert sched.num_ready() == 3
    assert sorted(sched.next_batch().request_ids) == ["a", "b", "c"]


# ---------------------------------------------------------------- speculation


def test_a_chain_speculates_and_merges_fresh_rows_of_its_walk():
    sched = llm_scheduler()
    sched.add_ready_many(["a", "b"], "LLM", "decode")
    running = sched.next_batch()
    sched.add_ready("c", "LLM", "decode")
    spec = sched.speculate(running, ["b", "a"])
    assert spec.is_speculative and spec.request_ids == ["b", "a", "c"] and spec.label == "decode"


def test_a_chain_yields_to_a_prompt_of_another_walk():
    sched = llm_scheduler()
    sched.add_ready_many(["a", "b"], "LLM", "decode")
    running = sched.next_batch()
    sched.add_ready("p", "LLM", "prefill", 30)
    assert sched.speculate(running) is None
    sched.add_ready_many(running.request_ids, "LLM", "decode")
    batch = sched.next_batch()
    assert "p" in batch.request_ids and batch.mask == 3


def test_a_chain_merges_a_prompt_when_mixes_walks_is_on():
    sched = llm_scheduler(mixes_walks=True)
    sched.add_ready_many(["a", "b"], "LLM", "decode")
    running = sched.next_batch()
    sched.add_ready("p", "LLM", "prefill", 30)
    spec = sched.speculate(running)
    assert spec.request_ids == ["a", "b", "p"] and spec.label is None and spec.mask == 3


def test_a_newcomer_runs_in_the_next_step_while_a_chain_is_at_its_cap():
    """Bound: with one key, a prompt that arrives while a decode chain at its cap runs is in the
    very next step (the chain yields; the prompt is older than the rows coming back)."""
    for mixes_walks in (False, True):
        sched = llm_scheduler(mixes_walks=mixes_walks)
        sched.add_ready_many(["a", "b", "c", "d"], "LLM", "decode")
        running = sched.next_batch()
        assert len(running.request_ids) == 4  # at the cap
        sched.add_ready("p", "LLM", "prefill", 30)
        assert sched.speculate(running) is None  # cannot fit: yield
        sched.add_ready_many(running.request_ids, "LLM", "decode")
        assert "p" in sched.next_batch().request_ids


def test_a_fresh_row_pushed_out_by_the_cap_makes_the_chain_yield():
    sched = llm_scheduler()
    sched.add_ready_many(["a", "b", "c", "d"], "LLM", "decode")
    running = sched.next_batch()
    sched.add_ready("e", "LLM", "decode")
    assert sched.speculate(running) is None


def test_a_chain_yields_to_ready_work_of_another_key():
    codec = build_key("codec", ["chunk"], {"chunk": 4})
    sched = llm_scheduler(extra_keys=[codec])
    sched.add_ready_many(["a"], "LLM", "decode")
    running = sched.next_batch()
    sched.add_ready("a", "codec", "chunk")
    assert sched.speculate(running) is None


def test_speculation_drops_removed_rows_and_needs_an_on_device_loop():
    sched = llm_scheduler()
    sched.add_ready_many(["a", "b"], "LLM", "decode")
    running = sched.next_batch()
    sched.remove("a")
    assert sched.speculate(running).request_ids == ["b"]
    sched.add_ready("p", "LLM", "prefill", 8)
    prompt = sched.next_batch()
    assert prompt.label == "prefill" and sched.speculate(prompt) is None


def test_a_mixed_steps_chain_continues_only_rows_of_its_looping_walk():
    sched = llm_scheduler(mixes_walks=True)
    sched.add_ready_many(["a"], "LLM", "decode")
    sched.add_ready("p", "LLM", "prefill", 9)
    running = sched.next_batch()
    assert running.mask == 3
    spec = sched.speculate(running, ["a", "p"])  # p's next walk is a conductor transition
    assert spec.request_ids == ["a"] and spec.label == "decode"
