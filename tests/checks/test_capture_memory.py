"""Capture memory estimate and the budget check (MW408): growing a capture set is caught."""
from mstar.compiler import capture_memory, check_combine
from mstar.compiler.deployment import parse_deployment
from mstar.lang import ast
from mstar.lang.diagnostics import Diagnostics
from mstar.lang.parser import parse
from mstar.plan.io import load_plan
from mstar.plan.dims import decoder_dims

SPEC = """model grow
node LLM kv(layers=28, kv_heads=4, qo_heads=28, head_dim=128, hidden=3584, vocab=152064) {{
    in text_inputs
    capture decode batched batch={decode}
    capture prefill packed batch={prefill_batch} tokens=[128, 256, 512, 1024, 2048, 4096]
    combine mixed = prefill + decode {{
        capture packed batch={mixed_batch} tokens={mixed_tokens}
    }}
}}

walk prefill {{
    LLM(text_inputs) -> new_token: conductor persist
}}

walk decode {{
    loop decode_loop max=64 stop {{
        LLM(text_inputs) -> text_inputs: LLM device
    }}
}}

partition P = prefill -> decode
"""
# 7 + 2 x 6 + 2 x 5 = 29 buckets, as the reference's node had before its capture set grew.
NARROW = dict(decode="[1, 2, 4, 8, 16, 32, 64]", prefill_batch="[1, 2]", mixed_batch="[1, 4]",
              mixed_tokens="[128, 256, 512, 1024, 2048]")
# 8 + 4 x 6 + 4 x 9 = 68 buckets.
WIDE = dict(decode="[1, 2, 4, 8, 16, 32, 64, 128]", prefill_batch="[1, 2, 4, 8]",
            mixed_batch="[1, 4, 16, 64]",
            mixed_tokens="[128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768]")
CONFIG = """model: grow
max_seq_len: 32768
node_groups:
  - node_names: [LLM]
    ranks: [0]
capture_memory_budget_mb: 2048
"""


def _check(captures: dict) -> tuple[Diagnostics, ast.Spec]:
    diags = Diagnostics()
    spec = parse(SPEC.format(**captures), "grow.mw", diags)
    deployment = parse_deployment(CONFIG, "grow.yaml", diags)
    assert spec is not None and deployment is not None
    check_combine.run(spec, deployment, diags)
    return diags, spec


def test_narrow_capture_set_fits():
    diags, spec = _check(NARROW)
    assert diags.items == []
    node = spec.nodes[0]
    total = sum(capture_memory.num_graphs(c) for c in node.captures) + \
        capture_memory.num_graphs(node.combines[0].capture)
    assert total == 29


def test_growing_the_capture_set_past_the_budget_is_caught():
    diags, _ = _check(WIDE)
    assert [d.code for d in diags.items] == ["MW408"]
    message = diags.items[0].message
    assert message.startswith("capture memory estimate on rank 0 is ")
    assert "over capture_memory_budget_mb 2048" in message
    assert "LLM 68 buckets" in message
    assert "LLM:mixed 36 buckets" in message
    assert "grow.yaml:6:1: note: the budget" in diags.render()


def test_estimate_counts_buckets_and_tp():
    node = ast.NodeDecl(name="N", engine="kv", args=[ast.Arg(name="hidden", value=1024),
                                                     ast.Arg(name="intermediate", value=4096),
                                                     ast.Arg(name="vocab", value=1000)])
    batched = ast.CaptureDecl(walk="decode", family="batched", batch=[1, 2, 4])
    packed = ast.CaptureDecl(walk="prefill", family="packed", batch=[1, 2], tokens=[64, 128, 256])
    assert capture_memory.num_graphs(batched) == 3
    assert capture_memory.num_graphs(packed) == 6
    one = capture_memory.estimate_family_bytes(node, batched, 1)
    two = capture_memory.estimate_family_bytes(node, batched, 2)
    workspace = capture_memory.CAPTURE_WORKSPACE_BYTES
    assert two - workspace == (one - workspace) // 2
    # Logits of every graph: 1 + 2 + 4 rows of 1000 fp32 logits.
    assert one - workspace >= 7 * 1000 * 4
    stateless = node.model_copy(update={"engine": "stateless"})
    assert capture_memory.estimate_family_bytes(stateless, batched, 1) == one
    # More buckets never cost less.
    wider = batched.model_copy(update={"batch": [1, 2, 4, 8]})
    assert capture_memory.estimate_family_bytes(node, wider, 1) > one


