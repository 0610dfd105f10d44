"""Diagnostics that name the fix a user writing a first spec needs (a user's audit): where the
message alone ('not an input', 'unknown walk') left the rule that was broken unsaid."""
from pathlib import Path

from checks_golden import check_texts

FIXTURES = Path(__file__).parent / "fixtures"
BASE = (FIXTURES / "base.mw").read_text()
BASE_OK = (FIXTURES / "base_ok.yaml").read_text()


def _messages(spec: str, config: str) -> list[tuple[str, int, int, str]]:
    return [(d.code, d.span.line, d.span.col, d.message) for d in check_texts(spec, config).sorted()]


def test_an_edge_named_apart_from_its_input_says_one_name_is_both():
    # The codec's input renamed: the LLM's edges still carry `new_token`, which the codec no longer takes.
    spec = BASE.replace("in new_token stream: tokens", "in codes stream: tokens").replace(
        "codec(new_token)", "codec(codes)")
    found = _messages(spec, BASE_OK)
    assert [(code, line, col) for code, line, col, _ in found] == [("MW102", 29, 25), ("MW102", 35, 29)]
    assert found[0][3] == (
        "edge 'new_token' is not an input of node codec (it takes codes); an edge's name is both the output it "
        "carries and the input it feeds: name the input 'new_token' or use the input's name for the output")


def test_a_combined_walk_in_graph_walks_names_its_walks():
    config = BASE_OK.replace("    ranks: [0, 1]\n", "    ranks: [0, 1]\n    graph_walks: [prefill, decode, mixed]\n")
    assert _messages(BASE, config) == [(
        "MW314", 6, 36,
        "unknown walk 'mixed': it is node LLM's combined walk of prefill + decode; list those walks instead: a "
        "group that runs more than one of them runs their mixed steps")]


def test_an_unknown_walk_of_a_node_suggests_only_walks_that_run_it():
    """`cap encode 4` on an encoder suggested `decode`, a walk that never calls it (a user's audit):
    the did-you-mean is among the node's own walks, else the message names them."""
    near_own = BASE.replace("capture codec_chunk batched", "capture codec_chnk batched")
    assert [m[3] for m in _messages(near_own, BASE_OK)] == ["unknown walk 'codec_chnk'; did you mean 'codec_chunk'?"]
    near_other = BASE.replace("capture codec_chunk batched", "capture decod batched")
    assert [m[3] for m in _messages(near_other, BASE_OK)] == ["unknown walk 'decod'; node codec runs in codec_chunk"]
