"""Several capture families for one walk, and a walk that replays another walk's captures.

A walk with several `capture` lines lowers to a mixture whose `capture` is the first family and
`also_captures` the rest; `capture W replays S` lists S's families in W's mixture (and key). A
step takes the family whose key holds it with the smallest (tokens, padded batch), in the fast
scheduler's tables and in the baseline scheduler alike, and the step contract accepts any family
of the mixture, and no other."""
import pytest
from spec_text import plan_of, run

from mstar.lang.diagnostics import Diagnostics
from mstar.lang.fmt import format_spec
from mstar.lang.parser import parse
from mstar.plan.explain import explain_text
from mstar.runtime.conductor.request import Request
from mstar.runtime.engine.step_check import StepChecker, StepContractError
from mstar.runtime.scheduler.baseline import BaselineScheduler
from mstar.runtime.scheduler.key_tables import KeyTables
from mstar.runtime.scheduler.scheduler import WorkerScheduler
from mstar.runtime.step import Step, StepRow

SPEC = """model buckets
node LLM kv(layers=2, kv_heads=2, qo_heads=2, head_dim=8, hidden=16, vocab=64) {
    in text_inputs: tokens prompt text
    out text_inputs: tokens
    out new_token: tokens
    cap prefill 16
    capture prefill packed batch=[1, 2] tokens=[64]
    capture prefill packed batch=[16] tokens=[32]
    capture image batched batch=[1] tokens_per_row=8
    capture image batched batch=[1, 2] tokens_per_row=24
    capture image_again replays image
}
walk prefill {
    LLM(text_inputs) -> new_token: client text
}
walk image {
    LLM(text_inputs) -> new_token: client text
}
walk image_again {
    LLM(text_inputs) -> new_token: client text
}
partition P = prefill
partition Q = image
partition R = image_again
"""
CONFIG = "model: buckets\nmax_seq_len: 128\nnode_groups:\n  - node_names: [LLM]\n    ranks: [0]\n"


@pytest.fixture(scope="module")
def plan(tmp_path_factory):
    return plan_of(tmp_path_factory.mktemp("buckets"), SPEC, CONFIG)


def _key(plan, walk):
    worker = plan.workers[0]
    return next(k for k in worker.keys if k.name == worker.walk_to_key[f"LLM/{walk}"])


def test_several_captures_lower_to_one_mixture_with_further_families(plan):
    key = _key(plan, "prefill")
    entry = key.mixtures[1]
    assert (entry.capture, entry.also_captures) == ("LLM:prefill", ["LLM:prefill#2"])
    assert [f.name for f in key.captures] == ["LLM:prefill", "LLM:prefill#2"]
    assert entry.cap == 16 and [f.batch_sizes for f in key.captures] == [[1, 2], [16]]


def test_a_replay_lists_the_other_walks_families_and_they_are_counted_once(plan):
    image, again = _key(plan, "image"), _key(plan, "image_again")
    assert again.mixtures[1].capture == "LLM:image" and again.mixtures[1].also_captures == ["LLM:image#2"]
    assert [f.name for f in again.captures] == ["LLM:image", "LLM:image#2"]
    assert [f.model_dump(exclude={"batch_pad"}) for f in again.captures] == \
        [f.model_dump(exclude={"batch_pad"}) for f in image.captures]
    families = {f.name: f.memory_bytes for k in plan.workers[0].keys for f in k.captures}
    assert len(families) == 4 and plan.workers[0].capture_memory_bytes == sum(families.values())


@pytest.mark.parametrize("walk, num_tokens, expected", [
    ("prefill", [10], ("LLM:prefill#2", 16, 32)),  # (32 tokens, 16 rows) beats (64, 1)
    ("prefill", [40], ("LLM:prefill", 1, 64)),  # only the 64-token bucket holds 40 tokens
    ("prefill", [5, 5, 5], ("LLM:prefill#2", 16, 32)),  # 3 rows: only batch 16 holds them
    ("prefill", [30, 30, 30], (None, 0, 0)),  # 90 tokens in 3 rows: no family holds it
    ("image", [8], ("LLM:image", 1, 0)),  # (8 tokens, 1) beats (24, 1)
    ("image", [9], ("LLM:image#2", 1, 0)),  # a 9-token row is past the first family's 8 a row
    ("image", [3, 20], ("LLM:image#2", 2, 0)),
    ("image", [30], (None, 0, 0)),  # past every family's tokens a row
    ("image_again", [8], ("LLM:image", 1, 0)),  # the replayed families, by the same rule
    ("image_again", [9], ("LLM:image#2", 1, 0)),
])
def test_a_step_takes_the_smallest_tokens_then_batch_that_holds_it(plan, walk, num_tokens, expected):
    key = _key(plan, walk)
    tables = KeyTables.from_plan(0, key, False)
    pick = tables.pick_capture(1, len(num_tokens), num_tokens)
    assert (pick.capture, pick.padded_batch, pick.token_bucket) == expected
    for make in (WorkerScheduler, BaselineScheduler):
        scheduler = make(plan.workers[0], plan.deployment, lambda: 0.0)
        for i, tokens in enumerate(num_tokens):
            scheduler.add_ready(f"r{i}", "LLM", walk, tokens)
        batch = scheduler.next_batch()
        assert batch is not None and len(batch.request_ids) == len(num_tokens)
        assert (batch.capture, batch.padded_batch, batch.token_bucket) == expected
    checker = StepChecker(plan)
    rows = [StepRow(f"r{i}", walk, tokens, 0) for i, tokens in enumerate(num_tokens)]
    checker.check(Step(worker=0, key=key.name, node="LLM", mask=1, label=walk, rows=rows,
                       attention=key.mixtures[1].attention, capture=expected[0], padded_batch=expected[1],
                       token_bucket=expected[2]))


