"""The checks of captures' guidance modes and KV labels (check_capture_keys.py), beyond their golden
fixtures: each misuse gets its code and message, a right spec none, and the language's new words
parse, refuse their mistakes and format back."""
import textwrap
import pytest

from mstar.compiler import check_combine, check_graph, resolve
from checks_golden import check_spec_text
from mstar.lang.diagnostics import Diagnostics
from mstar.lang.fmt import format_spec
from mstar.lang.parser import parse

NODE = """model m
node LLM kv(layers=2, kv_heads=2, qo_heads=2, head_dim=8, hidden=16, vocab=64) {{
    in text_inputs: tokens prompt text
    out text_inputs: tokens
    out new_token: tokens
    kv_sequences main cfg
    guidance cfg drops image scale=2.0
    kv prefill writes main cfg
    kv decode writes main cfg
    kv probe reads main cfg
{body}
}}

node codec stateless audio_codec {{
    in new_token: tokens
    out audio: audio
{codec}
}}

walk prefill {{
    LLM(text_inputs) -> new_token: conductor persist
}}

walk decode {{
    loop decode_loop max=64 stop {{
        LLM(text_inputs) -> text_inputs: LLM device
                         -> new_token: client text
    }}
}}

walk probe {{
    LLM(text_inputs) -> new_token: codec
    codec(new_token) -> audio: client audio
}}

partition P = prefill -> decode | probe
"""


def _diags(body: str, codec: str = "") -> Diagnostics:
    return check_spec_text(NODE.format(body=textwrap.indent(textwrap.dedent(body).strip(), "    "),
                                       codec=textwrap.indent(codec, "    ")))


def _codes(body: str, codec: str = "") -> list[str]:
    return [d.code for d in _diags(body, codec).items]


@pytest.mark.parametrize("body, codec, codes", [
    # one capture a mode, each with the sequences its steps touch (written or not)
    ("capture decode batched batch=[1, 2] unguided labels=[main]\n"
     "capture decode batched batch=[1, 2] guided labels=[main, cfg]", "", []),
    ("capture decode batched batch=[1, 2] unguided\ncapture decode batched batch=[1, 2] guided", "", []),
    ("capture decode batched batch=[1, 2] guided labels=[cfg, main]", "", []),  # a set: order is free
    # opposite modes are apart: not one family (no MW414), not one key (no MW425)
    ("capture decode batched batch=[1] unguided\ncapture decode batched batch=[2, 4] guided", "", []),
    ("capture decode batched batch=[1] guided\ncapture decode batched batch=[2, 4] guided", "", ["MW414"]),
    # a capture of both modes where they touch other sequences
    ("capture decode batched batch=[1, 2]", "", ["MW419"]),
    ("combine mixed = prefill + decode {\n    capture packed batch=[4] tokens=[64]\n}", "", ["MW419"]),
    ("combine mixed = prefill + decode {\n    capture packed batch=[4] tokens=[64] unguided\n}", "", []),
    # labels: unknown, twice, a guidance sequence on an unguided capture, one left out
    ("capture decode batched batch=[1] guided labels=[main, cgf]", "", ["MW417"]),
    ("capture decode batched batch=[1] guided labels=[main, main]", "", ["MW417"]),
    ("capture decode batched batch=[1] unguided labels=[main, cfg]", "", ["MW419"]),
    ("capture decode batched batch=[1] guided labels=[main]", "", ["MW419"]),
    # a stateless node has no KV sequences and no guidance
    ("", "capture probe batched batch=[1] labels=[main]\n", ["MW417"]),
    ("", "capture probe batched batch=[1] guided\n", ["MW418"]),
    ("", "capture probe batched batch=[1] unguided\n", []),
])
def test_capture_keys_are_checked(body, codec, codes):
    assert _codes(body, codec) == codes


def test_the_messages_name_the_sequences():
    text = _diags("capture decode batched batch=[1] guided labels=[main]").render()
    assert "labels main are not the KV sequences guided steps of decode touch on LLM (main, cfg)" in text
    text = _diags("combine mixed = prefill + decode {\n    capture packed batch=[4] tokens=[64]\n}").render()
    assert "steps of prefill + decode on LLM in both guidance modes" in text
    text = _diags("capture decode batched batch=[1] guided labels=[main, cgf]").render()
    assert "'cgf' is not a KV sequence of LLM (main, cfg); did you mean 'cfg'?" in text


def test_a_mode_beside_a_capture_of_both_modes_is_one_key_twice():
    # a walk whose steps touch the same sequences in both modes (a node with one sequence) may have
    # a capture of both modes, but beside an `unguided` one of the same family an unguided step
    # could replay either
    body = ("kv_sequences main\n" "capture prefill packed batch=[1] tokens=[64]\n"
            "capture prefill packed batch=[1] tokens=[64] unguided")
    roles = ("    kv_sequences main cfg\n    guidance cfg drops image scale=2.0\n    kv prefill writes main cfg\n"
             "    kv decode writes main cfg\n    kv probe reads main cfg\n")
    text = NODE.replace(roles, "")
    diags = Diagnostics()
    spec = parse(text.format(body=textwrap.indent(body, "    "), codec=""), "m.mw", diags)
    assert spec is not None, diags.render()
    resolve.run(spec, diags)
    check_graph.run(spec, diags)
    check_combine.run(spec, None, diags)
    assert [d.code for d in diags.items] == ["MW425"]


@pytest.mark.parametrize("text, code", [
    ("capture d batched batch=[1] guided unguided", "MW020"),
    ("capture d batched batch=[1] labels=[main] labels=[cfg]", "MW020"),
    ("capture d batched batch=[1] labels=main", "MW002"),
    ("capture d batched batch=[1] labels=[]", "MW002"),
])
def test_capture_key_words_refuse_their_mistakes(text, code):
    diags = Diagnostics()
    parse(f"model m\nnode LLM kv {{\n    {text}\n}}\n", "m.mw", diags)
    assert [d.code for d in diags.items][:1] == [code]


@pytest.mark.parametrize("text", [
    "model m\n\nnode N kv {\n    kv_sequences main cfg\n    guidance cfg drops text scale=2.0\n"
    "    capture d batched batch=[1, 2] unguided labels=[main]\n"
    "    capture d batched batch=[1, 2] guided labels=[main, cfg] eager_above\n"
    "    combine m = d + e {\n        capture packed batch=[4] tokens=[64] unguided piecewise\n    }\n}\n",
])
def test_capture_keys_round_trip_through_the_formatter(text):
    spec = parse(text, "m.mw", Diagnostics())
    assert spec is not None and format_spec(spec) == text
    captures = spec.nodes[0].captures
    assert [(c.guidance, c.labels) for c in captures] == [("unguided", ["main"]), ("guided", ["main", "cfg"])]
    assert spec.nodes[0].combines[0].capture.guidance == "unguided"


def test_a_guidance_statement_after_a_capture_line_stays_a_statement():
    # `guided` is the capture's word, so a `guidance` statement may follow a capture line
    text = ("model m\nnode N kv {\n    kv_sequences main cfg\n    capture d batched batch=[1] guided\n"
            "    guidance cfg drops text scale=2.0\n}\n")
    diags = Diagnostics()
    spec = parse(text, "m.mw", diags)
    assert spec is not None and not diags.items, diags.render()
