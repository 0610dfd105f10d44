"""The driver with the simulated engine on the generated plans."""
import pytest

from mstar.runtime.serve.driver import Driver, Workload
from mstar.runtime.serve.steps import recompose
from mstar.runtime.engine.sim import SimEngine
from mstar.runtime.serve.metrics import summarize
from mstar.runtime.conductor.request import Request
from mstar.runtime.serve.workload import generate

from runtime_plans import ROOT, generated

PLANS = sorted(p.stem for p in (ROOT / "generated").glob("*.plan"))


def run(plan, workload, **engine_kw):
    engine = SimEngine(plan, **engine_kw)
    driver = Driver(plan, engine)
    driver.run(workload)
    return driver


def small_workload(n=40, seed=0, arrival="poisson"):
    return generate(n, prompt_len=(4, 40), output_len=(1, 40), arrival=arrival, concurrency=6, rate=400.0, seed=seed)


@pytest.mark.parametrize("name", PLANS)
def test_every_generated_plan_runs_every_request_to_completion(name):
    driver = run(generated(name), small_workload())
    records = driver.conductor.records.values()
    assert len(records) == 40
    assert all(r.finish_reason in ("length", "stop") for r in records), {r.finish_reason for r in records}
    assert all(s.is_idle() for s in driver.schedulers.values())
    assert driver.engine.num_pages_held() == 0  # every KV page given back


def test_same_plan_workload_and_seed_give_the_same_schedule():
    def schedule():
        driver = run(generated("orpheus"), small_workload(seed=3))
        log = driver.log
        records = sorted((r.request.id, r.finish_s, tuple(r.output_tokens)) for r in driver.conductor.records.values())
        return list(zip(log.key, log.start_s, log.walk_rows, log.num_tokens)), records

    assert schedule() == schedule()


def test_out_of_memory_holds_rows_and_loses_nothing():
    plan = generated("orpheus")
    # 12 pages of 16 tokens: only about two requests fit at once, so steps fail and rows wait.
    driver = run(plan, small_workload(30, arrival="staggered"), num_pages=12)
    summary = summarize(driver.conductor.records.values(), driver.log, 0.0)
    assert summary["num_oom_steps"] > 0
    assert summary["num_completed"] == 30
    for record in driver.conductor.records.values():
        assert record.num_output_tokens == record.request.max_tokens


def test_injected_out_of_memory_is_retried():
    plan = generated("llama")
    failures = {"count": 0}

    def every_third_step(step):
        failures["count"] += 1
        return [step.rows[0].request_id] if failures["count"] % 3 == 0 else []

    driver = run(plan, small_workload(20), inject_oom=every_third_step)
    assert all(r.finish_reason == "length" for r in driver.conductor.records.values())
    assert sum(driver.log.is_oom) > 0


def test_an_injected_failure_writes_nothing_before_its_retry(monkeypatch):
    """A row a test fails (`inject_oom`) is neither reserved nor committed: it was committed, then
    reported failed, so its retried prompt was written twice (20 tokens, then the rest of the
    budget's 3, and the decode rows wrote none)."""
    from mstar.runtime.engine.kv import pages

    plan = generated("llama_chunked")
    commits = []
    commit = pages.PagePool.commit

    def recorded(self, key, num_tokens, tokens=None):
        commits.append((self._seqs[key].num_tokens, num_tokens))
        return commit(self, key, num_tokens, tokens)

    monkeypatch.setattr(pages.PagePool, "commit", recorded)
    fired = []

    def first_prefill(step):
        if not fired and any(row.walk == "prefill" for row in step.rows):
            fired.append(step.rows[0].request_id)
            return fired[:1]
        return []

    driver = run(plan, Workload([Request(id="a", prompt_tokens=list(range(1, 21)), max_tokens=3)],
                                closed_concurrency=1), inject_oom=first_prefill)
    assert fired and driver.conductor.records["a"].finish_reason == "length"
    assert commits == [(0, 20), (20, 1), (21, 1)]


def test_oversized_request_fails_alone_with_a_reason():
    plan = generated("orpheus")
    requests = [Request(id=f"r{i}", prompt_tokens=[1] * 10, max_tokens=20) for i in range(5)]
    requests.append(Request(id="huge", prompt_tokens=[1] * 400, max_tokens=10))
    driver = run(plan, Workload(requests, closed_concurrency=3), num_pages=16)
    records = driver.conductor.records
    assert records["huge"].finish_reason.startswith("error: can never fit")
    assert all(records[f"r{i}"].finish_reason == "length" for i in range(5))


