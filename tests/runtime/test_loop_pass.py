"""The columnar loop pass (conductor/loop_pass.py) against the row-by-row path it shortcuts.

The conductor advances a step's loop rows in one pass; with `is_columnar = False` every row goes
through its walk run's tables one by one (the straightforward reference). On random traces
(plans, prompt and output lengths, routes, small KV pools, out-of-memory rows, row errors,
cancellations, stop strings, results answered out of row order), both must give the same run:
the same steps with the same rows in the same order, and per request the same emissions, tokens,
token times, walk order and ending.
"""
from hypothesis import given, strategies as st

from mstar.runtime.conductor.request import Request
from mstar.runtime.engine.sim import SimEngine
from mstar.runtime.serve.driver import Driver, Workload
from mstar.runtime.step import RowResult

from runtime_plans import call, edge, generated, hand_plan, kv_node, loop, partition, stateless_node, walk

PLAN_NAMES = ["llama", "orpheus", "orpheus_tp2", "orpheus_pd_disaggregated", "qwen3_omni", "bagel"]
_PLANS: dict = {}


def _plan(name):
    if name not in _PLANS:
        _PLANS[name] = generated(name)
    return _PLANS[name]


class _Recording(SimEngine):
    def __init__(self, *args, stop_every: int = 0, is_out_of_order: bool = False, **kwargs):
        super().__init__(*args, **kwargs)
        self.steps = []
        self.stop_every = stop_every
        self.is_out_of_order = is_out_of_order

    def run_step(self, step):
        self.steps.append((step.node, [(r.request_id, r.walk, r.num_tokens, r.context_len, r.loop_iter)
                                       for r in step.rows]))
        result = super().run_step(step)
        if self.stop_every:  # some rows report a stop (their stop loops end after this iteration)
            result.rows = [RowResult(r.request_id, r.outputs, r.is_stop or (i % self.stop_every == 0 and
                                     self.num_steps % 3 == 0), r.error) for i, r in enumerate(result.rows)]
            # the engine's columns say the same (StepResult.stop_rows)
            result.stop_rows = [i for i, r in enumerate(result.rows) if r.is_stop]
        if self.is_out_of_order and self.num_steps % 4 == 1 and len(result.rows) >= 3:
            # the last two rows answered in swapped order: the pass matches them by id from there
            # (an engine answering out of order gives no columns: they are in step order)
            result.rows[-2], result.rows[-1] = result.rows[-1], result.rows[-2]
            result.token_ids = None
        return result


def _run(plan, requests, *, is_columnar, num_pages, oom_steps, errors, cancels, closed, stop_every,
         is_out_of_order=False):
    counter = {"steps": 0}

    def inject_oom(step):
        counter["steps"] += 1
        return [step.rows[0].request_id] if counter["steps"] in oom_steps else []

    engine = _Recording(plan, num_pages=num_pages, inject_oom=inject_oom, inject_error=dict(errors),
                        stop_every=stop_every, is_out_of_order=is_out_of_order)
    driver = Driver(plan, engine, decode=_decode)
    driver.conductor.is_columnar = is_columnar
    driver.run(Workload([Request(**vars(r)) for r in requests], closed_concurrency=closed, cancellations=cancels))
    records = {
        rid: (r.finish_reason, r.num_output_tokens, r.output_tokens, r.token_times_s, r.first_token_s, r.finish_s,
              [(e.time_s, e.edge, e.modality, e.value) for e in r.emissions])
        for rid, r in driver.conductor.records.items()
    }
    return records, engine.steps


def _decode(tokens):
    """Token ids as letters, so stop strings over a few letters end some requests early."""
    return "".join(chr(ord("a") + token % 8) for token in tokens)


