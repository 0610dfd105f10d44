"""The step token budget (scheduler/token_budget.py) against the row-by-row baseline's own
version of the rule, on random ready rows drained step by step; a cut row's rest comes back as
the conductor sends it (its tokens left), and every step stays within the budget."""
from hypothesis import given, settings, strategies as st
from plan_factory import assemble_worker, build_key

from mstar.plan.schema import DeploymentPlan, SpeculationPlan
from mstar.runtime.scheduler.baseline import BaselineScheduler
from mstar.runtime.scheduler.scheduler import WorkerScheduler

MORE = settings(settings.default, max_examples=max(200, settings.default.max_examples))


def drain(make, worker, rows: list[tuple[str, int]], budget: int) -> list[tuple]:
    sched = make(worker, DeploymentPlan(max_seq_len=4096, kv_pools=[]), lambda: 0.0)
    left = {}
    for i, (walk, tokens) in enumerate(rows):
        sched.add_ready(f"r{i}", "LLM", walk, tokens)
        left[f"r{i}"] = tokens
    log = []
    for _ in range(10_000):
        batch = sched.next_batch()
        if batch is None:
            break
        assert sum(batch.num_tokens) <= budget or batch.num_rows == 1
        log.append((batch.mask, tuple(batch.request_ids), tuple(batch.num_tokens), batch.padded_batch,
                    batch.token_bucket))
        for rid, walk, chunk in zip(batch.request_ids, batch.walks, batch.num_tokens):
            left[rid] -= chunk
            if left[rid] > 0:
                sched.add_ready(rid, "LLM", walk, left[rid])
    assert all(n == 0 for n in left.values()), "every token fed exactly once"
    return log


@MORE
@given(st.lists(st.tuples(st.sampled_from(["decode", "prefill"]), st.integers(1, 40)), min_size=1, max_size=24),
       st.integers(8, 64), st.integers(1, 40), st.integers(1, 8), st.one_of(st.none(), st.integers(1, 4)))
def test_budget_fit_matches_the_row_by_row_rule(rows, budget, chunk, decode_cap, prefill_limit):
    rows = [(walk, 1 if walk == "decode" else tokens) for walk, tokens in rows]
    key = build_key("LLM", ["decode", "prefill"], {"decode": decode_cap, "prefill": 4}, "mixed", 8,
                    {"prefill": prefill_limit} if prefill_limit else {}, mixed_capture=([1, 4, 8], [16, 64]))
    key = key.model_copy(update={"token_budget": budget, "chunk_sizes": {"prefill": chunk}})
    specs = [SpeculationPlan(node="LLM", walk=w, can_speculate=False, mixes_walks=False) for w in key.walks]
    worker = assemble_worker(0, [key], specs, [])
    assert drain(WorkerScheduler, worker, rows, budget) == drain(BaselineScheduler, worker, rows, budget)
