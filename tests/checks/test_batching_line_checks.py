"""MW412 and MW401 of `batching` lines beyond the golden fixture: a walk's rows are at one
iteration only where a loop encloses the node's own call (a loop of other nodes does not count,
nor do other calls in the loop hide it), and a line already refused is reported once."""
import pytest

from checks_golden import check_texts

SPEC = """model m
node enc stateless vision_encoder(hidden=64) {
    in image_inputs: media prompt image
    out img_emb: hidden
}
node LLM kv(layers=2, kv_heads=2, qo_heads=4, head_dim=64, hidden=256, vocab=1024) {
    in text_inputs: tokens prompt text
    in img_emb: hidden
    out text_inputs: tokens
    out new_token: tokens
    %s
}
walk prefill {
    LLM(text_inputs) -> new_token: conductor persist
}
walk encode {
    enc(image_inputs) -> img_emb: conductor persist
}
walk decode {
    loop decode_loop max=64 stop {
        LLM(text_inputs) -> text_inputs: LLM device
                         -> new_token: client text
        enc(image_inputs) -> img_emb: conductor
    }
}
walk looped_enc {
    LLM(text_inputs, img_emb) -> new_token: client text
    loop l max=4 {
        enc(image_inputs) -> img_emb: conductor
    }
}
partition P = prefill -> decode
partition E = encode
partition L = looped_enc
"""


@pytest.mark.parametrize("line, found", [
    # the node's call shares its loop with another node's call: still in a loop
    ("batching decode same iteration", []),
    # a loop that runs only other nodes: LLM's rows are all at iteration 0
    ("batching looped_enc same iteration", [("MW412", 11, 30)]),
    # a walk that does not run LLM: MW401 alone, its rules are not judged too
    ("batching encode same iteration", [("MW401", 11, 14)]),
    # a second line for a walk: MW412 once, at the second line, its rules not judged too
    ("batching prefill same shape\n    batching prefill same iteration", [("MW412", 12, 14)]),
])
def test_batching_lines(line, found):
    assert [(d.code, d.span.line, d.span.col) for d in check_texts(SPEC % line).sorted()] == found
