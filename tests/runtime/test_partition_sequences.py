"""Partitions whose walk order repeats a walk, and alternatives that are sequences of walks
(`prefill_text -> (prefill_audio -> prefill_text)? -> decode`, Higgs-Audio's text, audio, text)."""
import pytest
from spec_text import plan_of, run

from mstar.lang.diagnostics import Diagnostics
from mstar.lang.fmt import format_spec
from mstar.lang.parser import parse
from mstar.runtime.conductor.request import Request

SPEC = """model seq
node enc stateless audio_encoder {
    in audio: media prompt audio
    out embeds: embeddings
}
node LLM kv(layers=1, kv_heads=2, qo_heads=2, head_dim=8, hidden=16, vocab=64) {
    in text_inputs: tokens prompt text
    in embeds: embeddings
    out text_inputs: tokens
    out new_token: tokens
}
walk prefill_text {
    LLM(text_inputs) -> new_token: client text persist
}
walk prefill_audio {
    enc(audio) -> embeds: LLM
    LLM(embeds) -> new_token: client text persist
}
walk decode {
    loop decode_loop max=2 {
        LLM(text_inputs) -> text_inputs: LLM -> new_token: client text
    }
}
partition P = prefill_text -> STAGE -> decode
"""
CONFIG = "model: seq\nmax_seq_len: 64\nnode_groups:\n  - node_names: [enc, LLM]\n    ranks: [0]\n"


@pytest.fixture(scope="module")
def plan(tmp_path_factory):
    return plan_of(tmp_path_factory.mktemp("seq"), SPEC.replace("STAGE", "(prefill_audio -> prefill_text)?"), CONFIG)


def walks_run(plan, route):
    from mstar.runtime.engine.torch_engine import TorchEngine
    from mstar.runtime.serve.driver import Driver, Workload
    engine = TorchEngine(plan)
    seen: list[str] = []
    launch = engine.launch

    def recording(step):
        seen.extend(row.walk for row in step.rows if step.node == "LLM")
        return launch(step)

    engine.launch = recording  # type: ignore[method-assign]
    driver = Driver(plan, engine)
    driver.run(Workload([Request(id="r", prompt_tokens=[1, 2], max_tokens=10, route=route)]))
    assert driver.conductor.records["r"].finish_reason in ("done", "stop", "length")
    return seen


def test_the_plan_keeps_the_sequence(plan):
    stage = plan.partitions[0].stages[1]
    assert (stage.walks, stage.sequence_lengths, stage.is_optional) == (["prefill_audio", "prefill_text"], [2], True)


def test_a_route_takes_the_sequence_and_repeats_a_walk(plan):
    route = {"P": ["prefill_text", "prefill_audio", "prefill_text", "decode"]}
    assert walks_run(plan, route) == ["prefill_text", "prefill_audio", "prefill_text", "decode", "decode"]


def test_the_optional_sequence_may_be_left_out(plan):
    assert walks_run(plan, {}) == ["prefill_text", "decode", "decode"]


def test_a_route_that_takes_half_a_sequence_is_refused(plan):
    records = run(plan, [Request(id="r", prompt_tokens=[1], max_tokens=4,
                                 route={"P": ["prefill_text", "prefill_audio", "decode"]})])
    assert records["r"].finish_reason.startswith("error: partition P: stage")


def test_a_walk_may_come_back_in_the_walk_order(tmp_path):
    plan = plan_of(tmp_path, SPEC.replace("STAGE", "prefill_audio -> prefill_text"), CONFIG)
    assert [s.walks for s in plan.partitions[0].stages] == [["prefill_text"], ["prefill_audio"], ["prefill_text"],
                                                             ["decode"]]


@pytest.mark.parametrize("line", ["partition P = a -> (b -> a | c)? -> d",
                                  "partition P = (a -> b -> c)",
                                  "partition P = a -> b -> a"])
def test_sequences_round_trip_through_the_formatter(line):
    text = f"model m\n\n{line}\n"
    spec = parse(text, "m.mw", Diagnostics())
    assert spec is not None and format_spec(spec) == text