def test_the_sim_refuses_what_the_torch_engine_refuses():
    """A prompt token id outside the spec's vocabulary, and prompt + max_tokens past max_seq_len:
    the torch engine's decoders refuse both at admission; the simulated engine ran them."""
    plan = generated("llama")
    vocab, max_seq_len = plan.nodes[0].dims["vocab"], plan.deployment.kv_pools[0].max_seq_len
    requests = [Request(id="ok", prompt_tokens=[1, 2, 3], max_tokens=4),
                Request(id="vocab", prompt_tokens=[1, vocab], max_tokens=4),
                Request(id="long", prompt_tokens=[1] * 8, max_tokens=max_seq_len)]
    records = run(plan, Workload(requests, closed_concurrency=3)).conductor.records
    assert records["ok"].finish_reason == "length"
    assert f"prompt token id {vocab} is outside the vocabulary" in records["vocab"].finish_reason
    assert f"exceeds max_seq_len {max_seq_len}" in records["long"].finish_reason
    from mstar.runtime.engine.torch_engine import TorchEngine

    torch_engine = TorchEngine(plan)
    for request in requests[1:]:  # neither is about memory: neither says it "can never fit"
        reason = torch_engine.add_request(request.id, request)
        assert "cannot run" in reason and "never fit" not in reason
        finish_reason = records[request.id].finish_reason
        assert "cannot run" in finish_reason and "never fit" not in finish_reason


def test_row_error_fails_one_request_and_the_rest_finish():
    plan = generated("orpheus")
    driver = run(plan, small_workload(20), inject_error={"req-000004": "NaN in logits"})
    records = driver.conductor.records
    assert records["req-000004"].finish_reason == "error: NaN in logits"
    assert sum(r.finish_reason == "length" for r in records.values()) == 19


def test_tp_followers_run_the_leaders_batches():
    """Every leader batch of the TP node runs on the follower, whole: the same rows in the same
    order (lockstep ranks must lay out a step alike), and in the leader's order of steps."""
    plan = generated("orpheus_tp2")
    driver = Driver(plan, SimEngine(plan))
    tp_ranks = {rank for w in plan.workers for g in w.tp_groups if g.node == "LLM" for rank in g.ranks}
    leader_rank = next(g.leader for w in plan.workers for g in w.tp_groups if g.node == "LLM")
    ran = {rank: [] for rank in tp_ranks}
    add = driver.log.add

    def record(launch, *args):
        batch = launch.batch
        if batch.node == "LLM":
            ran[launch.worker].append((batch.key, batch.mask, tuple(batch.request_ids), tuple(batch.walks),
                                       batch.is_follower))
        return add(launch, *args)

    driver.log.add = record
    driver.run(small_workload(20))
    assert all(r.finish_reason == "length" for r in driver.conductor.records.values())
    leader = [b[:4] for b in ran[leader_rank]]
    assert leader and not any(b[4] for b in ran[leader_rank])
    for rank in tp_ranks - {leader_rank}:
        assert all(b[4] for b in ran[rank])  # a follower never composes the TP node's steps
        assert [b[:4] for b in ran[rank]] == leader  # every leader batch, whole, in order


def test_speculation_chains_decode_steps():
    driver = run(generated("llama"), small_workload(20, arrival="closed"))
    assert sum(driver.log.is_speculative) > 0
    assert all(r.finish_reason == "length" for r in driver.conductor.records.values())


def test_cancellation_mid_run():
    plan = generated("orpheus")
    workload = small_workload(20)
    arrival = {r.id: r.arrival_s for r in workload.requests}
    workload.cancellations = [
        (arrival["req-000001"] + 0.001, "req-000001"),  # while it runs
        (0.0, "req-000019"),  # before it arrives: ignored
        (10.0, "req-000002"),  # after it finished: ignored
    ]
    driver = run(plan, workload)
    records = driver.conductor.records
    assert records["req-000001"].finish_reason == "cancelled"
    assert records["req-000019"].finish_reason == records["req-000002"].finish_reason == "length"
    assert all(r.is_finished for r in records.values())
    assert driver.engine.num_pages_held() == 0


def test_a_step_that_lost_a_walk_to_stale_rows_runs_that_mixture_eagerly():
    from mstar.runtime.step import Step, StepRow

    plan = generated("orpheus")
    key = next(k for k in plan.workers[0].keys if k.name == "LLM:mixed")
    mixed = next(e for e in key.mixtures if len(e.walks) == 2)
    step = Step(worker=0, key=key.name, node="LLM", mask=mixed.mask, label=None,
                rows=[StepRow("r1", "decode", 1, 9)], attention=mixed.attention, capture=mixed.capture,
                padded_batch=4, token_bucket=128)
    recompose(key, step)
    decode = next(e for e in key.mixtures if e.walks == ["decode"])
    assert (step.mask, step.label, step.attention) == (decode.mask, "decode", decode.attention)
    assert (step.capture, step.padded_batch, step.token_bucket) == (None, 0, 0)


@pytest.mark.parametrize("name", PLANS)
def test_the_call_tables_route_rows_to_the_ranks_that_place_them(name):
    # The driver sends a ready row to the instances the walk tables list for (node, walk): they
    # must be exactly the ranks whose placements hold the pair, a TP group's leader first.
    plan = generated(name)
    driver = Driver(plan, SimEngine(plan))
    for walk in plan.walks:
        for call in walk.calls:
            placed = {w.rank for w in plan.workers if f"{call.node}/{walk.name}" in w.placements}
            instances = driver.routing.instances[(call.node, walk.name)]
            assert sorted(r for instance in instances for r in instance) == sorted(placed)
            for instance in instances:
                groups = [g for w in plan.workers for g in w.tp_groups
                          if g.node == call.node and instance[0] in g.ranks]
                assert all(g.leader == instance[0] for g in groups)


