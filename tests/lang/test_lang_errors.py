"""Golden tests: one per parse diagnostic code, with the exact rendered text.

Each case is (code, source, rendered diagnostics of `parse(source, "bad.mw", diags)`).
"""
import pytest

from mstar.lang import codes
from mstar.lang.build import AstBuilder
from mstar.lang.diagnostics import Diagnostics
from mstar.lang.parser import parse

CASES = [
    (
        'MW001',
        'model m\nparam x = $3\n',
        'bad.mw:2:11: error[MW001]: unexpected character `$`; expected a number\n'
        '    2 | param x = $3\n'
        '      |           ^\n',
    ),
    (
        'MW002',
        'model m\nparam x = 3 4\n',
        'bad.mw:2:13: error[MW002]: unexpected `4`; expected one of `node`, `param`, `partition`, `walk`, end of file\n'
        '    2 | param x = 3 4\n'
        '      |             ^\n',
    ),
    (
        'MW003',
        'model m\nparam x =\n',
        'bad.mw:2:10: error[MW003]: unexpected end of file; expected a number\n'
        '    2 | param x =\n'
        '      |          ^\n',
    ),
    (
        'MW004',
        'model m\nwalk w\n    LLM(x)\n}\n',
        'bad.mw:3:5: error[MW004]: missing `{` at the end of line 2: unexpected name `LLM`; expected `{`\n'
        '    3 |     LLM(x)\n'
        '      |     ^^^\n',
    ),
    (
        'MW005',
        'model m\nnode L kv {\n    combine c = a + b {\n        rows a = 4\n    }\n}\n',
        'bad.mw:4:16: error[MW005]: a rows limit is written `rows WALK <= N`, with `<=` instead of `=`\n'
        '    4 |         rows a = 4\n'
        '      |                ^\n',
    ),
    (
        'MW006',
        'model m\nwalk w {\n    LLM(x) new_token: conductor\n}\n',
        'bad.mw:3:21: error[MW006]: missing `->` before the edge `new_token:` (write `-> new_token: DEST`)\n'
        '    3 |     LLM(x) new_token: conductor\n'
        '      |                     ^\n',
    ),
    (
        'MW007',
        'model m\nnode L kvv(layers=1) {\n}\n',
        'bad.mw:2:8: error[MW007]: unknown engine kind `kvv`; an engine is `kv` or `stateless`\n'
        '    2 | node L kvv(layers=1) {\n'
        '      |        ^^^\n',
    ),
    (
        'MW008',
        'model m\nnode L kv {\n    cap decode\n    in x\n}\n',
        'bad.mw:4:5: error[MW008]: `cap` needs a number of rows (`cap WALK N` in a node, `cap N` in a combine); found '
        '`in`\n'
        '    4 |     in x\n'
        '      |     ^^\n',
    ),
    (
        'MW009',
        'model m\nnode L kv {\n    in x\n\nwalk w {\n    L(x)\n}\n',
        'bad.mw:3:9: error[MW009]: missing `}`: the block opened at line 2 is not closed before the end of the '
        'declaration\n'
        '    3 |     in x\n'
        '      |         ^\n'
        'bad.mw:2:11: note: the block opened here\n'
        '    2 | node L kv {\n'
        '      |           ^\n',
    ),
    (
        'MW010',
        'model m\nwalk w {\n    loop(x) -> y: z\n}\n',
        'bad.mw:3:5: error[MW010]: `loop` is a reserved word and cannot name a node here\n'
        '    3 |     loop(x) -> y: z\n'
        '      |     ^^^^\n',
    ),
    (
        'MW011',
        'node L kv {\n}\n',
        'bad.mw:1:1: error[MW011]: a spec starts with `model NAME`; this declaration comes first\n'
        '    1 | node L kv {\n'
        '      | ^^^^^^^^^^^\n',
    ),
    (
        'MW012',
        'model m\nnode L kv {\n    capture d batchd batch=[1]\n}\n',
        'bad.mw:3:15: error[MW012]: unknown capture family `batchd`; a capture is `batched` or `packed` '
        '(or `capture WALK replays OTHER`: replay another walk\'s captures)\n'
        '    3 |     capture d batchd batch=[1]\n'
        '      |               ^^^^^^\n',
    ),

    (
        'MW013',
        'model m\nnode L kv {\n    combine c = a + b {\n        attention spilt\n    }\n}\n',
        'bad.mw:4:19: error[MW013]: unknown attention route `spilt`; the route is `split` or `packed`\n'
        '    4 |         attention spilt\n'
        '      |                   ^^^^^\n',
    ),
    (
        'MW014',
        'model m\npartition P = a <- L.x windw(28, stride=7)\n',
        'bad.mw:2:24: error[MW014]: unknown chunk policy `windw`; a stream is cut by `window(SIZE, stride=N)`, '
        '`left_context(chunk=N, context=M)` or `fixed(SIZE[, continue_after_done])`\n'
        '    2 | partition P = a <- L.x windw(28, stride=7)\n'
        '      |                        ^^^^^\n',
    ),
    (
        'MW015',
        'model m\nwalk w {\n    L(x) -> y: L persit\n    L(y)\n}\n',
        'bad.mw:3:18: error[MW015]: unknown edge flag `persit`; edge flags are persist, stream, device, count_tokens, '
        'and a client edge is written `-> NAME: client MODALITY`; did you mean `persist`?\n'
        '    3 |     L(x) -> y: L persit\n'
        '      |                  ^^^^^^\n',
    ),
    (
        'MW016',
        'model m\nnode L kv {\n    state recur(layers=1)\n}\n',
        'bad.mw:3:11: error[MW016]: unknown state kind `recur`; the state kind is `recurrent`\n'
        '    3 |     state recur(layers=1)\n'
        '      |           ^^^^^\n',
    ),
    (
        'MW017',
        'model m\nwalk w {\n    L(x) -> y: client\n}\n',
        'bad.mw:4:1: error[MW017]: a client edge names what it carries: `-> NAME: client MODALITY` (text, audio, '
        'image, ...); found `}`\n'
        '    4 | }\n'
        '      | ^\n',
    ),
    (
        'MW018',
        'model m\nnode L kv {\n    in x: token\n}\n',
        'bad.mw:3:11: error[MW018]: unknown input role `token` (one of tokens, embeddings, hidden, mask, flow_latents, '
        'flow_time, media, signal); did you mean \'tokens\'?\n'
        '    3 |     in x: token\n'
        '      |           ^^^^^\n',
    ),
    (
        'MW018',
        'model m\nwalk w {\n    L(x) -> y: client actoin\n}\n',
        'bad.mw:3:23: error[MW018]: unknown client modality `actoin` (one of text, image, audio, action, latents); '
        'did you mean \'action\'?\n'
        '    3 |     L(x) -> y: client actoin\n'
        '      |                       ^^^^^^\n',
    ),
    (
        'MW020',
        'model m\nnode L kv {\n    capture d batched batch=[1] batch=[2]\n}\n',
        'bad.mw:3:33: error[MW020]: `batch` is given twice in this capture\n'
        '    3 |     capture d batched batch=[1] batch=[2]\n'
        '      |                                 ^^^^^^^^^\n',
    ),
    (
        'MW021',
        'model m\nnode L kv {\n    capture d batched tokens_per_row=6\n}\n',
        'bad.mw:3:5: error[MW021]: this capture has no `batch=[...]` list of batch sizes\n'
        '    3 |     capture d batched tokens_per_row=6\n'
        '      |     ^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^\n',
    ),
    (
        'MW022',
        'model m\nparam x = 99999999999999999999999\n',
        'bad.mw:2:11: error[MW022]: number `99999999999999999999999` is out of range (at most 9223372036854775807)\n'
        '    2 | param x = 99999999999999999999999\n'
        '      |           ^^^^^^^^^^^^^^^^^^^^^^^\n',
    ),
    (
        'MW023',
        'model m\nnode L kv(s="\\q") {\n}\n',
        'bad.mw:2:13: error[MW023]: invalid quoted string: Invalid \\escape; strings use JSON escapes such as \\" and '
        '\\n\n'
        '    2 | node L kv(s="\\q") {\n'
        '      |             ^^^^\n',
    ),
]