def test_a_kv_node_without_intermediate_is_sized_as_the_runtime_builds_it():
    """The runtime builds a kv node's MLP 4 x hidden wide when its header leaves `intermediate` out
    (dims.py); the estimate once read the missing width as no MLP, which put bagel's and
    qwen3_omni's whole packed pools at a third of what the H200 measured."""
    hidden = [ast.Arg(name="hidden", value=1024), ast.Arg(name="vocab", value=1000)]
    stated = ast.NodeDecl(name="N", engine="kv", args=hidden + [ast.Arg(name="intermediate", value=4096)])
    left_out = ast.NodeDecl(name="N", engine="kv", args=hidden)
    for capture in (ast.CaptureDecl(walk="decode", family="batched", batch=[1, 2, 4]),
                    ast.CaptureDecl(walk="prefill", family="packed", batch=[1, 2], tokens=[64, 512])):
        assert capture_memory.estimate_family_bytes(left_out, capture, 1) == \
            capture_memory.estimate_family_bytes(stated, capture, 1)
    bagel = next(n for n in load_plan("generated/bagel.plan").nodes if n.name == "LLM")
    assert "intermediate" not in bagel.dims and decoder_dims(bagel, "spec").intermediate == 4 * bagel.dims["hidden"]


def test_estimate_counts_the_recurrent_layers_scratch():
    """A gated delta-net node's graphs also hold the largest batch's scratch of one linear layer:
    the rule's output and its normed copy in fp32 and the conv output (Qwen3.5's sizes: 16 heads of
    128 x 128); the states are updated in place, so they are not counted."""
    args = [ast.Arg(name="hidden", value=1024), ast.Arg(name="vocab", value=1000)]
    plain = ast.NodeDecl(name="N", engine="kv", args=args)
    state = ast.StateDecl(kind="recurrent", args=[ast.Arg(name="heads", value=16), ast.Arg(name="key_dim", value=128),
                                                 ast.Arg(name="value_dim", value=128)])
    hybrid = plain.model_copy(update={"states": [state]})
    batched = ast.CaptureDecl(walk="decode", family="batched", batch=[1, 8, 32])
    extra = capture_memory.estimate_family_bytes(hybrid, batched, 1) - capture_memory.estimate_family_bytes(
        plain, batched, 1)
    conv_dim = 3 * 16 * 128
    assert extra == 32 * (2 * 16 * 128 * 4 + conv_dim * 2)


def test_packed_estimates_hold_one_step_of_the_largest_key():
    """A packed family, whole or piecewise, keeps no output hidden states or logits per graph:
    every key lives in the largest key's shared pool and writes its logits into one buffer of the
    largest batch. A piecewise family also holds the queries and attention output that the eager
    attention reads and writes, two buffers of the largest token count (capture_memory's
    docstring, `boundary`); a whole family's pool holds POOL_SLACK times its largest key's peak
    (`peak`, `slack`). A batched family's graphs keep their own outputs."""
    args = [ast.Arg(name=n, value=v) for n, v in
            (("hidden", 2048), ("intermediate", 8192), ("vocab", 1000), ("qo_heads", 32), ("kv_heads", 8),
             ("head_dim", 64))]
    node = ast.NodeDecl(name="N", engine="kv", args=args)
    whole = ast.CaptureDecl(walk="prefill", family="packed", batch=[1, 2, 4], tokens=[64, 128, 256])
    piecewise = whole.model_copy(update={"is_piecewise": True})
    assert capture_memory.num_graphs(piecewise) == capture_memory.num_graphs(whole) == 9
    whole_bytes = capture_memory.estimate_family_bytes(node, whole, 1)
    piecewise_bytes = capture_memory.estimate_family_bytes(node, piecewise, 1)
    logit_row = 1000 * 2 + 8  # bf16 logits and the greedy ids
    outputs = 256 * 2048 * 2 + 4 * logit_row  # one output buffer of the largest key (256 tokens, 4 rows)
    logits = 4 * 1000 * 2  # the largest key's bf16 logits before their copy into the buffer
    boundary = 2 * 256 * 32 * 64 * 2  # queries + attention output of 256 tokens x 32 heads x 64
    layer = 256 * (6 * 2048 + 3 * 8192) * 2  # one layer's activations (the batched families' term)
    workspace = capture_memory.CAPTURE_WORKSPACE_BYTES
    assert piecewise_bytes == layer + logits + boundary + outputs + workspace
    # The MLP's peak (3 hidden + 3 intermediate) outweighs attention's (4 hidden + q/k/v + 2 q).
    peak = max(3 * 2048 + 3 * 8192, 4 * 2048 + (2048 + 2 * 512) + 2 * 2048)
    assert whole_bytes == int(256 * peak * capture_memory.POOL_SLACK) * 2 + logits + outputs + workspace
    # More token buckets below the largest cost nothing more: they share the largest key's pool.
    for family in (whole, piecewise):
        more = family.model_copy(update={"tokens": [32, 64, 96, 128, 192, 256]})
        assert capture_memory.estimate_family_bytes(node, more, 1) == capture_memory.estimate_family_bytes(
            node, family, 1)


