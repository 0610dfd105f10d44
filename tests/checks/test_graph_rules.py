"""Graph and role checks (check_graph.py, check_roles.py, stream_checks.route_lengths) at the edges
their golden fixtures leave open; each case is one a mutation of the checks passed every other
test with."""
from pathlib import Path

from checks_golden import check_spec_text, check_texts
from mstar.compiler.memory_bounds import MAX_LOOP_ITERATIONS

FIXTURES = Path(__file__).parent / "fixtures"


def _found(diags) -> list[tuple[str, int, int]]:
    return [(d.code, d.span.line, d.span.col) for d in diags.sorted()]


NESTED = """model m
node LLM kv(layers=2, hidden=256, vocab=1024) {
    in text_inputs: tokens prompt text
    out text_inputs: tokens
}
walk w {
    loop a max=%d {
        loop b max=%d {
            LLM(text_inputs) -> text_inputs: LLM
        }
    }
}
partition P = w
"""


def test_nested_loops_may_multiply_to_exactly_the_limit():
    side = 2**15
    assert side * side == MAX_LOOP_ITERATIONS
    assert _found(check_spec_text(NESTED % (side, side))) == []
    assert _found(check_spec_text(NESTED % (side, side + 1))) == [("MW214", 8, 9)]


def test_a_device_edge_that_loops_back_to_another_node_is_refused():
    """A loop-back stays on the device only into the node that made it; head runs earlier in the
    loop, so LLM's edge to it is a loop-back, but to another node (MW206)."""
    spec = """model m
node LLM kv(layers=2, hidden=256, vocab=1024) {
    in text_inputs
}
node head stateless {
    in hidden_states
}
walk decode {
    loop decode_loop max=64 stop {
        head(hidden_states) -> text_inputs: LLM
        LLM(text_inputs) -> hidden_states: head device
    }
}
partition P = decode
"""
    assert _found(check_spec_text(spec)) == [("MW206", 11, 26)]


def test_a_walk_in_two_partitions_is_refused():
    spec = (FIXTURES / "MW209_walk_partition_count.mw").read_text().replace(
        "partition P = prefill", "partition P = prefill\npartition Q = prefill -> decode")
    diags = check_spec_text(spec)
    assert _found(diags) == [("MW209", 6, 6)]
    assert "walk prefill is in partitions P, Q" in diags.render()


def test_a_route_of_one_walk_may_come_from_an_optional_stage():
    """MW218: `extra? -> codec_chunk` can be the one walk codec_chunk, so a stream that continues
    after done into it never ends; `extra -> codec_chunk` always runs two walks."""
    spec = (FIXTURES / "MW218_stream_never_ends.mw").read_text().replace(
        "partition C = codec_chunk", "walk extra {\n    codec(new_token) -> audio_chunk: client audio\n}\n"
        "partition C = extra? -> codec_chunk")
    assert _found(check_spec_text(spec)) == [("MW218", 23, 52)]
    assert _found(check_spec_text(spec.replace("extra? ->", "extra ->"))) == []


def test_a_node_takes_each_prompt_modality_on_one_input():
    spec = """model m
node LLM kv(layers=2, hidden=256, vocab=1024) {
    in text_inputs: tokens prompt text
    in other_text: tokens prompt text
    out new_token: tokens
}
walk w {
    LLM(text_inputs, other_text) -> new_token: client text
}
partition P = w
"""
    diags = check_texts(spec)
    assert _found(diags) == [("MW119", 4, 5)]
    assert "takes the text prompt on two inputs" in diags.render()


def test_a_signal_input_takes_a_value_of_any_role():
    spec = """model m
node LLM kv(layers=2, hidden=256, vocab=1024) {
    in text_inputs: tokens prompt text
    out new_token: tokens
    out go: tokens
}
node codec stateless audio_codec {
    in new_token: tokens
    in go: signal
    out audio: audio
}
walk w {
    LLM(text_inputs) -> new_token: codec
                     -> go: codec
                     -> new_token: client text
    codec(new_token, go) -> audio: client audio
}
partition P = w
"""
    assert _found(check_texts(spec)) == []