@pytest.mark.parametrize("code, source, expected", CASES, ids=[c[0] for c in CASES])
def test_parse_error_golden(code, source, expected):
    diags = Diagnostics()
    assert parse(source, "bad.mw", diags) is None
    assert [d.code for d in diags.items] == [code]
    assert diags.render() == expected


def test_every_parse_code_has_a_golden_case_and_a_title():
    tested = {case[0] for case in CASES} | {codes.INTERNAL_PARSER_ERROR, codes.NESTING_TOO_DEEP}
    registered = {value for name, value in vars(codes).items() if name.isupper() and isinstance(value, str)}
    assert registered == tested
    assert set(codes.TITLES) == registered


def test_one_error_per_broken_declaration():
    source = (
        "model m\n"
        "walk w\n"
        "    LLM(x)\n"
        "}\n"
        "node L kvv {}\n"
        "node ok kv {}\n"
        "partition P = a <- L.x windw(28, stride=7)\n"
    )
    diags = Diagnostics()
    assert parse(source, "bad.mw", diags) is None
    assert [(d.code, d.span.line) for d in diags.sorted()] == [("MW004", 3), ("MW007", 5), ("MW014", 7)]


def test_second_model_line_is_refused():
    diags = Diagnostics()
    assert parse("model m\nmodel n\n", "bad.mw", diags) is None
    assert [(d.code, d.span.line) for d in diags.items] == [("MW011", 2)]


