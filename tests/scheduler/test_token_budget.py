"""The step token budget (scheduler/token_budget.py) against the row-by-row baseline's own
version of the rule, on random ready rows drained step by step; a cut row's rest comes back as
the conductor sends it (its tokens left), and every step stays within the budget."""
from hypothesis import given, settings, strategies as st
from plan_factory import assemble_worker, build_key

from mstar.plan.schema import DeploymentPlan, SpeculationPlan
from mstar.runtime.scheduler.baseline import BaselineScheduler
from mstar.runtime.scheduler.scheduler import WorkerScheduler
from mstar.runtime.scheduler.token_budget import chunk_within

MORE = settings(settings.default, max_examples=max(200, settings.default.max_examples))


def drain(make, worker, rows: list[tuple[str, int]], budget: int, first_context: int = 0) -> list[tuple]:
    """Every row's tokens through the scheduler, a cut row's rest coming back with its depth (the
    prompt's first row after `first_context` cached tokens, as after a prefix-cache hit)."""
    sched = make(worker, DeploymentPlan(max_seq_len=4096, kv_pools=[]), lambda: 0.0)
    caps = {entry.mask: entry.cap for entry in worker.keys[0].mixtures}
    left, fed = {}, {}
    for i, (walk, tokens) in enumerate(rows):
        context = first_context if walk == "prefill" else 0
        sched.add_ready_many([f"r{i}"], "LLM", walk, [tokens], contexts=[context])
        left[f"r{i}"], fed[f"r{i}"] = tokens, context
    log = []
    for _ in range(10_000):
        batch = sched.next_batch()
        if batch is None:
            break
        assert sum(batch.num_tokens) <= budget or batch.num_rows == 1
        assert batch.num_rows <= caps[batch.mask], f"{batch.num_rows} rows over the cap {caps[batch.mask]}"
        log.append((batch.mask, tuple(batch.request_ids), tuple(batch.num_tokens), batch.padded_batch,
                    batch.token_bucket))
        for rid, walk, chunk in zip(batch.request_ids, batch.walks, batch.num_tokens):
            left[rid] -= chunk
            fed[rid] += chunk
            if left[rid] > 0:
                sched.add_ready_many([rid], "LLM", walk, [left[rid]], contexts=[fed[rid]])
    assert all(n == 0 for n in left.values()), "every token fed exactly once"
    return log


SCALES = st.one_of(st.none(), st.integers(1, 200))  # KeyPlan.chunk_context_scale (None: every token one)


@MORE
@given(st.lists(st.tuples(st.sampled_from(["decode", "prefill"]), st.integers(1, 40)), min_size=1, max_size=24),
       st.integers(8, 64), st.integers(1, 40), st.integers(1, 8), st.one_of(st.none(), st.integers(1, 4)), SCALES,
       st.integers(0, 300))
def test_budget_fit_matches_the_row_by_row_rule(rows, budget, chunk, decode_cap, prefill_limit, scale, cached):
    rows = [(walk, 1 if walk == "decode" else tokens) for walk, tokens in rows]
    key = build_key("LLM", ["decode", "prefill"], {"decode": decode_cap, "prefill": 4}, "mixed", 8,
                    {"prefill": prefill_limit} if prefill_limit else {}, mixed_capture=([1, 4, 8], [16, 64]))
    key = key.model_copy(update={"token_budget": budget, "chunk_sizes": {"prefill": chunk},
                                 "chunk_context_scale": scale})
    specs = [SpeculationPlan(node="LLM", walk=w, can_speculate=False, mixes_walks=False) for w in key.walks]
    worker = assemble_worker(0, [key], specs, [])
    assert (drain(WorkerScheduler, worker, rows, budget, cached)
            == drain(BaselineScheduler, worker, rows, budget, cached))


@MORE
@given(st.lists(st.tuples(st.sampled_from(["decode", "prefill"]), st.integers(1, 40)), min_size=1, max_size=24),
       st.integers(1, 64), st.integers(1, 8), st.one_of(st.none(), st.integers(1, 4)))
