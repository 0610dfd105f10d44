"""Per-request loop counts (`loop NAME max=N count=PARAM`): a request runs its own number of
iterations, by the param's name, within the loop's max; the param's value is the default."""
import pytest
from spec_text import plan_of, run

from mstar.lang.diagnostics import Diagnostics
from mstar.lang.fmt import format_spec
from mstar.lang.parser import parse
from mstar.runtime.conductor.request import Request
from mstar.runtime.serve.workload import WorkloadError, parse_prompt_line

SPEC = """model counted
param steps = 5
node LLM kv(layers=1, kv_heads=2, qo_heads=2, head_dim=8, hidden=16, vocab=64) {
    in text_inputs: tokens prompt text
    out text_inputs: tokens
    out new_token: tokens
}
walk gen {
    loop gen_loop max=8 count=steps {
        LLM(text_inputs) -> text_inputs: LLM -> new_token: client text
    }
}
partition P = gen
"""
CONFIG = "model: counted\nmax_seq_len: 64\nnode_groups:\n  - node_names: [LLM]\n    ranks: [0]\n"


@pytest.fixture(scope="module")
def plan(tmp_path_factory):
    return plan_of(tmp_path_factory.mktemp("counted"), SPEC, CONFIG)


def test_the_plan_carries_the_count(plan):
    loop = plan.walks[0].loops[0]
    assert (loop.max_iters, loop.count_param, loop.default_count) == (8, "steps", 5)


def test_each_request_runs_its_own_count(plan):
    records = run(plan, [Request(id="own", prompt_tokens=[1, 2], max_tokens=20, loop_counts={"steps": 3}),
                         Request(id="default", prompt_tokens=[1, 2], max_tokens=20),
                         Request(id="max", prompt_tokens=[1, 2], max_tokens=20, loop_counts={"steps": 8})])
    counts = {rid: len([e for e in r.emissions if e.modality == "text"]) for rid, r in records.items()}
    assert counts == {"own": 3, "default": 5, "max": 8}


@pytest.mark.parametrize("counts, message", [
    ({"steps": 9}, "loop_counts steps=9 is outside 1..8, the most iterations loop gen/gen_loop may run"),
    ({"steps": 0}, "loop_counts steps=0 is outside 1..8"),
    ({"step": 3}, "loop_counts names 'step', which no loop of this plan counts by (counts: steps); "
                  "did you mean 'steps'?"),
])
def test_a_count_outside_the_plan_fails_the_request_alone(plan, counts, message):
    records = run(plan, [Request(id="bad", prompt_tokens=[1], max_tokens=20, loop_counts=counts),
                         Request(id="good", prompt_tokens=[1], max_tokens=20)])
    assert records["bad"].finish_reason.startswith("error: " + message)
    assert records["good"].finish_reason in ("done", "stop")


def test_prompts_lines_carry_loop_counts():
    request = parse_prompt_line('{"id": "a", "prompt_tokens": [1], "max_tokens": 4, "loop_counts": {"steps": 3}}',
                                "p.jsonl:1")
    assert request.loop_counts == {"steps": 3}
    with pytest.raises(WorkloadError, match="positive integer"):
        parse_prompt_line('{"id": "a", "prompt_tokens": [1], "max_tokens": 4, "loop_counts": {"steps": 0}}', "p:1")


def test_count_round_trips_through_the_formatter():
    diags = Diagnostics()
    spec = parse(SPEC, "counted.mw", diags)
    assert spec is not None, diags.render()
    text = format_spec(spec)
    assert "loop gen_loop max=8 count=steps {" in text
    again = parse(text, "again.mw", Diagnostics())
    assert again is not None and format_spec(again) == text and again.walks[0].body[0].count == "steps"


@pytest.mark.parametrize("counts, message", [
    (None, "loop_counts must map a loop's count param to its iterations ({'steps': 4}; {} for the defaults), got None"),
    ([("steps", 3)], "loop_counts must map a loop's count param to its iterations"),
    ({5: 3}, "loop_counts names 5, which no loop of this plan counts by (counts: steps)"),
])
def test_loop_counts_of_the_wrong_kind_fail_the_request_alone(plan, counts, message):
    # (a hand-built Request's None raised AttributeError in admission: the run failed, every request)
    records = run(plan, [Request(id="bad", prompt_tokens=[1], max_tokens=20, loop_counts=counts),
                         Request(id="good", prompt_tokens=[1], max_tokens=20)])
    assert records["bad"].finish_reason.startswith("error: " + message)
    assert records["good"].finish_reason in ("done", "stop")
