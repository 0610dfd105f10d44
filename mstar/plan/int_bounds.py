"""The integer sizes of a plan within the bounds mstarc holds a spec and a deployment to
(docs/limits.md), so that a plan edited by hand (its content hash recomputed) is refused by
`load_plan` instead of sizing a table, a loop or an allocation of the runtime by a number no
compiled plan holds: a tampered `layers` of 10**12 had the simulated engine build a tuple per
layer, a depth model's `depth` of 10**12 a frame of that many tokens a step (memory until the
machine ran out), a `recurrent.num_slots` of 10**12 a state tensor the torch engine could not
allocate (an internal error), and a loop's max_iters and default count of 10**12 a request that
never ended. Lower bounds where the runtime trusts them: a step token budget, chunk size or
repeat bound below 1 stalled every request or ran none.

The numbers are defined here, and compiler/memory_bounds.py imports them: one set of bounds for
what mstarc writes and what the loader takes (this package imports no compiler module).

    bound_problems(plan) -> list[str]          empty for a plan within the bounds
    loop_iteration_problems(walk) -> list[str] nested loops past MAX_LOOP_ITERATIONS (MW214); the
                                               walk's loops must nest (loop_nesting.py first)
"""
from __future__ import annotations

from typing import Iterator

from mstar.arg_types import shown
from mstar.plan.loop_nesting import loops_around_loops
from mstar.plan.schema import DeploymentPlan, KeyPlan, NodePlan, Plan, WalkPlan

# mstarc's bounds (compiler/memory_bounds.py reads them from here; MW123, MW214, MW304, MW411).
# The runtime builds one module per layer and keeps per-layer tables in Python: 32 times the
# deepest model of reference/mstar-models.md.
MAX_LAYERS = 4096
# Every other count or size: token ids, head counts and page indices are int32 on the device.
MAX_DIM = 2**31 - 1
# The product of the maximum iterations of nested loops: the steps one request may take in one
# walk. 2**30 steps at 10 us each is three hours of one request; 20 nested `loop max=3` is 3**20.
MAX_LOOP_ITERATIONS = 2**30
# Steps: rows a step may hold (caps, captured batch sizes), tokens a step may hold (token
# buckets, tokens per row); the plan keeps a direct lookup per row count, so these size tables.
MAX_STEP_ROWS = 65536
MAX_STEP_TOKENS = 2**20
# Graphs one capture family captures (batch sizes x token buckets), and walks one combined walk
# mixes (the plan lists a mixture for each of the 2**n subsets).
MAX_CAPTURE_KEYS = 4096
MAX_COMBINED_WALKS = 12
# KV pool sizes in a deployment: page indices are int32, and a page beyond 2**20 tokens is no page.
# A KV offload host pool (cpu_offload_pages) counts pages the same way.
MAX_NUM_PAGES = 2**31 - 1
MAX_PAGE_SIZE = 2**20
# Requests admitted at once (max_concurrent_requests) and recurrent state slots: a walk with neither
# a cap nor a capture is capped at max_concurrent_requests rows a step, so it is bounded as rows
# are (a larger one made the capture tables of an `eager_above` family 2**62 entries long); the
# slots default to it and must hold that many requests.
MAX_CONCURRENT_REQUESTS = MAX_STEP_ROWS


def _outside(value: int, low: int, high: int) -> bool:
    return not low <= value <= high


def _dims_problems(where: str, dims: dict) -> Iterator[str]:
    """MW123: a count or size at most MAX_DIM, layers at most MAX_LAYERS (list entries too)."""
    for name, value in dims.items():
        values = value if isinstance(value, list) else [value]
        ints = [v for v in values if isinstance(v, int) and not isinstance(v, bool)]
        limit = MAX_LAYERS if name == "layers" else MAX_DIM
        if ints and max(ints) > limit:
            yield f"{where}: dims {name}={shown(max(ints))} is past {limit} (mstarc's bound, MW123)"


def _node_problems(node: NodePlan) -> Iterator[str]:
    where = f"node {node.name}"
    yield from _dims_problems(where, node.dims)
    state = node.recurrent
    if state is not None:
        if _outside(state.num_layers, 1, MAX_LAYERS):
            yield f"{where}: recurrent num_layers {shown(state.num_layers)} is outside 1..{MAX_LAYERS}"
        for name in ("num_heads", "key_dim", "value_dim"):
            if _outside(getattr(state, name), 1, MAX_DIM):
                yield f"{where}: recurrent {name} {shown(getattr(state, name))} is outside 1..{MAX_DIM}"
        # recurrent_state_slots (at most MAX_CONCURRENT_REQUESTS) and the padding sink
        if _outside(state.num_slots, 2, MAX_CONCURRENT_REQUESTS + 1):
            yield (f"{where}: recurrent num_slots {shown(state.num_slots)} is outside 2..{MAX_CONCURRENT_REQUESTS + 1} "
                   "(the deployment's recurrent_state_slots and the padding sink)")
    for sub in node.submodels:
        yield from _dims_problems(f"{where}: sub-model {sub.name}", sub.dims)
        # a depth model builds a head per position and makes 1 + depth tokens a row a step
        if sub.samples is not None and _outside(sub.depth, 1, MAX_LAYERS):
            yield f"{where}: depth model {sub.name} has depth {shown(sub.depth)}, outside 1..{MAX_LAYERS}"
        elif sub.samples is None and sub.depth:
            yield f"{where}: sub-model {sub.name} samples nothing but has depth {shown(sub.depth)}"
    yield from (f"{where}: cross_kv {c.label} holds {shown(c.num_tokens)} tokens (at least 1)"
                for c in node.cross_kv if c.num_tokens < 1)


