"""Property test: random traces through the driver, scheduler and simulated engine.

Over random arrivals, prompt and output lengths, routes, small KV pools, injected out-of-memory
failures of single rows (partial steps: the other rows of the step run), row errors and
cancellations: every submitted request finishes exactly once, either
completed or failed with a reason that was caused on purpose; no row is lost or run twice (for
every request and kv node, each row's context_len is the sum of the tokens its earlier rows fed);
every KV page and every scheduler row is given back at the end.
"""
from hypothesis import given, strategies as st

from mstar.runtime.serve.driver import Driver, Workload
from mstar.runtime.engine.sim import SimEngine
from mstar.runtime.conductor.request import Request

from runtime_plans import generated

PLAN_NAMES = ["orpheus", "orpheus_tp2", "orpheus_pd_disaggregated", "qwen3_omni", "bagel", "llama"]
_PLANS = {}
BAGEL_ROUTES = [None, ["prefill_text", "decode"], ["prefill_vit", "prefill_text", "image_gen"],
                ["prefill_vae", "prefill_vit", "prefill_text", "decode"]]
OMNI_ROUTES = [None, {"Thinker": ["prefill_text", "prefill_vision", "thinker_decode"]},
               {"Talker": [], "Code2Wav": []}]


def plan_named(name):
    if name not in _PLANS:
        _PLANS[name] = generated(name)
    return _PLANS[name]


request_st = st.tuples(
    st.integers(1, 60),  # prompt length
    st.integers(1, 40),  # max tokens
    st.floats(0.0, 0.01),  # gap to the previous arrival (s)
    st.integers(0, 3),  # route choice
)


@st.composite
def traces(draw):
    name = draw(st.sampled_from(PLAN_NAMES))
    requests = draw(st.lists(request_st, min_size=1, max_size=12))
    return {
        "name": name,
        "requests": requests,
        "num_pages": draw(st.one_of(st.none(), st.integers(4, 40))),
        "oom_steps": draw(st.sets(st.integers(1, 200), max_size=20)),
        "errors": draw(st.sets(st.integers(0, 11), max_size=3)),
        "cancels": draw(st.lists(st.tuples(st.floats(0.0, 0.1), st.integers(0, 11)), max_size=3)),
        "closed": draw(st.one_of(st.none(), st.integers(1, 5))),
    }


def build(trace):
    requests = []
    now = 0.0
    for index, (prompt, max_tokens, gap, route_choice) in enumerate(trace["requests"]):
        now += gap
        route = {}
        if trace["name"] == "bagel" and BAGEL_ROUTES[route_choice]:
            route = {"LLM": BAGEL_ROUTES[route_choice]}
        if trace["name"] == "qwen3_omni":
            route = dict(OMNI_ROUTES[route_choice % 3] or {})
        requests.append(Request(id=f"r{index}", prompt_tokens=list(range(prompt)), max_tokens=max_tokens,
                                arrival_s=now, route=route))
    ids = [r.id for r in requests]
    cancels = [(t, ids[i % len(ids)]) for t, i in trace["cancels"]]
    return Workload(requests, closed_concurrency=trace["closed"], cancellations=cancels)


class RecordingSim(SimEngine):
    """The simulated engine, remembering every row of every step that ran."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.rows = []

    def run_step(self, step):
        result = super().run_step(step)
        # Partial steps: the rows that got memory ran; the allocation_failed ones did not.
        failed = set(result.allocation_failed)
        self.rows.extend(
            (step.node, row.request_id, row.num_tokens, row.context_len)
            for row in step.rows if row.request_id not in failed
        )
        return result


@given(traces())
def test_random_traces_lose_and_duplicate_nothing(trace):
    plan = plan_named(trace["name"])
    errors = {f"r{i}": "injected" for i in trace["errors"] if i < len(trace["requests"])}
    counter = {"steps": 0}

    def inject_oom(step):
        counter["steps"] += 1
        return [step.rows[0].request_id] if counter["steps"] in trace["oom_steps"] else []

    engine = RecordingSim(plan, num_pages=trace["num_pages"], inject_oom=inject_oom, inject_error=errors)
    workload = build(trace)
    driver = Driver(plan, engine)
    driver.run(workload)

    records = driver.conductor.records
    assert sorted(records) == sorted(r.id for r in workload.requests)
    cancelled = {rid for _, rid in workload.cancellations}
    for rid, record in records.items():
        reason = record.finish_reason
        assert reason is not None, rid
        if reason == "cancelled":
            assert rid in cancelled
        elif reason.startswith("error"):
            assert reason == "error: injected" or reason.startswith("error: can never fit"), reason
        else:
            assert reason in ("length", "stop")
            assert record.num_output_tokens <= record.request.max_tokens
            if reason == "length":
                assert record.num_output_tokens == record.request.max_tokens
    # No row lost or run twice: per (request, kv node), context grows by exactly what ran.
    kv_nodes = {n.name for n in plan.nodes if n.engine == "kv"}
    context = {}
    for node, rid, num_tokens, context_len in engine.rows:
        if node in kv_nodes:
            assert context.get((rid, node), 0) == context_len, (rid, node)
            context[(rid, node)] = context_len + num_tokens
    assert engine.num_pages_held() == 0 and all(p.pages.num_free_pages == p.num_pages for p in engine.pools.values())
    assert all(s.is_idle() for s in driver.schedulers.values())
    assert not driver.conductor.active and not driver._inflight
