"""`capture ... piecewise`: the family's graphs hold everything but attention, which runs eagerly
between the captured pieces. The option lowers to `CaptureFamily.is_piecewise`, changes the
family's memory estimate, shows in `mstarc explain`, and costs the simulated engine one eager
attention launch per layer of every replay; buckets and padding stay those of the family."""
import pytest
from spec_text import plan_of, run

from mstar.compiler import capture_memory
from mstar.lang.diagnostics import Diagnostics
from mstar.lang.fmt import format_spec
from mstar.lang.parser import parse
from mstar.plan.explain import explain_text
from mstar.runtime.conductor.request import Request
from mstar.runtime.engine.sim import SimEngine
from mstar.runtime.engine.sim_cost import GRAPH_MERGE_S, PIECE_LAUNCH_S
from mstar.runtime.engine.step_check import StepChecker
from mstar.runtime.step import Step, StepRow

SPEC = """model piece
node LLM kv(layers=3, kv_heads=2, qo_heads=2, head_dim=8, hidden=16, vocab=64) {
    in text_inputs: tokens prompt text
    out text_inputs: tokens
    out new_token: tokens
    cap prefill 4
    capture prefill packed batch=[1, 2, 4] tokens=[8, 16, 32]PIECEWISE
}
walk prefill {
    LLM(text_inputs) -> new_token: client text
}
partition P = prefill
"""
CONFIG = "model: piece\nmax_seq_len: 64\nnode_groups:\n  - node_names: [LLM]\n    ranks: [0]\n"


@pytest.fixture
def plans(tmp_path):
    whole = plan_of(tmp_path / "whole", SPEC.replace("PIECEWISE", ""), CONFIG)
    piecewise = plan_of(tmp_path / "piecewise", SPEC.replace("PIECEWISE", " piecewise"), CONFIG)
    return whole, piecewise


def _family(plan):
    return plan.workers[0].keys[0].captures[0]


def test_piecewise_lowers_to_the_family_with_the_same_buckets(plans):
    whole, piecewise = plans
    a, b = _family(whole), _family(piecewise)
    assert not a.is_piecewise and b.is_piecewise
    assert (a.batch_sizes, a.token_buckets, a.batch_pad, a.num_graphs) == \
        (b.batch_sizes, b.token_buckets, b.batch_pad, b.num_graphs)
    # The estimate is the piecewise formula's (tests/checks/test_capture_memory.py pins its terms).
    assert b.memory_bytes != a.memory_bytes
    spec = parse(SPEC.replace("PIECEWISE", " piecewise"), "piece.mw", Diagnostics())
    assert spec is not None
    assert b.memory_bytes == capture_memory.estimate_family_bytes(spec.nodes[0], spec.nodes[0].captures[0], 1)
    assert piecewise.workers[0].capture_memory_bytes == b.memory_bytes


def test_explain_shows_the_option(plans):
    whole, piecewise = plans
    assert "packed piecewise" in explain_text(piecewise, width=200)
    assert "piecewise" not in explain_text(whole, width=200)


def test_the_simulated_engine_charges_the_eager_attention_of_each_layer(plans):
    """A piecewise replay pays an eager attention call a layer; a whole one, graph mode's merge of
    the split KV outputs a layer (one prefill call: the packed route)."""
    whole, piecewise = plans
    rows = [StepRow("r1", "prefill", 5, 0), StepRow("r2", "prefill", 7, 0)]
    times = []
    for plan in plans:
        key = plan.workers[0].keys[0]
        step = Step(worker=0, key=key.name, node="LLM", mask=1, label="prefill", rows=rows,
                    attention=key.mixtures[1].attention, capture=_family(plan).name, padded_batch=2, token_bucket=16)
        StepChecker(plan).check(step)  # the step contract is the family's, whole or piecewise
        times.append(SimEngine(plan).step_time(step))
        eager = Step(worker=0, key=key.name, node="LLM", mask=1, label="prefill", rows=rows,
                     attention=key.mixtures[1].attention)
        times.append(SimEngine(plan).step_time(eager))
    whole_replay, whole_eager, piece_replay, piece_eager = times
    assert piece_replay - whole_replay == pytest.approx(3 * (PIECE_LAUNCH_S - GRAPH_MERGE_S))
    assert piece_eager == whole_eager  # an eager step replays nothing


def test_a_piecewise_family_runs_requests_on_the_cpu(plans):
    _, piecewise = plans
    records = run(piecewise, [Request(id=f"r{i}", prompt_tokens=[1, 2, 3], max_tokens=2) for i in range(3)])
    assert all(r.finish_reason in ("done", "stop", "length") for r in records.values())


@pytest.mark.parametrize("text", [
    "model m\n\nnode N kv {\n    capture d batched batch=[1, 2] piecewise\n}\n",
    "model m\n\nnode N kv {\n    capture d packed batch=[1, 2] tokens=[64] eager_above piecewise\n}\n",
    "model m\n\nnode N kv {\n    combine c = a + b {\n        capture packed batch=[4] tokens=[64] piecewise\n"
    "    }\n}\n",
])
def test_piecewise_round_trips_through_the_formatter(text):
    spec = parse(text, "m.mw", Diagnostics())
    assert spec is not None and format_spec(spec) == text
    node = spec.nodes[0]
    capture = node.captures[0] if node.captures else node.combines[0].capture
    assert capture is not None and capture.is_piecewise


def test_piecewise_given_twice_is_mw020():
    diags = Diagnostics()
    parse("model m\nnode N kv {\n    capture d batched batch=[1] piecewise piecewise\n}\n", "m.mw", diags)
    assert [d.code for d in diags.items] == ["MW020"]
    assert "`piecewise` is given twice in this capture" in diags.items[0].message