def test_whole_rows_keep_to_the_budget_and_one_too_large_runs_alone(rows, budget, decode_cap, prefill_limit):
    """A walk whose prompts are never cut (no chunk size) under a step budget, down to budgets
    smaller than one prompt: whole rows join while they fit (oldest first), a row larger than
    the whole budget runs alone (the only way it can run), a step the budget leaves with one walk
    keeps that walk's own cap, and every row runs; as the row-by-row baseline decides."""
    rows = [(walk, 1 if walk == "decode" else tokens) for walk, tokens in rows]
    key = build_key("LLM", ["decode", "prefill"], {"decode": decode_cap, "prefill": 4}, "mixed", 8,
                    {"prefill": prefill_limit} if prefill_limit else {}, mixed_capture=([1, 4, 8], [16, 64]))
    key = key.model_copy(update={"token_budget": budget})
    specs = [SpeculationPlan(node="LLM", walk=w, can_speculate=False, mixes_walks=False) for w in key.walks]
    worker = assemble_worker(0, [key], specs, [])
    assert drain(WorkerScheduler, worker, rows, budget) == drain(BaselineScheduler, worker, rows, budget)


@MORE
@given(st.integers(1, 10_000), st.integers(1, 10_000), st.integers(1, 10_000), st.integers(0, 100_000),
       st.integers(0, 20_000))
