"""Every checked-in spec parses, formats back to the same meaning, and says what the models need."""
from pathlib import Path

import pytest

from mstar.lang import ast
from mstar.lang.diagnostics import Diagnostics
from mstar.lang.fmt import format_spec
from mstar.lang.parser import parse

SPECS = sorted((Path(__file__).resolve().parents[2] / "specs").glob("*.mw"))


def _parse_file(path: Path) -> ast.Spec:
    diags = Diagnostics()
    spec = parse(path.read_text(), str(path), diags)
    assert spec is not None, diags.render()
    assert not diags.items
    return spec


def test_the_five_model_specs_are_there():
    assert {p.stem for p in SPECS} >= {"llama", "orpheus", "qwen3_5", "bagel", "qwen3_omni"}


@pytest.mark.parametrize("path", SPECS, ids=lambda p: p.stem)
def test_spec_parses_and_survives_format(path):
    spec = _parse_file(path)
    assert spec.model == path.stem
    text = format_spec(spec)
    again = parse(text, "formatted.mw", Diagnostics())
    assert again is not None and ast.same_meaning(again, spec)
    assert format_spec(again) == text


@pytest.mark.parametrize("path", SPECS, ids=lambda p: p.stem)
def test_every_node_of_a_spec_has_a_span_in_its_file(path):
    spec = _parse_file(path)
    for node in spec.nodes:
        assert node.span.file == str(path)
        assert node.span.line >= 1 and node.span.end_line >= node.span.line


def _node(spec: ast.Spec, name: str) -> ast.NodeDecl:
    return next(n for n in spec.nodes if n.name == name)


def _args(node: ast.NodeDecl) -> dict:
    return {a.name: a.value for a in node.args}


def test_orpheus_facts():
    spec = _parse_file(SPECS[0].parent / "orpheus.mw")
    llm = _node(spec, "LLM")
    assert {k: _args(llm)[k] for k in ("layers", "kv_heads", "qo_heads", "head_dim", "hidden", "vocab")} == {
        "layers": 28, "kv_heads": 8, "qo_heads": 24, "head_dim": 128, "hidden": 3072, "vocab": 156940}
    assert llm.is_tp
    (mixed,) = llm.combines
    assert mixed.walks == ["prefill", "decode"] and mixed.rows[0].limit == 4
    snac = spec.partitions[1]
    policy = snac.streams[0].policy
    assert (policy.kind, policy.size, policy.stride) == ("window", 28, 7)


def test_qwen3_5_has_recurrent_state_and_three_to_one_pattern():
    spec = _parse_file(SPECS[0].parent / "qwen3_5.mw")
    llm = _node(spec, "LLM")
    assert _args(llm)["layer_pattern"] == [0, 0, 0, 1]
    (state,) = llm.states
    assert state.kind == "recurrent"
    assert {a.name: a.value for a in state.args}["layers"] == 18
    (mixed,) = llm.combines
    assert [(r.walk, r.limit) for r in mixed.rows] == [("prefill_text", 4)]


def test_bagel_llm_owns_three_kv_sequences():
    spec = _parse_file(SPECS[0].parent / "bagel.mw")
    assert _node(spec, "LLM").kv_sequences.labels == ["main", "cfg_text", "cfg_img"]
    stages = spec.partitions[0].stages
    assert [(s.walks, s.is_optional) for s in stages] == [
        (["prefill_vae"], True), (["prefill_vit"], True), (["prefill_text"], False),
        (["decode", "image_gen"], False)]


def test_qwen3_omni_streams():
    spec = _parse_file(SPECS[0].parent / "qwen3_omni.mw")
    by_name = {p.name: p for p in spec.partitions}
    talker_policies = [s.policy for s in by_name["Talker"].streams]
    assert all(p.kind == "fixed" and p.is_continue_after_done for p in talker_policies)
    code2wav = by_name["Code2Wav"].streams[0].policy
    assert (code2wav.kind, code2wav.size, code2wav.context) == ("left_context", 25, 25)
