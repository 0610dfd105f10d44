"""Comments survive parse -> format_spec: where they are attached and where they are written back.

A golden spec with a comment in every position, hypothesis properties on random specs with
comments inserted into their text (and sprinkled on their trees), and `mstarc fmt --check` on every
checked-in spec.
"""
import re
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from lang_strategies import specs
from mstar.cli.mstarc import main
from mstar.lang import ast
from mstar.lang.diagnostics import Diagnostics
from mstar.lang.fmt import format_spec
from mstar.lang.parser import parse

SPECS = sorted((Path(__file__).resolve().parents[2] / "specs").glob("*.mw"))

GOLDEN_IN = """\
# header comment

# second header paragraph
model tiny  # the model line
# above a param
param steps = 4  # trailing on a param

# above a node
node LLM kv(layers=2, heads=4,   # on a wrapped header line
            vocab=100) tp {
    # above an input
    in text_inputs  # trailing on an input
    kv_sequences main
    cap decode 8
    combine mixed = prefill + decode {  # trailing on a combine
        # above the combine cap
        cap 8  # trailing on the combine cap
        rows prefill <= 2
        attention split  # trailing on attention
        # end of the combine
    }
    # end of the node
}  # after a closing brace

walk decode {  # trailing on a walk
    # above a loop
    loop decode_loop max=steps stop {
        LLM(text_inputs)  # trailing on a call
            # above an edge
            -> new_token: client text  # trailing on an edge
            -> text_inputs: LLM device
        # end of the loop
    }
}

walk prefill {
    LLM(text_inputs) -> new_token: client text  # trailing on a one-edge call
    LLM(text_inputs)
        # above the only edge
        -> new_token: conductor
    parallel {
        LLM(text_inputs)
        # end of a parallel
    }
    # end of the walk
}

# above a partition
partition LLM = prefill -> decode  # trailing on a partition
partition Echo = prefill
    # above a stream source
    <- LLM.new_token window(4)  # trailing on a stream source
# end of the file, first line

# end of the file, after a blank line
"""

# The wrapped header's comment moves to the header's one line, the comment after `}` to its own
# line above the next declaration; blank lines are only those of the canonical form.
GOLDEN_OUT = """\
# header comment
# second header paragraph
model tiny  # the model line

# above a param
param steps = 4  # trailing on a param

# above a node
node LLM kv(layers=2, heads=4, vocab=100) tp {  # on a wrapped header line
    # above an input
    in text_inputs  # trailing on an input
    kv_sequences main
    cap decode 8
    combine mixed = prefill + decode {  # trailing on a combine
        # above the combine cap
        cap 8  # trailing on the combine cap
        rows prefill <= 2
        attention split  # trailing on attention
        # end of the combine
    }
    # end of the node
}

# after a closing brace
walk decode {  # trailing on a walk
    # above a loop
    loop decode_loop max=steps stop {
        LLM(text_inputs)  # trailing on a call
            # above an edge
            -> new_token: client text  # trailing on an edge
            -> text_inputs: LLM device
        # end of the loop
    }
}

walk prefill {
    LLM(text_inputs) -> new_token: client text  # trailing on a one-edge call
    LLM(text_inputs)
        # above the only edge
        -> new_token: conductor
    parallel {
        LLM(text_inputs)
        # end of a parallel
    }
    # end of the walk
}

# above a partition
partition LLM = prefill -> decode  # trailing on a partition
partition Echo = prefill
    # above a stream source
    <- LLM.new_token window(4)  # trailing on a stream source

# end of the file, first line
# end of the file, after a blank line
"""


def _parse(text: str) -> ast.Spec:
    diags = Diagnostics()
    spec = parse(text, "comments.mw", diags)
    assert spec is not None, diags.render() + "\n" + text
    return spec


def test_golden_spec_with_a_comment_in_every_position():
    assert format_spec(_parse(GOLDEN_IN)) == GOLDEN_OUT
    assert format_spec(_parse(GOLDEN_OUT)) == GOLDEN_OUT


def test_comments_land_on_their_constructs():
    spec = _parse(GOLDEN_IN)
    assert spec.comments_before == ["# header comment", "# second header paragraph"]
    assert spec.comment_after == "# the model line"
    llm = spec.nodes[0]
    assert llm.comments_before == ["# above a node"]
    assert llm.inputs[0].comment_after == "# trailing on an input"
    combine = llm.combines[0]
    assert combine.cap_comments_before == ["# above the combine cap"]
    assert combine.attention_comment_after == "# trailing on attention"
    assert combine.comments_end == ["# end of the combine"]
    assert llm.comments_end == ["# end of the node"]
    decode = spec.walks[0]
    assert decode.comments_before == ["# after a closing brace"]
    call = decode.body[0].body[0]
    assert call.comment_after == "# trailing on a call"
    assert call.edges[0].comments_before == ["# above an edge"]
    assert spec.partitions[1].streams[0].comment_after == "# trailing on a stream source"
    assert spec.comments_end == ["# end of the file, first line", "# end of the file, after a blank line"]


def test_comments_are_not_part_of_the_meaning():
    without = "".join(line.split("#")[0].rstrip() + "\n" for line in GOLDEN_IN.splitlines())
    assert ast.same_meaning(_parse(GOLDEN_IN), _parse(without))


