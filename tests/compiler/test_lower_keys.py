"""Keys and mixture tables: caps, rows limits, captures, batch_pad, attention routes."""
import pytest
from compiler_helpers import COLOCATED, TTS_SPEC, checked_plan

from mstar.compiler.lower_keys import batch_pad_table

THREE_WALKS = """
model three
node LLM kv(layers=1, kv_heads=1, qo_heads=1, head_dim=8, hidden=8, vocab=16) {
    in tokens: tokens prompt text
    out tokens: tokens
    out out: tokens
    cap a 8
    cap b 32
    cap c 4
    capture b batched batch=[1, 2, 4, 8, 16, 32]
    combine mix = a + b + c {
        rows a <= 2
        rows c <= 1
        capture packed batch=[1, 2, 4, 8] tokens=[64]
    }
}
walk a { LLM(tokens) -> out: client text }
walk b { loop bl max=10 stop { LLM(tokens) -> tokens: LLM device -> out: client text } }
walk c { LLM(tokens) -> out: client text }
partition P = a -> b -> c
"""
ONE_RANK = """
model: three
max_seq_len: 1024
node_groups:
  - node_names: [LLM]
    ranks: [0]
"""


def _key(spec_text, config_text, key_name, rank=0):
    plan = checked_plan(spec_text, config_text)
    worker = next(w for w in plan.workers if w.rank == rank)
    return next(k for k in worker.keys if k.name == key_name), worker


def test_mixture_caps_smallest_cap_among_walks_present():
    key, worker = _key(THREE_WALKS, ONE_RANK, "LLM:mix")
    assert key.walks == ["a", "b", "c"] and key.is_combined
    assert [m.mask for m in key.mixtures] == list(range(8))
    caps = {tuple(m.walks): m.cap for m in key.mixtures}
    assert caps[()] == 0
    assert caps[("a",)] == 8 and caps[("b",)] == 32 and caps[("c",)] == 4  # own caps
    assert caps[("a", "b")] == 8  # no combine cap: smallest cap among the walks present
    assert caps[("b", "c")] == 4
    assert caps[("a", "b", "c")] == 4
    assert key.rows_limits == {"a": 2, "c": 1}
    assert worker.walk_to_key == {"LLM/a": "LLM:mix", "LLM/b": "LLM:mix", "LLM/c": "LLM:mix"}


def test_mixture_labels_captures_and_attention():
    key, _ = _key(THREE_WALKS, ONE_RANK, "LLM:mix")
    by_walks = {tuple(m.walks): m for m in key.mixtures}
    assert by_walks[("b",)].label == "b" and by_walks[("b",)].capture == "LLM:b"
    assert by_walks[("b",)].attention == "decode"  # loops its token back into the node
    assert by_walks[("a",)].capture is None and by_walks[("a",)].attention == "prefill"
    mixed = by_walks[("a", "b")]
    assert mixed.label is None and mixed.capture == "LLM:mix"  # the combine's own capture
    assert mixed.attention == "split"  # the default route
    assert [f.name for f in key.captures] == ["LLM:b", "LLM:mix"]


def test_a_mixed_step_of_walks_without_captures_runs_eagerly():
    spec = THREE_WALKS.replace("    capture b batched batch=[1, 2, 4, 8, 16, 32]\n", "").replace(
        "        capture packed batch=[1, 2, 4, 8] tokens=[64]\n", "")
    key, _ = _key(spec, ONE_RANK, "LLM:mix")
    mixed = {tuple(m.walks): m for m in key.mixtures}[("a", "b")]
    assert mixed.capture is None and mixed.attention == "split" and key.captures == []


def test_combine_cap_and_capture_override():
    key, worker = _key(TTS_SPEC, COLOCATED, "LLM:mixed")
    by_walks = {tuple(m.walks): m for m in key.mixtures}
    assert by_walks[("prefill",)].cap == 8 and by_walks[("prefill",)].capture == "LLM:prefill"
    assert by_walks[("decode",)].cap == 32 and by_walks[("decode",)].capture == "LLM:decode"
    mixed = by_walks[("prefill", "decode")]
    # No combine cap in TTS_SPEC: smallest of 8 and 32.
    assert mixed.cap == 8 and mixed.capture == "LLM:mixed" and mixed.attention == "packed"
    families = {f.name: f for f in key.captures}
    assert sorted(families) == ["LLM:decode", "LLM:mixed", "LLM:prefill"]
    packed = families["LLM:mixed"]
    assert packed.kind == "packed" and packed.token_buckets == [64, 128] and packed.batch_sizes == [1, 4, 16]
    assert packed.num_graphs == 6 and packed.memory_bytes > 0
    assert worker.capture_memory_bytes == sum(
        f.memory_bytes for k in worker.keys for f in k.captures
    )
    codec = next(k for k in worker.keys if k.name == "codec:chunk")
    assert codec.mixtures[1].attention == "none" and codec.mixtures[1].cap == 4  # cap from capture