def test_empty_file_expects_a_model_line():
    diags = Diagnostics()
    assert parse("# nothing here\n", "empty.mw", diags) is None
    (diagnostic,) = diags.items
    assert diagnostic.code == codes.UNEXPECTED_END and "`model`" in diagnostic.message


def test_keyword_is_a_name_where_only_a_name_may_stand():
    diags = Diagnostics()
    spec = parse("model m\nnode stream kv {\n    in tokens stream\n}\n", "ok.mw", diags)
    assert spec is not None, diags.render()
    assert spec.nodes[0].name == "stream" and spec.nodes[0].inputs[0].name == "tokens"


def test_internal_failure_becomes_a_diagnostic(monkeypatch):
    def broken(self, *args):
        raise RuntimeError("boom")

    monkeypatch.setattr(AstBuilder, "param", broken)
    diags = Diagnostics()
    assert parse("model m\nparam x = 1\n", "bad.mw", diags) is None
    (diagnostic,) = diags.items
    assert diagnostic.code == codes.INTERNAL_PARSER_ERROR
    assert "RuntimeError: boom" in diagnostic.message


def test_a_declaration_cut_short_before_the_next_one_says_so():
    diags = Diagnostics()
    assert parse("model m\nparam x =\nnode a kv {}\n", "bad.mw", diags) is None
    (diagnostic,) = diags.items
    assert diagnostic.code == codes.UNEXPECTED_END
    assert diagnostic.message == "unexpected end of the declaration; expected a number"
    assert (diagnostic.span.line, diagnostic.span.col) == (2, 10)


def test_many_hashes_before_an_error_parse_quickly():
    # A regex for "blank or comment" once backtracked exponentially on this input.
    source = "model m\nwalk w {\n" + "# " * 40 + "\n$\n"
    diags = Diagnostics()
    assert parse(source, "bad.mw", diags) is None
    assert [d.code for d in diags.items] == [codes.UNEXPECTED_CHARACTER]


def test_blocks_nested_too_deep_golden():
    source = "model m\nwalk w {\n" + "parallel {\n" * 100 + "a()\n" + "}\n" * 101
    diags = Diagnostics()
    assert parse(source, "bad.mw", diags) is None
    assert diags.render() == (
        "bad.mw:102:10: error[MW024]: blocks are nested more than 100 levels deep here; flatten the walk\n"
        "  102 | parallel {\n"
        "      |          ^\n"
    )


def test_deep_nesting_in_one_declaration_of_a_broken_file():
    source = "model m\nparam x =\nwalk w {\n" + "parallel {\n" * 100 + "a()\n" + "}\n" * 101
    diags = Diagnostics()
    assert parse(source, "bad.mw", diags) is None
    assert [d.code for d in diags.sorted()] == [codes.UNEXPECTED_END, codes.NESTING_TOO_DEEP]


def _only_message(source: str) -> tuple[str, int, int, str]:
    diags = Diagnostics()
    assert parse(source, "bad.mw", diags) is None
    (diagnostic,) = diags.items
    return diagnostic.code, diagnostic.span.line, diagnostic.span.col, diagnostic.message


