"""`unroll_prompts=N` (a batched capture of one token a row): where MW426 refuses it, that a right
spec passes and carries it into the plan, and that it parses and formats back."""
import textwrap

import pytest

from checks_golden import check_spec_text
from mstar.lang.diagnostics import Diagnostics
from mstar.lang.fmt import format_spec
from mstar.lang.parser import parse
from mstar.plan.io import load_plan

SPEC = """model m
node LLM kv(layers=2, kv_heads=2, qo_heads=2, head_dim=8, hidden=16, vocab=64{args}) {{
    in text_inputs: tokens prompt text
    out text_inputs: tokens
    out new_token: tokens
    kv_sequences main
{body}
}}

walk prefill {{
    LLM(text_inputs) -> new_token: client text persist
}}

walk decode {{
    loop decode_loop max=64 stop {{
        LLM(text_inputs) -> text_inputs: LLM device
                         -> new_token: client text
    }}
}}

partition P = prefill -> decode
"""
RECURRENT = "    state recurrent(layers=1, heads=2, key_dim=8, value_dim=8)\n"


def _diags(body: str, args: str = "") -> Diagnostics:
    return check_spec_text(SPEC.format(body=textwrap.indent(textwrap.dedent(body).strip("\n"), "    "), args=args))


@pytest.mark.parametrize("body, args, words", [
    ("capture decode batched batch=[1, 4, 16] unroll_prompts=16", "", None),
    ("capture decode batched batch=[1, 4, 16] unroll_prompts=17", "", "above the largest captured batch size 16"),
    ("capture decode batched batch=[1, 4] unroll_prompts=1", "", "one-token row already"),
    ("capture prefill packed batch=[1] tokens=[32] unroll_prompts=4", "", "a packed family"),
    ("capture decode batched batch=[1, 4] tokens_per_row=2 unroll_prompts=4", "", "2-token-a-row"),
    (RECURRENT + "capture decode batched batch=[1, 4] unroll_prompts=4", ", layer_pattern=[0, 1]", "recurrent state"),
])
def test_unroll_prompts_is_refused_where_a_step_cannot_unroll(body, args, words):
    diags = _diags(body, args)
    codes = [d.code for d in diags.items]
    if words is None:
        assert codes == [], diags.render()
        return
    assert codes == ["MW426"], diags.render()
    assert words in diags.items[0].message and "unroll_prompts=" in diags.items[0].message


def test_unroll_prompts_parses_and_formats_back():
    diags = Diagnostics()
    text = SPEC.format(body="    capture decode batched batch=[1, 4, 16] unroll_prompts=8", args="")
    spec = parse(text, "m.mw", diags)
    assert spec is not None and spec.nodes[0].captures[0].unroll_prompts == 8
    assert "capture decode batched batch=[1, 4, 16] unroll_prompts=8" in format_spec(spec)


def test_the_llama_plan_unrolls_short_prompts_on_its_decode_family():
    plan = load_plan("generated/llama.plan")
    families = {f.name: f for w in plan.workers for k in w.keys for f in k.captures}
    assert families["LLM:decode"].unroll_prompts == 16
    assert all(f.unroll_prompts == 0 for name, f in families.items() if name != "LLM:decode")
