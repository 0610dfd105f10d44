"""MW126 follows the lowering's rule of what a partition counts (compiler/counting.py): a depth
output sent to the client as text counts, and warns, only where no edge of the partition's walks
has `count_tokens`."""
from checks_golden import check_spec_text

SPEC = """model m
node T kv(layers=2, kv_heads=2, qo_heads=4, vocab=64) {
    in text_inputs: tokens prompt text
    out codes: tokens
    out marker: tokens
    submodel predictor(layers=1, vocab=16) samples codes depth=3 for speak
}

walk speak {
    T(text_inputs) -> codes: client text
MARKER}

partition P = speak
"""


def test_client_text_frames_warn_where_they_are_what_the_partition_counts():
    assert "warning[MW126]" in check_spec_text(SPEC.replace("MARKER", "")).render()


def test_client_text_frames_do_not_warn_where_another_edge_is_counted():
    rendered = check_spec_text(SPEC.replace("MARKER", "        -> marker: conductor count_tokens\n")).render()
    assert "MW126" not in rendered