def test_the_step_contract_takes_any_family_of_the_mixture_and_no_other(plan):
    checker = StepChecker(plan)
    key = _key(plan, "image")
    rows = [StepRow("r0", "image", 8, 0)]

    def step(capture):
        return Step(worker=0, key=key.name, node="LLM", mask=1, label="image", rows=rows,
                    attention=key.mixtures[1].attention, capture=capture, padded_batch=1)

    checker.check(step("LLM:image#2"))  # a larger family that holds it: wasteful, not wrong
    prefill = _key(plan, "prefill")
    with pytest.raises(StepContractError, match="replays 'LLM:image' or 'LLM:image#2'"):
        checker.check(Step(worker=0, key=key.name, node="LLM", mask=1, label="image", rows=rows,
                           attention=key.mixtures[1].attention, capture=prefill.captures[0].name, padded_batch=1))
    # An eager step within the largest batch size of the families passes (its rows fit no family) ...
    long = [StepRow(f"r{i}", "image", 30, 0) for i in range(2)]
    checker.check(Step(worker=0, key=key.name, node="LLM", mask=1, label="image", rows=long,
                       attention=key.mixtures[1].attention))
    # ... one above the largest batch size of every family is refused (none is `eager_above`); the
    # plan is widened by hand to a cap of 3 so that the cap check lets the step through.
    data = plan.model_dump(mode="json", by_alias=True)
    widened = next(k for k in data["workers"][0]["keys"] if k["name"] == key.name)
    widened["mixtures"][1]["cap"] = 3
    wide = [StepRow(f"r{i}", "image", 1, 0) for i in range(3)]
    with pytest.raises(StepContractError, match="above the largest batch size 2 of capture LLM:image#2"):
        StepChecker(type(plan).model_validate(data)).check(
            Step(worker=0, key=key.name, node="LLM", mask=1, label="image", rows=wide,
                 attention=key.mixtures[1].attention))


def test_requests_run_through_several_families_on_the_cpu(plan):
    records = run(plan, [Request(id=f"r{i}", prompt_tokens=list(range(1, 3 + 9 * i)), max_tokens=1)
                         for i in range(5)])
    assert all(r.finish_reason in ("done", "stop", "length") for r in records.values())


def test_explain_lists_every_family_of_a_mixture(plan):
    text = explain_text(plan, width=200)
    assert "LLM:image, LLM:image#2" in text and "LLM:prefill, LLM:prefill#2" in text


@pytest.mark.parametrize("text", [
    "model m\n\nnode N kv {\n    capture a batched batch=[1]\n    capture a batched batch=[2] tokens_per_row=4\n"
    "    capture b replays a\n    capture c replays a\n}\n",
])
def test_several_captures_and_replays_round_trip_through_the_formatter(text):
    spec = parse(text, "m.mw", Diagnostics())
    assert spec is not None and format_spec(spec) == text
    assert [(r.walk, r.source) for r in spec.nodes[0].capture_replays] == [("b", "a"), ("c", "a")]


PROMPTS_BATCHED = """model prompts_batched
node LLM kv(layers=2, kv_heads=2, qo_heads=2, head_dim=8, hidden=16, vocab=64) {
    in text_inputs: tokens prompt text
    out text_inputs: tokens
    out new_token: tokens
    capture prefill batched batch=[1, 2, 4]
    capture decode batched batch=[1, 2, 4]
}
walk prefill {
    LLM(text_inputs) -> new_token: client text persist
}
walk decode {
    loop decode_loop max=8 stop {
        LLM(text_inputs)
            -> new_token: client text
            -> text_inputs: LLM device
    }
}
partition P = prefill -> decode
"""


def test_prompt_rows_past_a_batched_capture_run_eagerly(tmp_path):
    """A batched capture of a walk whose rows feed prompts (MW435 warns): the scheduler padded such
    steps to the family and the engine refused every one (`StepContractError: ... feeds 20 tokens,
    past the 1 tokens a row`; 20 of 20 requests failed). They run eagerly now, on both engines."""
    from mstar.runtime.engine.sim import SimEngine
    from mstar.runtime.serve.driver import Driver, Workload

    plan = plan_of(tmp_path, PROMPTS_BATCHED, "model: prompts_batched\nmax_seq_len: 64\nnode_groups:\n"
                                               "  - node_names: [LLM]\n    ranks: [0]\n")
    key = next(k for k in plan.workers[0].keys if "prefill" in k.walks)
    tables = KeyTables.from_plan(0, key, False)
    prefill = 1 << key.walks.index("prefill")
    assert tables.pick_capture(prefill, 2, [5, 1]).capture is None  # eager
    assert tables.pick_capture(prefill, 2, [1, 1]).capture is not None
    requests = [Request(id=f"r{i}", prompt_tokens=[3 + i] * (4 + i), max_tokens=4) for i in range(4)]
    assert {r.finish_reason for r in run(plan, requests).values()} == {"length"}
    driver = Driver(plan, SimEngine(plan))
    driver.run(Workload(requests))
    assert {r.finish_reason for r in driver.conductor.records.values()} == {"length"}