def test_piecewise_batched_family_has_a_bucket_per_batch_size():
    node = ast.NodeDecl(name="N", engine="stateless", args=[ast.Arg(name="hidden", value=512)])
    batched = ast.CaptureDecl(walk="encode", family="batched", batch=[1, 2], tokens_per_row=100, is_piecewise=True)
    whole = batched.model_copy(update={"is_piecewise": False})
    # Keys of 100 and 200 tokens. Whole: each keeps its output states. Piecewise: one output buffer
    # of the largest key, and its queries and attention output (hidden-wide without qo_heads).
    estimate = capture_memory.estimate_family_bytes
    extra = estimate(node, batched, 1) - estimate(node, whole, 1)
    assert extra == (200 + 2 * 200 - (100 + 200)) * 512 * 2


def test_a_whole_packed_peak_is_attention_where_it_outweighs_the_mlp():
    """With a narrow MLP (intermediate 1024 against hidden 2048) a layer's peak is attention's:
    4 hidden + q, k and v (k and v kv_heads x head_dim wide, 8 x 64 here, not q's 32 x 64) + 2 q."""
    args = [ast.Arg(name=n, value=v) for n, v in
            (("hidden", 2048), ("intermediate", 1024), ("vocab", 1000), ("qo_heads", 32), ("kv_heads", 8),
             ("head_dim", 64))]
    node = ast.NodeDecl(name="N", engine="kv", args=args)
    whole = ast.CaptureDecl(walk="prefill", family="packed", batch=[1, 2, 4], tokens=[64, 128, 256])
    attention = 4 * 2048 + (2048 + 2 * 8 * 64) + 2 * 2048
    assert attention > 3 * 2048 + 3 * 1024
    outputs = 256 * 2048 * 2 + 4 * (1000 * 2 + 8)
    logits = 4 * 1000 * 2
    pool = int(256 * attention * capture_memory.POOL_SLACK) * 2
    assert capture_memory.estimate_family_bytes(node, whole, 1) == (
        pool + logits + outputs + capture_memory.CAPTURE_WORKSPACE_BYTES)


def test_the_recurrent_scratch_is_as_wide_as_the_linear_value_heads():
    """Qwen3.5's linear layers have more value heads than q/k heads (`linear_value_heads`): the
    rule's output, its normed copy and the value part of the conv output are that many heads wide."""
    state = ast.StateDecl(kind="recurrent", args=[ast.Arg(name="heads", value=16), ast.Arg(name="key_dim", value=128),
                                                 ast.Arg(name="value_dim", value=128)])
    args = [ast.Arg(name="hidden", value=1024), ast.Arg(name="vocab", value=1000)]
    plain = ast.NodeDecl(name="N", engine="kv", args=args)
    wide = ast.NodeDecl(name="N", engine="kv", args=args + [ast.Arg(name="linear_value_heads", value=32)],
                        states=[state])
    batched = ast.CaptureDecl(walk="decode", family="batched", batch=[1, 8, 32])
    extra = capture_memory.estimate_family_bytes(wide, batched, 1) - capture_memory.estimate_family_bytes(
        plain, batched, 1)
    conv_dim = 2 * 16 * 128 + 32 * 128
    assert extra == 32 * (2 * 32 * 128 * 4 + conv_dim * 2)
