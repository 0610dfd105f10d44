"""The checks of several captures per walk and of capture replays, beyond their golden fixtures:
each misuse gets its code (and a right spec none), MW405 and MW422 judge a walk by all of its
families, and the capture memory of a worker counts a replayed family once."""
import textwrap
from typing import Optional

import pytest

from mstar.compiler import check_combine, check_graph, resolve
from mstar.compiler.deployment import parse_deployment
from mstar.lang.diagnostics import Diagnostics
from mstar.lang.parser import parse

NODE = """model m
node LLM kv(layers=2, kv_heads=2, qo_heads=2, head_dim=8, hidden=16, vocab=64) {{
    in text_inputs: tokens prompt text
    out text_inputs: tokens
    out new_token: tokens
{body}
}}

walk prefill {{
    LLM(text_inputs) -> new_token: conductor persist
}}

walk prefill_audio {{
    LLM(text_inputs) -> new_token: conductor persist
}}

walk decode {{
    loop decode_loop max=64 stop {{
        LLM(text_inputs) -> text_inputs: LLM device
                         -> new_token: client text
    }}
}}

partition P = (prefill | prefill_audio) -> decode
"""


def _codes(body: str, config: Optional[str] = None) -> list[str]:
    diags = Diagnostics()
    spec = parse(NODE.format(body=textwrap.indent(textwrap.dedent(body).strip(), "    ")), "m.mw", diags)
    assert spec is not None, diags.render()
    resolve.run(spec, diags)
    if not diags.has_errors:
        check_graph.run(spec, diags)
    deployment = None
    if config is not None and not diags.has_errors:
        deployment = parse_deployment(textwrap.dedent(config), "m.yaml", diags)
    if not diags.has_errors:
        check_combine.run(spec, deployment, diags)
    return [d.code for d in diags.items]


@pytest.mark.parametrize("body, codes", [
    # several captures of one walk: shape buckets, each a family
    ("capture prefill packed batch=[1, 2] tokens=[64]\ncapture prefill packed batch=[16] tokens=[32]", []),
    ("capture decode batched batch=[1, 2]\ncapture decode batched batch=[4] tokens_per_row=2", []),
    ("capture decode batched batch=[1, 2]\ncapture decode batched batch=[4, 8] piecewise", []),
    ("capture decode batched batch=[1, 2]\ncapture decode batched batch=[4, 8]", ["MW414"]),
    ("capture prefill packed batch=[1] tokens=[64]\ncapture prefill packed batch=[4] tokens=[64]", ["MW414"]),
    # a cap is judged against the largest batch of every family of the walk, own or replayed
    ("cap prefill 16\ncapture prefill packed batch=[1, 2] tokens=[64]\ncapture prefill packed batch=[16] tokens=[32]",
     []),
    ("cap prefill 32\ncapture prefill packed batch=[1, 2] tokens=[64]\ncapture prefill packed batch=[16] tokens=[32]",
     ["MW405"]),
    ("cap prefill 32\ncapture prefill packed batch=[2] tokens=[64] eager_above\n"
     "capture prefill packed batch=[16] tokens=[32]", []),
    ("cap prefill_audio 8\ncapture prefill packed batch=[1, 4] tokens=[64]\ncapture prefill_audio replays prefill",
     ["MW405"]),
    # replays
    ("capture prefill packed batch=[1] tokens=[64]\ncapture prefill_audio replays prefill", []),
    ("capture prefill packed batch=[1] tokens=[64]\ncapture prefill_audio replays prefil", ["MW103"]),
    ("capture prefill packed batch=[1] tokens=[64]\ncapture prefill_audio replays prefill\n"
     "capture prefill_audio replays prefill", ["MW107"]),
    ("capture prefill_audio replays prefill", ["MW415"]),
    ("capture prefill packed batch=[1] tokens=[64]\ncapture prefill replays prefill", ["MW415"]),
    ("capture decode batched batch=[1, 2]\ncapture prefill_audio replays decode", ["MW416"]),
    ("capture prefill packed batch=[1] tokens=[64]\ncapture prefill_audio replays prefill\n"
     "bidirectional prefill_audio", ["MW416"]),
    ("capture prefill packed batch=[1] tokens=[64]\ncapture prefill_audio replays prefill\n"
     "submodel expert(hidden=16) for prefill_audio", ["MW416"]),
    ("kv_sequences main side\nkv prefill writes main\nkv prefill_audio writes side\n"
     "capture prefill packed batch=[1] tokens=[64]\ncapture prefill_audio replays prefill", ["MW416"]),
    # a replay makes the walks one capture family for a combined walk without a capture of its own
    ("capture prefill packed batch=[1] tokens=[64]\ncombine both = prefill + prefill_audio {\n    cap 2\n}",
     ["MW403"]),
    ("capture prefill packed batch=[1] tokens=[64]\ncapture prefill_audio replays prefill\n"
     "combine both = prefill + prefill_audio {\n    cap 1\n}", []),
])
def test_codes(body, codes):
    assert _codes(body) == codes


def test_a_replay_by_a_walk_that_does_not_run_the_node_is_mw401():
    text = NODE.format(body="    capture prefill packed batch=[1] tokens=[64]\n    capture other replays prefill") + \
        "\nnode Side kv(layers=1, kv_heads=1, qo_heads=1, head_dim=8, hidden=8, vocab=8) {\n" \
        "    in text_inputs: tokens prompt text\n    out new_token: tokens\n}\n" \
        "walk other {\n    Side(text_inputs) -> new_token: client text\n}\npartition O = other\n"
    diags = Diagnostics()
    spec = parse(text, "m.mw", diags)
    assert spec is not None
    for step in (resolve.run, check_graph.run):
        step(spec, diags)
    check_combine.run(spec, None, diags)
    assert [d.code for d in diags.items] == ["MW401"]
    assert "capture replay names walk other, which does not run LLM" in diags.items[0].message


CHUNKED = """
model: m
max_seq_len: 4096
max_step_tokens: 512
scheduler_owns_chunking: true
max_prefill_chunk_size: 256
node_groups:
  - node_names: [LLM]
    ranks: [0]
"""


def test_buckets_below_the_budget_are_judged_over_all_packed_families_of_the_walk():
    small = "capture prefill packed batch=[4] tokens=[128]"
    assert _codes(small, CHUNKED) == ["MW422"]
    assert _codes(small + "\ncapture prefill packed batch=[1] tokens=[512]", CHUNKED) == []


BUDGET = """
model: m
max_seq_len: 4096
node_groups:
  - node_names: [LLM]
    ranks: [0]
capture_memory_budget_mb: {mb}
"""


def test_a_replayed_family_is_counted_once_in_the_capture_memory():
    from mstar.compiler import capture_memory
    body = "capture prefill packed batch=[1, 2, 4] tokens=[1024, 2048]"
    diags = Diagnostics()
    spec = parse(NODE.format(body="    " + body), "m.mw", diags)
    assert spec is not None
    one = capture_memory.estimate_family_bytes(spec.nodes[0], spec.nodes[0].captures[0], 1)
    mb = (one + one // 2) / 2 ** 20  # room for one family, not two
    assert _codes(body + "\ncapture prefill_audio replays prefill", BUDGET.format(mb=mb)) == []
    assert _codes(body + "\ncapture prefill_audio packed batch=[1, 2, 4] tokens=[1024, 2048]",
                  BUDGET.format(mb=mb)) == ["MW408"]
