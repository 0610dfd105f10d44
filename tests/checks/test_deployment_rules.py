"""Deployment checks (check_deployment.py) at the edges their golden fixtures leave open; each case
is one a mutation of the checks passed every other test with."""
from pathlib import Path

from checks_golden import check_texts

ROOT = Path(__file__).resolve().parents[2]
FIXTURES = Path(__file__).parent / "fixtures"
BASE = (FIXTURES / "base.mw").read_text()
BASE_OK = (FIXTURES / "base_ok.yaml").read_text()
HYBRID = (FIXTURES / "MW325_recurrent_slots_too_few.mw").read_text()
HYBRID_CONFIG = (FIXTURES / "MW325_recurrent_slots_too_few.yaml").read_text()


def _found(spec: str, config: str) -> list[tuple[str, str, int, int]]:
    return [(d.code, d.span.file, d.span.line, d.span.col) for d in check_texts(spec, config).sorted()]


def test_speculation_may_mix_only_walks_a_node_runs():
    assert _found(BASE, BASE_OK + "speculation_mixes_walks: [LLM.decode]\n") == []
    assert _found(BASE, BASE_OK + "speculation_mixes_walks: [codec.decode]\n") == [("MW312", "m.yaml", 11, 27)]


def test_graph_walks_of_a_group_of_two_nodes_need_only_one_to_run_them():
    """MW312 is for a listed walk that none of the group's nodes runs: codec_chunk is codec's."""
    config = BASE_OK.replace(
        "  - node_names: [LLM]\n    ranks: [0, 1]\n    tp_size: 2\n  - node_names: [codec]\n    ranks: [0]\n",
        "  - node_names: [LLM, codec]\n    ranks: [0]\n    graph_walks: [decode, codec_chunk]\n"
        "  - node_names: [LLM]\n    ranks: [0]\n    graph_walks: [prefill]\n")
    assert config != BASE_OK
    assert _found(BASE, config) == []


def test_as_many_recurrent_slots_as_requests_is_enough():
    assert _found(HYBRID, HYBRID_CONFIG.replace("recurrent_state_slots: 32", "recurrent_state_slots: 64")) == []
    assert [c for c, *_ in _found(HYBRID, HYBRID_CONFIG.replace("recurrent_state_slots: 32",
                                                                  "recurrent_state_slots: 63"))] == ["MW325"]


def test_a_kv_node_no_walk_runs_has_no_pool_to_check():
    """MW322 is about requests of max_seq_len a node's pool must hold; a node no walk runs holds none."""
    spec = HYBRID.replace("walk prefill", "node Spare kv(layers=2, kv_heads=2, qo_heads=4, head_dim=64, hidden=256, "
                          "vocab=1024) {\n    in text_inputs: tokens\n    out new_token: tokens\n}\n\nwalk prefill")
    config = HYBRID_CONFIG.replace("recurrent_state_slots: 32", "recurrent_state_slots: 64").replace(
        "max_seq_len: 2048", "max_seq_len: 2048\nkv_pool:\n  page_size: 16\n  num_pages: 256\n  nodes:\n"
        "    Spare: {num_pages: 1}")
    assert _found(spec, config) == []
    used = spec.replace("LLM(text_inputs) -> new_token: client text persist count_tokens",
                        "LLM(text_inputs) -> new_token: client text persist count_tokens\n"
                        "    Spare(text_inputs) -> new_token: conductor")
    assert [c for c, *_ in _found(used, config.replace("[LLM]", "[LLM, Spare]"))] == ["MW322"]


def test_a_cross_attending_node_has_no_host_pool_to_overflow():
    """Whisper's decoder keeps its KV outside the paged pool, so its plan's host_pages is 0 whatever
    cpu_offload_pages asks (MW430, a warning); 2e9 pages are not also MW323 against that pool."""
    config = (ROOT / "configs" / "whisper.yaml").read_text().replace(
        "  max_num_pages: 128\n", "  max_num_pages: 128\n  cpu_offload_pages: 2000000000\n")
    diags = check_texts((ROOT / "specs" / "whisper.mw").read_text(), config)
    assert [(d.code, d.severity) for d in diags.sorted()] == [("MW430", "warning")]


def test_a_pool_too_small_points_at_where_its_pages_come_from():
    """MW322 pointed at max_seq_len when the pages came from the reference's kv_cache.max_num_pages."""
    config = BASE_OK.replace("kv_pool: {page_size: 16, num_pages: 256}\n",
                             "kv_cache:\n  page_size: 16\n  max_num_pages: 100\n")
    assert config != BASE_OK
    assert _found(BASE, config) == [("MW322", "m.yaml", 11, 3)]  # the max_num_pages line
