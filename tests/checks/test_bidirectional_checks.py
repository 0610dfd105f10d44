"""Checks of a node's `bidirectional` line: unknown or repeated walks, walks that do not run the
node (MW103, MW107, MW401); the mixed-mask combine (MW410) has its golden fixture."""
import pytest

from mstar.compiler import check_combine, resolve
from mstar.lang.diagnostics import Diagnostics
from mstar.lang.parser import parse

SPEC = """model m
node vit stateless vision_encoder {
    in image_inputs
}
node LLM kv(layers=2, vocab=64) {
    in text_inputs
    in img_emb
    bidirectional %s
}
walk prefill_vit {
    vit(image_inputs) -> img_emb: LLM
    LLM(img_emb) -> new_token: client text
}
walk encode_only {
    vit(image_inputs) -> img_emb: conductor
}
walk prefill_text {
    LLM(text_inputs) -> new_token: client text
}
partition P = prefill_vit -> prefill_text
partition E = encode_only
"""


def diagnostics(walks: str) -> str:
    diags = Diagnostics()
    spec = parse(SPEC % walks, "m.mw", diags)
    resolve.run(spec, diags)
    if not diags.has_errors:
        check_combine.run(spec, None, diags)
    return diags.render()


@pytest.mark.parametrize("walks, fragment", [
    ("prefill_vitt", "error[MW103]: unknown walk 'prefill_vitt'; did you mean 'prefill_vit'?"),
    ("prefill_vit prefill_vit", "error[MW107]: bidirectional of node LLM lists a walk twice"),
    ("encode_only", "error[MW401]: bidirectional walk encode_only, which does not run LLM"),
])
def test_bad_bidirectional_lines(walks, fragment):
    assert fragment in diagnostics(walks)


def test_a_good_line_passes():
    assert diagnostics("prefill_vit") == ""
