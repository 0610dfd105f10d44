"""Per-worker tables: placements, walk_to_key under disaggregation, call instances, speculation, TP."""
from compiler_helpers import COLOCATED, PD_SPLIT, TP2, TTS_SPEC, checked_plan



def _plan(config_text, spec_text=TTS_SPEC):
    return checked_plan(spec_text, config_text)


def test_colocated_walks_share_the_combined_key():
    (worker,) = _plan(COLOCATED).workers
    assert worker.placements == ["LLM/decode", "LLM/prefill", "codec/chunk"]
    assert worker.walk_to_key == {
        "LLM/prefill": "LLM:mixed", "LLM/decode": "LLM:mixed", "codec/chunk": "codec:chunk",
    }
    assert [k.name for k in worker.keys] == ["LLM:mixed", "codec:chunk"]


def test_pd_split_each_worker_keys_its_own_walk():
    plan = _plan(PD_SPLIT)
    prefill_rank, decode_rank = plan.workers
    assert prefill_rank.walk_to_key == {"LLM/prefill": "LLM:prefill", "codec/chunk": "codec:chunk"}
    assert decode_rank.walk_to_key == {"LLM/decode": "LLM:decode"}
    (decode_key,) = decode_rank.keys
    assert decode_key.walks == ["decode"] and not decode_key.is_combined
    assert [m.cap for m in decode_key.mixtures] == [0, 32]
    assert decode_key.rows_limits == {}  # rows limits only bound mixed steps


def test_routes_follow_placement():
    # Routing lives in the walk tables: each call lists the instances (ranks) that run it, and
    # each edge says where its value goes.
    plan = _plan(PD_SPLIT)
    calls = {(c.node, w.name): c for w in plan.walks for c in w.calls}
    assert calls[("LLM", "decode")].instances == [[1]]
    assert calls[("LLM", "prefill")].instances == [[0]] and calls[("codec", "chunk")].instances == [[0]]
    edges = {(e.name, e.dest_kind): e for e in calls[("LLM", "decode")].edges}
    assert edges[("text_inputs", "node")].action == "loop_back"
    stream = edges[("new_token", "stream")]
    assert stream.dest == "codec" and stream.stream_partition == "CODEC" and stream.action == "sink"
    (audio,) = calls[("codec", "chunk")].edges
    assert audio.modality == "audio" and audio.action == "sink"
    (persist,) = [e for e in calls[("LLM", "prefill")].edges if e.dest_kind == "conductor"]
    assert persist.is_persist and persist.action == "sink"


def test_speculation_switches():
    plan = _plan(PD_SPLIT)
    spec0 = {(s.node, s.walk): s for s in plan.workers[0].speculation}
    spec1 = {(s.node, s.walk): s for s in plan.workers[1].speculation}
    assert spec1[("LLM", "decode")].can_speculate  # on-device loop-back, async, not TP
    assert spec1[("LLM", "decode")].mixes_walks  # speculation_mixes_walks: [LLM.decode]
    assert not spec0[("LLM", "prefill")].can_speculate and not spec0[("LLM", "prefill")].mixes_walks
    tp_plan = _plan(TP2)
    tp_spec = {(s.node, s.walk): s for s in tp_plan.workers[0].speculation}
    assert not tp_spec[("LLM", "decode")].can_speculate  # lockstep TP never speculates


def test_tp_groups_and_deployment_tables():
    plan = _plan(TP2)
    assert [w.rank for w in plan.workers] == [0, 1, 2]
    for rank in (0, 1):
        (group,) = plan.workers[rank].tp_groups
        assert (group.node, group.ranks, group.tp_size, group.leader) == ("LLM", [0, 1], 2, 0)
        assert group.walks == ["decode", "prefill"]
    assert plan.workers[2].tp_groups == []
    (pool,) = plan.deployment.kv_pools
    assert (pool.node, pool.page_size, pool.num_pages, pool.max_seq_len) == ("LLM", 16, 512, 4096)
    assert plan.deployment.max_concurrent_requests == 64
    nodes = {n.name: n for n in plan.nodes}
    assert nodes["LLM"].is_tp and nodes["LLM"].dims["hidden"] == 64 and nodes["LLM"].kv_sequences == ["main"]
    assert nodes["codec"].model_kind == "audio_codec" and nodes["LLM"].model_kind == "decoder"
    assert nodes["codec"].stream_inputs == ["new_token"] and nodes["codec"].inputs == []


RECURRENT = """
model gdn
node LLM kv(layers=4, kv_heads=2, qo_heads=4, head_dim=16, hidden=64, vocab=128) {
    in tokens: tokens prompt text
    out out: tokens
    kv_sequences main cfg
    kv w writes main
    state recurrent(layers=3, heads=4, key_dim=16, value_dim=32)
    cap w 4
}
walk w { LLM(tokens) -> out: client text }
partition P = w
"""


def test_recurrent_state_slots_include_the_sink():
    config = ("model: gdn\nmax_seq_len: 512\nnode_groups:\n  - node_names: [LLM]\n    ranks: [0]\n"
              "recurrent_state_slots: 16\n")
    plan = _plan(config, RECURRENT)
    (node,) = plan.nodes
    assert node.kv_sequences == ["main", "cfg"]
    r = node.recurrent
    assert (r.num_layers, r.num_heads, r.key_dim, r.value_dim, r.num_slots) == (3, 4, 16, 32, 17)