class _LeakingEngine(SimEngine):
    """A sim engine whose pool never has room: every row of every step fails allocation."""

    def run_step(self, step):
        result = super().run_step(step)
        result.rows = []
        result.allocation_failed = [row.request_id for row in step.rows]
        return result


@pytest.mark.parametrize("closed", [None, 2])
def test_rows_held_forever_fail_as_stalled_instead_of_hanging(closed):
    plan = generated("orpheus")
    driver = Driver(plan, _LeakingEngine(plan))
    requests = [Request(id=f"r{i}", prompt_tokens=[1, 2, 3], max_tokens=4) for i in range(3)]
    driver.run(Workload(requests, closed_concurrency=closed))
    records = driver.conductor.records
    assert len(records) == 3 and all("stalled: its rows were held for memory" in r.finish_reason
                                     for r in records.values())


def _two_replicas(policy):
    """The llama plan with its LLM placed on two data-parallel replicas (ranks 0 and 1)."""
    plan = generated("llama")
    walks = [w.model_copy(update={"calls": [c.model_copy(update={"instances": [[0], [1]]}) for c in w.calls]})
             for w in plan.walks]
    workers = [plan.workers[0], plan.workers[0].model_copy(update={"rank": 1})]
    deployment = plan.deployment.model_copy(update={"replica_policy": policy})
    return plan.model_copy(update={"walks": walks, "workers": workers, "deployment": deployment})


@pytest.mark.parametrize("policy", ["request_hash", "round_robin"])
def test_a_request_keeps_its_replica_and_the_policy_picks_it(policy):
    import zlib

    plan = _two_replicas(policy)
    ranks: dict[str, set[int]] = {}

    class Where(SimEngine):
        def run_step(self, step):
            for row in step.rows:
                ranks.setdefault(row.request_id, set()).add(step.worker)
            return super().run_step(step)

    driver = Driver(plan, Where(plan))
    requests = [Request(id=f"r{i}", prompt_tokens=[1, 2, 3], max_tokens=5) for i in range(8)]
    driver.run(Workload(requests))
    assert all(r.finish_reason == "length" for r in driver.conductor.records.values())
    assert all(len(found) == 1 for found in ranks.values())  # prefill and decode on one replica
    picked = {rid: found.pop() for rid, found in ranks.items()}
    if policy == "request_hash":
        assert picked == {rid: zlib.crc32(rid.encode()) % 2 for rid in picked}
    else:  # in the order requests first needed a replica: alternating
        assert sorted(picked.values()) == [0, 0, 0, 0, 1, 1, 1, 1]


def test_an_engine_that_cannot_take_a_request_fails_it_alone():
    """An engine whose `add_request` raises (a value it could not convert overflowed) fails that
    request alone, refused; the run goes on and the others finish (the exception stopped the run
    loop, and with it every request of a server)."""
    plan = generated("llama")

    class Raising(SimEngine):
        def add_request(self, request_id, spec):
            if request_id == "bad":
                raise OverflowError("cannot convert float infinity to integer")
            return super().add_request(request_id, spec)

    driver = Driver(plan, Raising(plan))
    requests = [Request(id=i, prompt_tokens=[1, 2, 3], max_tokens=4) for i in ("a", "bad", "b")]
    driver.run(Workload(requests))
    records = driver.conductor.records
    assert records["bad"].is_refused and records["bad"].finish_reason == (
        "error: the engine could not take the request (OverflowError: cannot convert float infinity to integer)")
    assert records["a"].finish_reason == records["b"].finish_reason == "length"


def test_a_request_whose_rows_never_reach_a_scheduler_fails_as_stalled_and_the_run_returns():
    """Nothing in flight, nothing held or due, and a request still active (its rows were lost on
    the way to the scheduler here): the run fails it as stalled rather than spinning, and the
    other requests finish."""
    import threading
    from itertools import compress

    plan = generated("llama")
    driver = Driver(plan, SimEngine(plan))
    for scheduler in driver.schedulers.values():
        def dropping(request_ids, node, walk, num_tokens=1, classes=None, guided=None, contexts=None,
                     add=scheduler.add_ready_many):
            keep = [request_id != "lost" for request_id in request_ids]
            kept = lambda values: values if values is None or isinstance(values, int) else list(compress(values, keep))  # noqa: E731
            add(kept(request_ids), node, walk, kept(num_tokens), kept(classes), kept(guided), kept(contexts))

        scheduler.add_ready_many = dropping
    requests = [Request(id=rid, prompt_tokens=[1, 2, 3], max_tokens=4) for rid in ("a", "lost", "b")]
    runner = threading.Thread(target=driver.run, args=(Workload(requests),), daemon=True)
    runner.start()
    runner.join(15)
    if runner.is_alive():
        driver.stop()
        runner.join(10)
        pytest.fail("the run did not return with a request that can never run")
    records = driver.conductor.records
    assert records["lost"].finish_reason == "error: stalled: no row of the request can run"
    assert records["a"].finish_reason == records["b"].finish_reason == "length"
