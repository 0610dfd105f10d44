"""format_spec is the inverse of parse: random ASTs survive fmt -> parse unchanged."""
import pytest
from hypothesis import given

from lang_strategies import specs
from mstar.lang import ast
from mstar.lang.diagnostics import Diagnostics
from mstar.lang.fmt import format_spec
from mstar.lang.parser import parse


@given(specs)
def test_random_ast_survives_format_then_parse(tree):
    text = format_spec(tree)
    diags = Diagnostics()
    parsed = parse(text, "random.mw", diags)
    assert parsed is not None, diags.render() + "\n" + text
    assert ast.meaning(parsed) == ast.meaning(tree)


@given(specs)
def test_format_is_a_fixed_point(tree):
    text = format_spec(tree)
    parsed = parse(text, "random.mw", Diagnostics())
    assert format_spec(parsed) == text


@pytest.mark.parametrize(
    "tree, construct",
    [
        (ast.Edge(name="x", dest="client"), "modality"),
        (ast.Edge(name="x", dest="LLM", modality="audio"), "only a client edge"),
        (ast.ChunkPolicy(kind="window", size=28, context=3), "window"),
        (ast.ChunkPolicy(kind="fixed", size=1, stride=2), "fixed"),
        (ast.ChunkPolicy(kind="left_context", size=25), "left_context"),
        (ast.KvSequences(labels=[]), "kv_sequences"),
        (ast.Bidirectional(walks=[]), "bidirectional"),
        (ast.CombineDecl(name="mixed", walks=[]), "combine"),
        (ast.Stage(walks=[]), "stage"),
    ],
)
def test_trees_the_language_cannot_write_are_refused(tree, construct):
    spec = _spec_holding(tree)
    with pytest.raises(ValueError, match=construct):
        format_spec(spec)


def _spec_holding(tree):
    if isinstance(tree, ast.Edge):
        walk = ast.Walk(name="w", body=[ast.Call(node="LLM", inputs=[], edges=[tree])])
        return ast.Spec(model="m", walks=[walk])
    if isinstance(tree, ast.ChunkPolicy):
        stream = ast.StreamSource(partition="P", edge="e", policy=tree)
        return ast.Spec(model="m", partitions=[ast.Partition(name="Q", stages=[], streams=[stream])])
    if isinstance(tree, ast.KvSequences):
        return ast.Spec(model="m", nodes=[ast.NodeDecl(name="n", engine="kv", kv_sequences=tree)])
    if isinstance(tree, ast.Bidirectional):
        return ast.Spec(model="m", nodes=[ast.NodeDecl(name="n", engine="kv", bidirectional=tree)])
    if isinstance(tree, ast.CombineDecl):
        return ast.Spec(model="m", nodes=[ast.NodeDecl(name="n", engine="kv", combines=[tree])])
    return ast.Spec(model="m", partitions=[ast.Partition(name="Q", stages=[tree])])