def test_comments_move_with_their_declaration_and_lose_line_end_whitespace():
    text = "model m\r\n# about n\r\nnode n stateless {\r\n}\r\n# about p\r\nparam p = 1  # one \t\r\n"
    assert format_spec(_parse(text)) == (
        "model m\n\n# about p\nparam p = 1  # one\n\n# about n\nnode n stateless {\n}\n")


def test_a_comment_that_cannot_be_written_is_refused():
    for comment in ["", "no hash", "# two\nlines"]:
        with pytest.raises(ValueError, match="comment"):
            format_spec(ast.Spec(model="m", comments_end=[comment]))


# ---- properties ---------------------------------------------------------------------------------

# Each inserted comment starts with the marker MARK, its number and MARK again ("#§3§"): the random
# rest of a comment never holds MARK's last character, canonical code never contains it (names are
# ASCII, quoted strings are written with ASCII escapes), and the closing MARK keeps "#§1§" from
# being a prefix of "#§10§". So the marker numbers read back from the formatted text are exactly
# the comments that survived, in the order they were written.
_MARK = "\u00a7"
_comment_texts = st.text(alphabet=st.characters(blacklist_characters="\n" + _MARK, blacklist_categories=("Cs",)),
                         max_size=12)
_MARKER = re.compile(f"#{_MARK}([0-9]+){_MARK}")


@st.composite
def commented_texts(draw):
    """(text, comments): a random spec's canonical text with comments and blank lines inserted."""
    lines = format_spec(draw(specs)).split("\n")[:-1]
    result: list[str] = []
    comments: list[str] = []

    def comment() -> str:
        text = f"#{_MARK}{len(comments)}{_MARK} " + draw(_comment_texts)
        comments.append(text.rstrip(" \t\r\f"))
        return text

    for line in lines + [None]:
        for _ in range(draw(st.integers(min_value=0, max_value=2))):
            if draw(st.booleans()):
                result.append(draw(st.sampled_from(["", "  ", "\t"])))
            else:
                result.append(draw(st.sampled_from(["", "    ", "\t"])) + comment())
        if line is not None:
            result.append(line + (draw(st.sampled_from([" ", "  ", "\t"])) + comment()
                                  if draw(st.booleans()) else ""))
    return "\n".join(result) + "\n", comments


def _texts_in_order(text: str, comments: list[str]) -> bool:
    position = 0
    for comment in comments:
        position = text.find(comment, position)
        if position < 0:
            return False
        position += len(comment)
    return True


@given(commented_texts())
def test_comments_survive_format_in_order(case):
    text, comments = case
    parsed = _parse(text)
    formatted = format_spec(parsed)
    # Every comment once, none lost, none added, in the written order; then each one's whole text.
    assert [int(n) for n in _MARKER.findall(formatted)] == list(range(len(comments))), formatted
    assert _texts_in_order(formatted, comments), formatted
    again = _parse(formatted)
    assert ast.same_meaning(again, parsed)
    assert format_spec(again) == formatted


_HOSTS = (ast.Spec, ast.Param, ast.NodeDecl, ast.InputDecl, ast.OutputDecl, ast.KvSequences, ast.GuidanceDecl,
          ast.KvAccess, ast.Bidirectional, ast.StateDecl,
          ast.CapDecl,
          ast.CaptureDecl, ast.CombineDecl, ast.RowsLimit, ast.Walk, ast.Call, ast.Edge, ast.Parallel,
          ast.Sequential, ast.Loop, ast.Partition, ast.StreamSource)


def _sprinkle(tree, draw, comments: list[str]):
    """Random comments on every comment field of every construct below `tree` (in place)."""
    def comment() -> str:
        comments.append(f"#\u00a7{len(comments)}")
        return comments[-1]

    def many() -> list[str]:
        return [comment() for _ in range(draw(st.integers(0, 2)))]

    def one():
        return comment() if draw(st.booleans()) else None

    if isinstance(tree, _HOSTS):
        tree.comments_before, tree.comment_after = many(), one()
    if hasattr(tree, "comments_end"):
        tree.comments_end = many()
    if isinstance(tree, ast.CombineDecl) and tree.cap is not None:
        tree.cap_comments_before, tree.cap_comment_after = many(), one()
    if isinstance(tree, ast.CombineDecl) and tree.attention is not None:
        tree.attention_comments_before, tree.attention_comment_after = many(), one()
    for name in type(tree).model_fields:
        value = getattr(tree, name)
        for child in value if isinstance(value, list) else [value]:
            if isinstance(child, _HOSTS):
                _sprinkle(child, draw, comments)


@given(specs, st.data())
def test_commented_trees_format_to_a_fixed_point(tree, data):
    comments: list[str] = []
    _sprinkle(tree, data.draw, comments)
    text = format_spec(tree)
    parsed = _parse(text)
    assert ast.same_meaning(parsed, tree)
    assert format_spec(parsed) == text
    assert all(text.count(comment + "\n") == 1 for comment in comments), text


@pytest.mark.parametrize("path", SPECS, ids=lambda p: p.stem)
def test_checked_in_spec_is_canonical(path, capsys):
    assert main(["fmt", "--check", str(path)]) == 0, capsys.readouterr().err