@st.composite
def traces(draw):
    name = draw(st.sampled_from(PLAN_NAMES))
    requests = []
    now = 0.0
    for index in range(draw(st.integers(1, 10))):
        now += draw(st.floats(0.0, 0.01))
        # ids of several lengths: the simulated tokens differ between requests (a row given
        # another row's result shows)
        requests.append(Request(id=f"r{index}" + "_" * (index % 3), prompt_tokens=list(range(draw(st.integers(1, 40)))),
                                max_tokens=draw(st.integers(1, 40)), arrival_s=now,
                                stop_strings=draw(st.lists(st.sampled_from(["ba", "hg", "edc", "ab"]), max_size=2))))
    ids = [r.id for r in requests]
    return {
        "plan": _plan(name), "requests": requests,
        "num_pages": draw(st.one_of(st.none(), st.integers(6, 40))),
        "oom_steps": draw(st.sets(st.integers(1, 100), max_size=10)),
        "errors": {ids[i % len(ids)]: "injected" for i in draw(st.sets(st.integers(0, 9), max_size=2))},
        "cancels": [(t, ids[i % len(ids)]) for t, i in draw(st.lists(st.tuples(st.floats(0.0, 0.05),
                                                                               st.integers(0, 9)), max_size=2))],
        "closed": draw(st.one_of(st.none(), st.integers(1, 4))),
        "stop_every": draw(st.sampled_from([0, 0, 2, 5])),
        "is_out_of_order": draw(st.booleans()),
    }


@given(traces())
def test_columnar_pass_gives_the_row_by_row_run(trace):
    columnar = _run(is_columnar=True, **trace)
    reference = _run(is_columnar=False, **trace)
    assert columnar[1] == reference[1]  # the same steps, rows, order, tokens, contexts, iterations
    assert columnar[0] == reference[0]  # the same emissions, tokens, times and endings


def test_loop_with_host_loop_backs_exits_and_accumulates_alike():
    """A loop whose body is one call fed by a host loop-back (not on the device), with an output
    and an accumulated edge: the pass re-readies it from the slot, the exit hands on both."""
    a, b = kv_node("A", ["seed", "x"]), stateless_node("B", ["y", "z"])
    body = [call("A", ["x"], edge("x", "node", "A", is_loop_back=True), edge("y", "node", "B"), edge("z", "node", "B"))]
    w = walk("gen", "P", call("A", ["seed"], edge("x", "node", "A")),
             loop("gen_loop", 5, body, nodes=["A"], outputs=("z",), accumulate=("y",)),
             call("B", ["y", "z"], edge("out", "client", modality="image")))
    plan = hand_plan([w], [partition("P", ["gen"])], [a, b])
    requests = [Request(id=f"r{i}", prompt_tokens=[1, 2, 3], max_tokens=100) for i in range(4)]
    kwargs = dict(num_pages=None, oom_steps=set(), errors={}, cancels=[], closed=None, stop_every=0)
    columnar = _run(plan, requests, is_columnar=True, **kwargs)
    assert columnar == _run(plan, requests, is_columnar=False, **kwargs)
    # Each request: 1 + 5 A rows and one B row whose y holds the 5 iterations' values.
    rows = [row for node, rows in columnar[1] if node == "A" for row in rows]
    assert len(rows) == 4 * 6
    assert all(len(record[6]) == 1 for record in columnar[0].values())


def test_results_answered_out_of_row_order_go_to_their_own_rows():
    """An engine that answers the last two rows of some steps in swapped order: each decode row
    still gets its own result (the pass stops at the first row answered out of order and the rest
    go by id), so tokens, stops and endings are those of the row-by-row run."""
    requests = [Request(id=f"r{i}" + "_" * (i % 3), prompt_tokens=list(range(5)), max_tokens=20) for i in range(6)]
    kwargs = dict(num_pages=None, oom_steps=set(), errors={}, cancels=[], closed=None, stop_every=0,
                  is_out_of_order=True)
    columnar = _run(_plan("llama"), requests, is_columnar=True, **kwargs)
    assert columnar == _run(_plan("llama"), requests, is_columnar=False, **kwargs)