def test_batch_pad_direct_lookup():
    key, _ = _key(TTS_SPEC, COLOCATED, "LLM:mixed")
    decode = next(f for f in key.captures if f.name == "LLM:decode")
    assert decode.batch_pad[1:4] == [1, 2, 4] and decode.batch_pad[5] == 8 and decode.batch_pad[32] == 32
    assert len(decode.batch_pad) == 33
    mixed = next(f for f in key.captures if f.name == "LLM:mixed")
    assert mixed.batch_pad[2] == 4 and mixed.batch_pad[16] == 16


@pytest.mark.parametrize(
    "sizes, max_rows, expected",
    [
        ([1, 2, 4], 4, [0, 1, 2, 4, 4]),
        ([2, 8], 10, [0, 2, 2, 8, 8, 8, 8, 8, 8, 0, 0]),  # above every size: eager (0)
        ([4], 2, [0, 4, 4, 4, 4]),  # sized to the largest capture at least
    ],
)
def test_batch_pad_table(sizes, max_rows, expected):
    assert batch_pad_table(sizes, max_rows) == expected


IMAGE_LOOP = """
model img
node LLM kv(layers=1, kv_heads=1, qo_heads=1, head_dim=8, hidden=8, vocab=16) {
    in tokens: tokens prompt text in latents: flow_latents
    out tokens: tokens out t: tokens out latents: flow_latents
    cap gen 1
}
node dec stateless image_decoder { in latents: flow_latents out image: image }
walk text { loop tl max=4 stop { LLM(tokens) -> tokens: LLM device -> t: client text } }
walk gen {
    LLM(tokens)  # the request's prompt first, as every walk a request enters with
    loop max=3 { LLM(latents) -> latents: LLM } outputs latents
    dec(latents) -> image: client image
}
partition P = text | gen
"""


def test_attention_of_host_loop_back_is_prefill_device_loop_back_is_decode():
    config = "model: img\nmax_seq_len: 64\nnode_groups:\n  - node_names: [LLM, dec]\n    ranks: [0]\n"
    plan = checked_plan(IMAGE_LOOP, config)
    keys = {k.name: k for k in plan.workers[0].keys}
    assert keys["LLM:text"].mixtures[1].attention == "decode"  # sampled token, on the device
    assert keys["LLM:gen"].mixtures[1].attention == "prefill"  # latents through the host
    assert keys["LLM:gen"].mixtures[1].cap == 1
    assert keys["LLM:text"].mixtures[1].cap == 256  # no cap, no capture, no admission limit


DECODE_ROUTES = """
model routes
node LLM kv(layers=1, kv_heads=1, qo_heads=1, head_dim=8, hidden=8, vocab=16) {
    in tokens: tokens prompt text
    in side: tokens
    out tokens: tokens
    out side: tokens
    out out: tokens
    %s
}
walk one { loop l max=4 stop { LLM(tokens) -> tokens: LLM device -> out: client text } }
walk two { loop l max=4 stop { LLM(tokens, side) -> tokens: LLM device -> side: LLM -> out: client text } }
partition P = one | two
"""


@pytest.mark.parametrize("body, attention", [
    ("", {"one": "decode", "two": "prefill"}),  # a loop-back through the host: not one sampled token
    ("capture one batched batch=[1, 2]", {"one": "decode", "two": "prefill"}),
    # a packed family beside the batched one: its steps are not all one token a row
    ("capture one batched batch=[1, 2]\n    capture one packed batch=[1] tokens=[64]", {"one": "prefill",
                                                                                        "two": "prefill"}),
])
def test_decode_attention_needs_every_loop_back_and_every_family_one_token_a_row(body, attention):
    config = "model: routes\nmax_seq_len: 64\nnode_groups:\n  - node_names: [LLM]\n    ranks: [0]\n"
    plan = checked_plan(DECODE_ROUTES % body, config)
    keys = {k.name: k for k in plan.workers[0].keys}
    assert {walk: keys[f"LLM:{walk}"].mixtures[1].attention for walk in ("one", "two")} == attention


def test_a_key_keeps_the_rows_limits_of_the_walks_it_holds():
    """A rank that runs two of the combined walk's three walks keys those two: the rows limit of the
    walk that runs elsewhere is not the key's."""
    config = ("model: three\nmax_seq_len: 1024\nnode_groups:\n  - node_names: [LLM]\n    ranks: [0]\n"
              "    graph_walks: [a, c]\n  - node_names: [LLM]\n    ranks: [1]\n    graph_walks: [b]\n")
    key, _ = _key(THREE_WALKS, config, "LLM:mix")
    assert key.walks == ["a", "c"] and key.rows_limits == {"a": 2, "c": 1}
    config = config.replace("[a, c]", "[a, b]").replace("graph_walks: [b]", "graph_walks: [c]")
    key, _ = _key(THREE_WALKS, config, "LLM:mix")
    assert key.walks == ["a", "b"] and key.rows_limits == {"a": 2}