def _deployment_problems(deployment: DeploymentPlan) -> Iterator[str]:
    """MW304's bounds on what the plan keeps of the deployment."""
    if deployment.max_seq_len < 1:
        yield f"deployment max_seq_len {shown(deployment.max_seq_len)} is below 1"
    if deployment.max_concurrent_requests is not None and deployment.max_concurrent_requests > MAX_CONCURRENT_REQUESTS:
        yield (f"deployment max_concurrent_requests {shown(deployment.max_concurrent_requests)} is past "
               f"{MAX_CONCURRENT_REQUESTS}")
    follower_batches = deployment.max_consecutive_follower_batches
    if follower_batches < 1:
        yield f"deployment max_consecutive_follower_batches {shown(follower_batches)} is below 1"
    for pool in deployment.kv_pools:
        where = f"kv pool of {pool.node}"
        if pool.num_pages > MAX_NUM_PAGES:
            yield f"{where}: num_pages {shown(pool.num_pages)} is past {MAX_NUM_PAGES}"
        if pool.page_size > MAX_PAGE_SIZE:
            yield f"{where}: page_size {shown(pool.page_size)} is past {MAX_PAGE_SIZE}"
        if _outside(pool.host_pages, 0, MAX_NUM_PAGES):
            yield f"{where}: host_pages {shown(pool.host_pages)} is outside 0..{MAX_NUM_PAGES}"
        # MW322: the runtime sizes per-request tables (a whisper decoder's positions) by max_seq_len
        if pool.max_seq_len > pool.num_pages * pool.page_size:
            yield (f"{where}: max_seq_len {shown(pool.max_seq_len)} is more than its {pool.num_pages} pages x "
                   f"{pool.page_size} tokens hold (MW322)")


def _key_problems(where: str, key: KeyPlan) -> Iterator[str]:
    """MW411's step sizes; a token budget and chunk sizes of at least 1 (the deployment's
    max_step_tokens and max_prefill_chunk_size: below 1 no row ever fit a step)."""
    yield from (f"{where}: mixtures[{i}] has cap {shown(m.cap)}, past {MAX_STEP_ROWS} rows a step"
                for i, m in enumerate(key.mixtures) if m.cap > MAX_STEP_ROWS)
    for family in key.captures:
        what = f"{where}: capture {family.name}"
        if max(family.batch_sizes, default=0) > MAX_STEP_ROWS:
            yield f"{what}: batch size {shown(max(family.batch_sizes))} is past {MAX_STEP_ROWS} rows a step"
        if max(family.token_buckets, default=0) > MAX_STEP_TOKENS:
            yield f"{what}: token bucket {shown(max(family.token_buckets))} is past {MAX_STEP_TOKENS} tokens a step"
        if _outside(family.tokens_per_row, 1, MAX_STEP_TOKENS):
            yield f"{what}: tokens_per_row {shown(family.tokens_per_row)} is outside 1..{MAX_STEP_TOKENS}"
        if len(family.batch_sizes) * max(1, len(family.token_buckets)) > MAX_CAPTURE_KEYS:
            yield f"{what}: more than {MAX_CAPTURE_KEYS} graphs (batch sizes x token buckets)"
        largest = max(family.batch_sizes, default=0)
        if _outside(family.unroll_prompts, 0, largest):
            yield f"{what}: unroll_prompts {shown(family.unroll_prompts)} is outside 0..{largest} (its largest batch)"
    if key.token_budget is not None and key.token_budget < 1:
        yield f"{where}: token_budget {shown(key.token_budget)} is below 1"
    yield from (f"{where}: chunk_sizes[{walk}] is {shown(size)}, below 1" for walk, size in key.chunk_sizes.items()
                if size < 1)
    if key.chunk_context_scale is not None and key.chunk_context_scale < 1:
        yield f"{where}: chunk_context_scale {shown(key.chunk_context_scale)} is below 1"


def loop_iteration_problems(walk: WalkPlan) -> list[str]:
    """MW214: the maximum iterations of nested loops multiply into the steps one request may take;
    past MAX_LOOP_ITERATIONS (a loop's max and default count of 10**12) a request never ends."""
    problems = []
    for index, around in sorted(loops_around_loops(walk).items()):
        loop = walk.loops[index]
        product = loop.max_iters
        for outer in around:
            product *= walk.loops[outer].max_iters
        if product > MAX_LOOP_ITERATIONS:
            problems.append(f"walk {walk.name}: loop {loop.name} (max_iters {shown(loop.max_iters)}) and the loops "
                            f"around it run up to {shown(product)} iterations, past {MAX_LOOP_ITERATIONS} (MW214)")
    return problems


def bound_problems(plan: Plan) -> list[str]:
    """Sizes of nodes, the deployment, keys and repeats past mstarc's bounds (module docstring);
    the loops' are `loop_iteration_problems`, which needs nesting loops."""
    problems = [p for node in plan.nodes for p in _node_problems(node)]
    problems.extend(_deployment_problems(plan.deployment))
    for worker in plan.workers:
        if worker.capture_memory_bytes < 0:
            problems.append(f"worker {worker.rank}: capture_memory_bytes {worker.capture_memory_bytes} is below 0")
        for key in worker.keys:
            problems.extend(_key_problems(f"worker {worker.rank}: key {key.name}", key))
    problems.extend(f"partition {p.name} repeats at most {shown(p.repeat.max_rounds)} rounds (at least 1, MW216)"
                    for p in plan.partitions if p.repeat is not None and p.repeat.max_rounds < 1)
    return problems