@pytest.mark.parametrize("source, line, col, word", [
    ("model m\npartiton P = w\n", 2, 1, "partition"),
    ("model m\nnode L kv {\n    capure d batched batch=[1]\n}\n", 3, 5, "capture"),
    ("model m\nnode L kv {\n    in x: tokens promt text\n}\n", 3, 18, "prompt"),
])
def test_a_misspelt_keyword_names_the_keyword(source, line, col, word):
    code, got_line, got_col, message = _only_message(source)
    assert (code, got_line, got_col) == (codes.UNEXPECTED_TOKEN, line, col)
    assert message.endswith(f"; did you mean `{word}`?")


@pytest.mark.parametrize("section, word", [("lop max=4 {", "loop"), ("paralel {", "parallel"),
                                           ("sequentail {", "sequential")])
def test_a_misspelt_section_word_is_named_not_taken_for_a_call(section, word):
    # `lop` lexes as a node's name, so the parser wanted the call's `(` after it.
    code, line, col, message = _only_message(f"model m\nwalk w {{\n    {section}\n        L(x)\n    }}\n}}\n")
    assert (code, line, col) == (codes.UNEXPECTED_TOKEN, 3, 5)
    assert message.endswith(f"did you mean `{word}`?")


def test_a_loop_without_max_says_what_a_loop_needs():
    code, line, col, message = _only_message("model m\nwalk w {\n    loop l stop {\n        L(x)\n    }\n}\n")
    assert (code, line, col) == (codes.UNEXPECTED_TOKEN, 3, 12)
    assert "a loop needs the most iterations it runs: `loop [NAME] max=N|PARAM" in message


def test_a_misspelt_client_is_named_not_its_modality():
    code, line, col, message = _only_message("model m\nwalk w {\n    L(x) -> y: clinet text\n}\n")
    assert (code, line, col) == (codes.UNKNOWN_EDGE_FLAG, 3, 16)
    assert message.endswith("did you mean `client`?")


def test_an_ellipsis_copied_from_the_docs_is_named():
    diags = Diagnostics()
    assert parse("model m\nnode L kv(...) {\n}\n", "bad.mw", diags) is None
    (diagnostic,) = diags.items
    assert (diagnostic.span.line, diagnostic.span.col, diagnostic.span.end_col) == (2, 11, 14)
    assert diagnostic.message.startswith("`...` stands for text left out in the docs' examples")


@pytest.mark.parametrize("source, word, block", [
    ("model m\nnode L kv {\n    in x: tokens\n}\n    cap w 4\n", "cap", "node"),
    ("model m\nwalk w {\n    L(x)\n}\n    loop max=2 {\n        L(x)\n    }\n}\n", "loop", "walk"),
])
def test_a_body_statement_between_declarations_says_where_it_belongs(source, word, block):
    code, line, col, message = _only_message(source)
    assert (code, line, col) == (codes.UNEXPECTED_TOKEN, 5, 5)
    assert message.startswith(f"`{word}` is a statement of a {block}'s body, here outside every declaration")


@pytest.mark.parametrize("tail, closer", [("    capture d batched batch=[1, 2\n    cap d 4\n}\n", "]"),
                                          ("    capture d batched batch=[1, 2\n}\n", "]")])
def test_a_list_left_open_at_the_end_of_its_line_names_the_missing_bracket(tail, closer):
    # It was reported at the next line's first word only ("unexpected `cap`; expected one of `,`, `]`").
    code, line, col, message = _only_message(f"model m\nnode L kv {{\n{tail}")
    assert (code, line) == (codes.UNEXPECTED_TOKEN, 4)
    assert message.startswith(f"missing `{closer}` at the end of line 3: unexpected")


def test_a_list_item_on_the_next_line_without_its_comma_is_not_called_an_open_list():
    code, line, col, message = _only_message("model m\nnode L kv {\n    capture d batched batch=[1\n 2]\n}\n")
    assert (code, line) == (codes.UNEXPECTED_TOKEN, 4) and not message.startswith("missing")


@pytest.mark.parametrize("source, message", [
    ("model m\nparam max_output_tokens = 512.0\n",
     "`512.0` is not a whole number, and a whole number stands here: write `512`"),
    ("model m\nnode L kv {\n    capture d batched batch=[1, 2.5]\n}\n",
     "`2.5` is not a whole number, and a whole number stands here"),
])
def test_a_decimal_where_a_whole_number_stands_says_so(source, message):
    # It read "unexpected `.0`; expected one of `node`, `param`, ..." (a user's audit).
    assert _only_message(source)[3] == message
