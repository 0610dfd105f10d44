"""The combined-walk rules of check_combine at the edges its golden fixtures leave open: each case
here is one a mutation of the check passed every other test with (a comparison flipped, a
condition dropped, a note or an underline moved)."""
from pathlib import Path

from checks_golden import check_texts
from mstar.compiler import check_combine
from mstar.compiler.deployment import parse_deployment
from mstar.lang.diagnostics import Diagnostics
from mstar.lang.parser import parse

FIXTURES = Path(__file__).parent / "fixtures"

NODE = """model m
node LLM kv(layers=2, kv_heads=2, qo_heads=4, head_dim=64, hidden=256, vocab=1024) {
    in text_inputs: tokens prompt text
    out text_inputs: tokens
    out new_token: tokens
%s
}
walk prefill {
    LLM(text_inputs) -> new_token: conductor persist
}
walk prefill_b {
    LLM(text_inputs) -> new_token: conductor persist
}
walk decode {
    loop decode_loop max=64 stop {
        LLM(text_inputs) -> text_inputs: LLM device
                         -> new_token: client text
    }
}
partition P = (prefill | prefill_b) -> decode
"""


def _found(body: str) -> list[tuple[str, int, int]]:
    return [(d.code, d.span.line, d.span.col) for d in check_texts(NODE % body).sorted()]


def test_a_combined_walk_of_bidirectional_walks_only_has_one_mask():
    """MW410 is for a mix of masks; walks that are all bidirectional share one."""
    assert _found("    bidirectional prefill prefill_b\n"
                  "    combine enc = prefill + prefill_b {\n        cap 4\n    }") == []


def test_a_mixed_step_default_cap_is_the_largest_cap_when_a_walk_has_none():
    """Without a cap of its own a mixed step takes the smallest cap of the walks in it; decode has
    no cap (any number of rows), so prefill + decode may hold prefill's 8 rows, above the capture's
    4 (MW405). With every walk capped the bound is the second largest cap (4 here: no error)."""
    combine = ("    combine mixed = prefill + prefill_b + decode {\n"
               "        capture packed batch=[1, 4] tokens=[64]\n    }")
    assert _found(f"    cap prefill 8\n    cap prefill_b 4\n{combine}") == [("MW405", 9, 9)]
    assert _found(f"    cap prefill 8\n    cap prefill_b 4\n    cap decode 2\n{combine}") == []


def test_eager_above_lets_a_combined_walk_cap_exceed_its_capture():
    assert _found("    combine mixed = prefill + decode {\n        cap 16\n"
                  "        capture packed batch=[1, 4] tokens=[64] eager_above\n    }") == []
    assert _found("    combine mixed = prefill + decode {\n        cap 16\n"
                  "        capture packed batch=[1, 4] tokens=[64]\n    }") == [("MW405", 7, 9)]


def test_a_rows_limit_may_equal_the_largest_packed_batch():
    rows = "    combine mixed = prefill + decode {\n        cap 4\n        rows prefill <= %d\n" \
           "        capture packed batch=[1, 4] tokens=[64]\n    }"
    assert _found(rows % 4) == []
    assert _found(rows % 5) == [("MW406", 8, 9)]


def test_a_combined_walk_named_like_a_walk_points_at_the_walk():
    """`combine codec_chunk = prefill + codec_chunk`: the error is about the walk codec_chunk
    (which does not run LLM), so it underlines the second `codec_chunk`, not the combine's name."""
    spec = (FIXTURES / "base.mw").read_text().replace("combine mixed = prefill + decode {",
                                                      "combine codec_chunk = prefill + codec_chunk {")
    assert [(d.code, d.span.line, d.span.col) for d in check_texts(spec).sorted()] == [("MW401", 14, 37)]


STATELESS_TP = """model m
node enc stateless vision_encoder(hidden=64) tp {
    in image_inputs: media prompt image
    out img_emb: hidden
    combine both = enc_a + enc_b {
        cap 4
    }
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

SPLIT_ENC = """model: m
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


def test_a_combined_walk_split_between_a_tp_group_and_a_single_rank_is_refused():
    """MW404: only walks all at world size 1 may run a mixed step from different node groups; a
    stateless node may run its walks at different world sizes (MW321 is for KV caches)."""
    found = [(d.code, d.span.file, d.span.line) for d in check_texts(STATELESS_TP, SPLIT_ENC).sorted()]
    assert found == [("MW404", "m.mw", 5)]
    single = SPLIT_ENC.replace("    tp_size: 2\n", "").replace("ranks: [0, 1]", "ranks: [0]")
    assert check_texts(STATELESS_TP, single).sorted() == []


def test_a_capture_replay_of_a_walk_by_itself_names_both_places():
    """`capture W replays W` for a walk W that does not run the node: one MW401 at each name."""
    spec = STATELESS_TP.replace("    out new_token: tokens\n}",
                                "    out new_token: tokens\n    capture enc_a replays enc_a\n}")
    assert [(d.code, d.span.line, d.span.col) for d in check_texts(spec).sorted()] == [
        ("MW401", 13, 13), ("MW401", 13, 27)]


def test_a_capture_estimate_equal_to_the_budget_is_within_it():
    spec_text = (FIXTURES / "base.mw").read_text()
    config = (FIXTURES / "base_ok.yaml").read_text().replace("capture_memory_budget_mb: 1024\n", "")
    diags = Diagnostics()
    spec, deployment = parse(spec_text, "m.mw", diags), parse_deployment(config, "m.yaml", diags)
    most = max(sum(f.num_bytes for f in families)
               for families in check_combine.worker_captures(spec, deployment).values())
    # budgets in MiB that are exactly `most` bytes and one byte less (a power-of-two quotient is exact)
    assert check_texts(spec_text, config + f"capture_memory_budget_mb: {most / 2**20!r}\n").sorted() == []
    over = check_texts(spec_text, config + f"capture_memory_budget_mb: {(most - 1) / 2**20!r}\n").sorted()
    assert [d.code for d in over] == ["MW408"]
