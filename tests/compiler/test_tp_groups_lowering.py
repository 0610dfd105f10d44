"""TP groups of a node group restricted by `graph_walks`, and a stateless node run at two world sizes:
lowering writes each TP group with the walks its group places (not every walk of the node), and
load_plan's rank checks take a stateless node at different widths (only a KV cache cannot move
between TP world sizes, MW321)."""
from compiler_helpers import checked_plan

from mstar.plan.references import reference_problems

SPEC = """
model m
node enc stateless vision_encoder(hidden=64) tp {
    in image_inputs: media prompt image
    out img_emb: hidden
}
node LLM kv(layers=2, kv_heads=2, qo_heads=4, head_dim=64, hidden=256, vocab=1024) {
    in text_inputs: tokens prompt text
    in img_emb: hidden
    out new_token: tokens
}
walk enc_a {
    enc(image_inputs) -> img_emb: conductor persist
}
walk enc_b {
    enc(image_inputs) -> img_emb: conductor persist
}
walk decode {
    LLM(text_inputs, img_emb) -> new_token: client text
}
partition P = (enc_a | enc_b) -> decode
"""

CONFIG = """
model: m
max_seq_len: 64
node_groups:
  - node_names: [enc]
    ranks: [0, 1]
    tp_size: 2
    graph_walks: [enc_a]
  - node_names: [enc]
    ranks: [0]
    graph_walks: [enc_b]
  - node_names: [LLM]
    ranks: [0]
"""


def test_a_tp_group_lists_the_walks_its_node_group_places():
    plan = checked_plan(SPEC, CONFIG)
    groups = {w.rank: [(g.node, g.walks, g.ranks) for g in w.tp_groups] for w in plan.workers}
    assert groups == {0: [("enc", ["enc_a"], [0, 1])], 1: [("enc", ["enc_a"], [0, 1])]}


def test_a_stateless_node_at_two_world_sizes_is_a_consistent_plan():
    plan = checked_plan(SPEC, CONFIG)
    calls = {w.name: w.calls[0].instances for w in plan.walks if w.calls[0].node == "enc"}
    assert calls == {"enc_a": [[0, 1]], "enc_b": [[0]]}
    assert reference_problems(plan) == []