def test_a_chunk_takes_what_its_depth_leaves_and_never_starves(left, tokens, size, context, scale):
    """chunk_within: at least one token while any budget is left; the largest chunk whose
    weighted cost, ceil(chunk x (scale + context) / scale), fits what is left (one token may pass
    it: a deep prompt still advances); every token counts one without a scale or a context."""
    chunk, cost = chunk_within(left, tokens, size, context, scale)
    assert 1 <= chunk <= min(tokens, size, left) and cost >= chunk
    if not scale or not context:
        assert (chunk, cost) == (min(tokens, size, left), chunk)
        return
    weighted = lambda n: -(-n * (scale + context) // scale)  # noqa: E731
    assert cost == weighted(chunk)
    assert cost <= left or chunk == 1
    assert chunk == min(tokens, size) or weighted(chunk + 1) > left
    assert chunk_within(0, tokens, size, context, scale) == (0, 0)


def test_deeper_chunks_of_one_prompt_get_fewer_tokens():
    """A prompt alone under a budget that counts context: each chunk is the budget x N / (N + c)
    at its depth c, so they shrink as the prompt goes deeper, and none takes more than the budget."""
    key = build_key("LLM", ["decode", "prefill"], {"decode": 8, "prefill": 4}, "mixed", 8, {},
                    mixed_capture=([1, 4, 8], [16, 64]))
    key = key.model_copy(update={"token_budget": 64, "chunk_sizes": {"prefill": 64}, "chunk_context_scale": 100})
    specs = [SpeculationPlan(node="LLM", walk=w, can_speculate=False, mixes_walks=False) for w in key.walks]
    log = drain(WorkerScheduler, assemble_worker(0, [key], specs, []), [("prefill", 600)], 64)
    chunks = [step[2][0] for step in log]
    assert sum(chunks) == 600 and chunks[0] == 64
    depth = 0
    for chunk in chunks[:-1]:
        assert chunk == min(64, max(1, 64 * 100 // (100 + depth)))
        depth += chunk
    assert chunks[:-1] == sorted(chunks[:-1], reverse=True) and chunks[-2] < chunks[0] // 4


def test_a_cut_walk_left_alone_keeps_its_cap_and_one_chunk_a_row():
    """Two cut walks composed into a mixed step (cap 8): the first walk's chunks take the whole
    budget, so the second's row gets no token and the step is the first walk's alone, under its
    own cap of 1. The chunks kept are the rows kept: one chunk per row, never a chunk of a row the
    cap left out (the step's token counts and rows would disagree)."""
    key = build_key("LLM", ["a", "b"], {"a": 1, "b": 4}, "mixed", 8, mixed_capture=([1, 4, 8], [16, 64]))
    key = key.model_copy(update={"token_budget": 16, "chunk_sizes": {"a": 8, "b": 8}})
    specs = [SpeculationPlan(node="LLM", walk=w, can_speculate=False, mixes_walks=False) for w in key.walks]
    sched = WorkerScheduler(assemble_worker(0, [key], specs, []), DeploymentPlan(max_seq_len=4096, kv_pools=[]),
                            lambda: 0.0)
    for request_id, walk in (("a1", "a"), ("b1", "b"), ("a2", "a")):
        sched.add_ready_many([request_id], "LLM", walk, [40])
    batch = sched.next_batch()
    assert batch is not None and batch.request_ids == ["a1"] and batch.num_tokens == [8]

def _chunk_worker(budget: int, chunk: int, decode_cap: int, scale: int | None = None):
    key = build_key("LLM", ["decode", "prefill"], {"decode": decode_cap, "prefill": 4}, "mixed", 8, {},
                    mixed_capture=([1, 4, 8], [16, 64]))
    key = key.model_copy(update={"token_budget": budget, "chunk_sizes": {"prefill": chunk},
                                 "chunk_context_scale": scale})
    specs = [SpeculationPlan(node="LLM", walk="decode", can_speculate=True, mixes_walks=True),
             SpeculationPlan(node="LLM", walk="prefill", can_speculate=False, mixes_walks=False)]
    return assemble_worker(0, [key], specs, [])


def _shape(batch) -> tuple:
    return (batch.mask, tuple(batch.request_ids), tuple(batch.walks), tuple(batch.num_tokens), batch.label,
            batch.capture, batch.padded_batch, batch.token_bucket, batch.attention)


@MORE
@given(st.integers(1, 7), st.integers(2, 300), st.integers(8, 64), st.integers(1, 40), st.integers(1, 8), SCALES,
       st.integers(0, 300))
def test_a_chain_past_a_chunk_step_is_the_step_built_after_it(num_decode, prompt, budget, chunk, decode_cap, scale,
                                                              cached):
    """Step N holds decode rows and a prompt's chunk with chunks left: the chain's N+1 (the decode
    rows and the prompt's next chunk, speculation.py) stays within the budget and the mixture's
    cap, and when N took every ready row it is the step `next_batch` builds once N's rows came back
    ready, as the conductor sends them (decode rows, then the prompt's tokens left at its new
    depth, which the chain knows without being told). (With rows left behind by N, a chain's
    continuing rows lead their walk, as for any chain.)"""
    worker = _chunk_worker(budget, chunk, decode_cap, scale)
    made = [WorkerScheduler(worker, DeploymentPlan(max_seq_len=4096, kv_pools=[]), lambda: 0.0) for _ in range(2)]
    for sched in made:
        for i in range(num_decode):
            sched.add_ready(f"d{i}", "LLM", "decode", 1)
        sched.add_ready_many(["p"], "LLM", "prefill", [prompt], contexts=[cached])
    running = [sched.next_batch() for sched in made]
    assert running[0] is not None and _shape(running[0]) == _shape(running[1])
    step = running[0]
    fed = dict(zip(step.request_ids, step.num_tokens))
    if "p" not in fed or fed["p"] >= prompt:
        return  # the prompt is not cut in N (no room, or its last chunk): nothing past a chunk step
    decode = [rid for rid, walk in zip(step.request_ids, step.walks) if walk == "decode"]
    if not decode:
        return  # no decode row loops on: nothing to chain
    spec = made[0].speculate(step, decode, cut=[("p", prompt - fed["p"])])
    baseline = made[1]
    for rid, walk in zip(step.request_ids, step.walks):
        if walk == "decode":
            baseline.add_ready(rid, "LLM", walk, 1)
        else:
            baseline.add_ready_many([rid], "LLM", walk, [prompt - fed["p"]], contexts=[cached + fed["p"]])
    expected = baseline.next_batch()
    assert expected is not None
    if spec is None:
        return
    assert sum(spec.num_tokens) <= budget and spec.is_speculative
    assert spec.num_rows <= worker.keys[0].mixtures[spec.mask].cap
    if step.num_rows == num_decode + 1:  # N took every ready row
        assert _shape(spec) == _shape(expected)
        # and the chain after it again (N+2 past N+1's chunk), from what the scheduler kept
        after = dict(zip(spec.request_ids, spec.num_tokens))
        if "p" in after and after["p"] < prompt - fed["p"]:
            rest = prompt - fed["p"] - after["p"]
            chained = made[0].speculate(spec, decode, cut=[("p", rest)])
            for rid, walk in zip(expected.request_ids, expected.walks):
                if walk == "decode":
                    baseline.add_ready(rid, "LLM", walk, 1)
                else:
                    baseline.add_ready_many([rid], "LLM", walk, [rest], contexts=[cached + fed["p"] + after["p"]])
            again = baseline.next_batch()
            if chained is not None and again is not None:
                assert _shape(chained) == _shape(again)


@MORE
@given(st.lists(st.integers(2, 300), min_size=1, max_size=3), st.integers(8, 64), st.integers(1, 40), SCALES,
       st.integers(0, 300))
def test_a_chain_of_prompt_chunks_alone_is_the_step_built_after_it(prompts, budget, chunk, scale, cached):
    """Prompts prefilling while nothing decodes: when every prompt row of N is cut with chunks
    left, the chain's N+1 holds their next chunks (speculation.py, `_prompt_chain`), the step
    `next_batch` builds once N's rows came back ready; and the chain goes on past N+1 the same way.
    When one takes its last chunk in N, or N left a prompt waiting, it yields."""
    worker = _chunk_worker(budget, chunk, 8, scale)
    made = [WorkerScheduler(worker, DeploymentPlan(max_seq_len=4096, kv_pools=[]), lambda: 0.0) for _ in range(2)]
    ids = [f"p{i}" for i in range(len(prompts))]
    for sched in made:
        sched.add_ready_many(ids, "LLM", "prefill", prompts, contexts=[cached] * len(ids))
    left = dict(zip(ids, prompts))
    depth = dict.fromkeys(ids, cached)
    step = made[0].next_batch()
    assert step is not None and _shape(step) == _shape(made[1].next_batch())
    for _ in range(3):  # N, then the chains past N+1 and N+2
        fed = dict(zip(step.request_ids, step.num_tokens))
        cut = [(rid, left[rid] - fed[rid]) for rid in step.request_ids if left[rid] > fed[rid]]
        spec = made[0].speculate(step, [], cut=cut)
        baseline = made[1]
        for rid in step.request_ids:
            left[rid] -= fed[rid]
            depth[rid] += fed[rid]
            if left[rid]:
                baseline.add_ready_many([rid], "LLM", "prefill", [left[rid]], contexts=[depth[rid]])
        expected = baseline.next_batch()
        in_flight = sum(1 for rid in ids if left[rid] + fed.get(rid, 0))  # prompts not done before N
        if len(cut) < len(step.request_ids) or len(step.request_ids) < in_flight:
            assert spec is None  # a last chunk in N, or a prompt left waiting: N+1 is built after N
            return
        assert expected is not None
        if spec is None:  # the budget left no room for some prompt's next chunk: it yields
            assert len(expected.request_ids) < len(cut)
            return
        assert spec.is_speculative and sum(spec.num_tokens) <= budget
        assert _shape(spec) == _shape(expected)
        step = spec


def test_a_chain_yields_past_a_last_chunk_and_behind_a_waiting_prompt():
    worker = _chunk_worker(16, 16, 8)
    sched = WorkerScheduler(worker, DeploymentPlan(max_seq_len=4096, kv_pools=[]), lambda: 0.0)
    for i in range(3):
        sched.add_ready(f"d{i}", "LLM", "decode", 1)
    sched.add_ready("p", "LLM", "prefill", 40)
    step = sched.next_batch()
    assert step is not None and dict(zip(step.request_ids, step.num_tokens))["p"] == 13
    decode = ["d0", "d1", "d2"]
    # the prompt's last chunk: its first decode row is ready only after N
    assert sched.speculate(step, decode, cut=[]) is None
    sched.add_ready("q", "LLM", "prefill", 30)  # another prompt waits: the FIFO order decides after N
    assert sched.speculate(step, decode, cut=[("p", 27)]) is None
    sched.remove("q")
    spec = sched.speculate(step, decode, cut=[("p", 27)])
    assert spec is not None
    assert list(zip(spec.request_ids, spec.num_tokens)) == [("d0", 1), ("d1", 1), ("d2", 1), ("p", 13)]


@MORE
@given(st.integers(1, 8), st.integers(2, 40), st.integers(1, 3))
def test_without_cut_prompts_the_oldest_ready_row_is_in_every_step(num_decode, num_prompts, prompt_tokens):
    """llama's key lists prefill before decode. Its prompts uncut under a budget, whole rows were
    fitted in walk order: prompts that arrived after the decode rows filled every step while they
    kept coming (a sim run: decode stopped for 1.8 s, 999 steps). Oldest first, the decode rows
    that became ready before the prompts run in the next step, as the starvation bound says."""
    key = build_key("LLM", ["prefill", "decode"], {"prefill": 8, "decode": 8}, "mixed", 16, {},
                    mixed_capture=([1, 4, 8, 16], [16, 64]))
    key = key.model_copy(update={"token_budget": 4})
    specs = [SpeculationPlan(node="LLM", walk=w, can_speculate=False, mixes_walks=False) for w in key.walks]
    worker = assemble_worker(0, [key], specs, [])
    for make in (WorkerScheduler, BaselineScheduler):
        sched = make(worker, DeploymentPlan(max_seq_len=4096, kv_pools=[]), lambda: 0.0)
        decode = [f"d{i}" for i in range(num_decode)]
        sched.add_ready_many(decode, "LLM", "decode", [1] * num_decode)
        sched.add_ready_many([f"p{i}" for i in range(num_prompts)], "LLM", "prefill", [prompt_tokens] * num_prompts)
        batch = sched.next_batch()
        assert batch is not None and "d0" in batch.request_ids, make
