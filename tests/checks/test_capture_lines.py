"""Capture lines (check_captures.py, check_capture_keys.py, capture_keys.py) at the edges their golden
fixtures and tests/checks/test_capture_families.py leave open: each case here is one that a
mutation of the checks passed every other test with."""
from pathlib import Path

import pytest

from checks_golden import check_texts
from mstar.compiler import capture_keys
from mstar.lang.diagnostics import Diagnostics
from mstar.lang.parser import parse

ROOT = Path(__file__).resolve().parents[2]

TALKER = """model m
node LLM kv(layers=2, vocab=1024) {
    in text_inputs: tokens prompt text
    out new_token: tokens
}
node Talker kv(layers=2, vocab=1024) {
    in new_token stream: tokens
    in text_inputs: tokens
    out codes: tokens
%s
}
walk prefill {
    LLM(text_inputs) -> new_token: Talker stream
}
walk talk {
    Talker(new_token) -> codes: client text
}
walk talk2 {
    Talker(text_inputs) -> codes: client text
}
partition P = prefill
partition T = (talk | talk2) <- P.new_token %s
"""


def _found(text: str) -> list[tuple[str, int, int]]:
    return [(d.code, d.span.line, d.span.col) for d in check_texts(text).sorted()]


@pytest.mark.parametrize("body, policy, found", [
    # MW434: a chunk of exactly tokens_per_row items fits a row
    ("    capture talk batched batch=[1, 2] tokens_per_row=2", "fixed(2)", []),
    # a left_context chunk carries its context too: 2 + 1 items, past 2 tokens a row
    ("    capture talk batched batch=[1, 2] tokens_per_row=2", "left_context(chunk=2, context=1)",
     [("MW434", 22, 45)]),
    # a combined walk's batched capture holds the streamed walk's rows too
    ("    combine both = talk + talk2 {\n        capture batched batch=[1, 2]\n    }", "fixed(2)",
     [("MW434", 24, 45)]),
    # MW414: unroll_prompts makes another family (one-token rows and unrolled prompt rows)
    ("    capture talk batched batch=[1, 2]\n    capture talk batched batch=[4] unroll_prompts=4", "fixed(1)", []),
    # MW415: the replayed walk has no capture of its own, whether or not the replaying walk has
    ("    capture talk2 batched batch=[1]\n    capture talk2 replays talk", "fixed(1)", [("MW415", 11, 27)]),
    # a replay naming a walk that does not run the node is MW401 alone (not also MW415)
    ("    capture talk2 batched batch=[1]\n    capture talk2 replays prefill", "fixed(1)", [("MW401", 11, 27)]),
])
def test_capture_lines_of_a_streamed_node(body, policy, found):
    assert _found(TALKER % (body, policy)) == found


GUIDED = """model m
node LLM kv(layers=2, kv_heads=2, qo_heads=2, head_dim=8, hidden=16, vocab=64) {
    in text_inputs: tokens prompt text
    out text_inputs: tokens
    out new_token: tokens
    kv_sequences main cfg
    guidance cfg drops image scale=2.0
    kv prefill writes main cfg
    kv decode writes main cfg
%s
}
node codec stateless audio_codec {
    in new_token: tokens
    out audio: audio
}
walk prefill {
    LLM(text_inputs) -> new_token: conductor persist
}
walk decode {
    loop decode_loop max=64 stop {
        LLM(text_inputs) -> text_inputs: LLM device
                         -> new_token: client text
    }
}
walk sound {
    codec(new_token) -> audio: client audio
}
partition P = prefill -> decode
partition S = sound
"""


def test_a_guided_capture_that_leaves_out_main_is_told_what_its_steps_touch():
    """The message about guidance sequences in an *unguided* capture's labels is for unguided
    captures only; a guided one that names cfg alone is told that guided steps touch main and cfg."""
    diags = check_texts(GUIDED % "    capture decode batched batch=[1, 2] guided labels=[cfg]")
    assert [(d.code, d.span.line) for d in diags.sorted()] == [("MW419", 10)]
    assert "labels cfg are not the KV sequences guided steps of decode touch on LLM (main, cfg)" in diags.render()


def test_a_combined_walk_with_a_walk_off_the_node_is_not_judged_by_its_labels():
    """MW401 for the walk that does not run LLM; the capture's labels are not compared too."""
    assert _found(GUIDED % "    combine mixed = decode + sound {\n        capture batched batch=[1] labels=[cfg]\n"
                            "    }") == [("MW401", 10, 30)]


def test_a_guided_capture_on_a_node_without_guidance_is_mw418_alone():
    text = (GUIDED.replace("    guidance cfg drops image scale=2.0\n", "").replace("main cfg\n", "main side\n")
            .replace("writes main cfg", "writes main"))
    assert _found(text % "    capture decode batched batch=[1, 2] guided labels=[side]") == [("MW418", 9, 41)]


def _whisper(capture: str) -> str:
    text = (ROOT / "specs" / "whisper.mw").read_text()
    anchor = "    kv decode reads audio writes main\n"
    assert anchor in text
    return text.replace(anchor, anchor + capture + "\n")


def test_a_capture_label_may_name_a_cross_attention_pool():
    """A cross_kv pool is one of the sequences a capture's graphs touch (Whisper's decode reads
    `audio`), so `labels=[main, audio]` is right; it is attended over, not run, so a row of the
    family still runs one self-attention sequence in the memory estimate."""
    text = _whisper("    capture decode batched batch=[1, 2] labels=[main, audio]")
    assert check_texts(text).sorted() == []
    diags = Diagnostics()
    node = next(n for n in parse(text, "w.mw", diags).nodes if n.name == "decoder")
    labels = capture_keys.family_labels(node, node.captures[0], ["decode"])
    assert labels == ["main", "audio"]
    assert capture_keys.num_self_sequences(node, labels) == 1
    unlabelled = parse(_whisper("    capture decode batched batch=[1, 2]"), "w.mw", diags)
    node = next(n for n in unlabelled.nodes if n.name == "decoder")
    assert capture_keys.family_labels(node, node.captures[0], ["decode"]) == ["main", "audio"]
