"""Which walks' prompt rows may be cut into chunks (mstar/compiler/chunking.py), on the real specs."""
from pathlib import Path

from mstar.compiler.chunking import is_chunkable, node_calls
from mstar.compiler.driver import load_checked_spec
from mstar.lang.diagnostics import Diagnostics

ROOT = Path(__file__).resolve().parents[2]


def chunkable(model: str, node: str) -> dict[str, bool]:
    spec = load_checked_spec(ROOT / "specs" / f"{model}.mw", Diagnostics())
    assert spec is not None
    decl = next(n for n in spec.nodes if n.name == node)
    return {walk.name: is_chunkable(decl, walk) for walk in spec.walks
            if any(True for _ in node_calls(walk.body, node))}


def test_text_prefills_are_cut_and_loops_and_bidirectional_walks_are_not():
    assert chunkable("llama", "LLM") == {"prefill": True, "decode": False}
    bagel = chunkable("bagel", "LLM")
    assert bagel["prefill_text"] is True
    # image tokens attend to each other (bidirectional), the flow loop reads KV: never cut
    assert bagel["prefill_vit"] is False and bagel["prefill_vae"] is False
    assert bagel["decode"] is False and bagel["image_gen"] is False


def test_a_stateless_node_is_never_cut():
    assert not any(chunkable("orpheus", "snac_decoder").values())


def test_prefix_walks_leave_out_walks_that_send_a_value_per_prompt_position():
    """A prefix walk's row may start after a cached prefix only when what it sends comes from its
    last position: Qwen3-Omni's Thinker streams its prompt's states to the Talker (MW429)."""
    from mstar.compiler.chunking import prefix_walks

    def walks_of(model: str, node: str) -> list[str]:
        spec = load_checked_spec(ROOT / "specs" / f"{model}.mw", Diagnostics())
        assert spec is not None
        return prefix_walks(next(n for n in spec.nodes if n.name == node), spec.walks)

    assert walks_of("llama", "LLM") == ["prefill"]
    assert walks_of("bagel", "LLM") == ["prefill_text"]
    assert walks_of("qwen3_omni", "Thinker") == []


def test_a_node_that_cross_attends_is_never_cut():
    """Whisper's decoder: its runner starts the decoder sequence from the whole prompt and samples
    on every row (a cut prompt stopped after two tokens)."""
    assert not any(chunkable("whisper", "decoder").values())


def test_a_key_of_loop_rows_only_carries_no_step_token_budget(tmp_path):
    """Cosmos 3 with chunked prefill: its prompt walks' keys carry the budget; image_gen's and
    video_gen's keys (the DiT runs only inside their flow loops: 8 rows of up to 1,560 latent tokens
    a step) carry none, so the budget neither holds them to one row a step nor fails MW421 (it
    did, and Cosmos 3 could not use chunking)."""
    from mstar.compiler.driver import compile_spec

    config = tmp_path / "cosmos3_chunked.yaml"
    config.write_text((ROOT / "configs" / "cosmos3.yaml").read_text()
                      + "max_step_tokens: 256\nscheduler_owns_chunking: true\nmax_prefill_chunk_size: 256\n")
    diags = Diagnostics()
    result = compile_spec(ROOT / "specs" / "cosmos3.mw", config, diags, tmp_path / "cosmos3.plan")
    assert result is not None, diags.render()
    budgets = {key.name: key.token_budget for worker in result.plan.workers for key in worker.keys}
    assert budgets["dit:prefill"] == budgets["dit:prefill_cond"] == 256
    assert budgets["dit:image_gen"] is None and budgets["dit:video_gen"] is None


def test_loop_rows_combined_with_prompts_keep_the_budget_check():
    """Decode rows that share a key with prompt chunks (llama's combined walk) still carry the
    budget, and MW421 still asks that a full step of them fits it (its fixture)."""
    from mstar.compiler.chunking import holds_only_fixed_rows

    spec = load_checked_spec(ROOT / "specs" / "llama.mw", Diagnostics())
    assert spec is not None
    node = spec.nodes[0]
    walks = {w.name: w for w in spec.walks}
    assert holds_only_fixed_rows(node, [walks["decode"]])
    assert not holds_only_fixed_rows(node, [walks["prefill"], walks["decode"]])
    assert not holds_only_fixed_rows(node, [])


def test_a_walk_with_batching_rules_is_never_cut():
    """Its rows share a step by their class, whole (runtime/scheduler/batch_rules.py)."""
    from compiler_helpers import spec_from

    text = (ROOT / "tests" / "checks" / "fixtures" / "base.mw").read_text()
    for rules, expected in (("", True), ("    batching prefill same shape\n", False)):
        spec = spec_from(text.replace("    cap prefill 4\n", "    cap prefill 4\n" + rules))
        walks = {w.name: w for w in spec.walks}
        assert is_chunkable(spec.nodes[0], walks["prefill"]) is expected


def test_a_depth_model_does_not_keep_a_walk_from_the_prefix_cache():
    """Qwen3-TTS's code predictor extends each Talker token (a depth model, `samples`): the cached
    pages hold the Talker's own KV, so talker_prefill may start after a cached prefix; a sub-model
    that replaces the node's model on a walk (Cosmos 3's generation tower) would not."""
    from mstar.compiler.chunking import prefix_walks

    spec = load_checked_spec(ROOT / "specs" / "qwen3_tts.mw", Diagnostics())
    assert spec is not None
    talker = next(n for n in spec.nodes if n.name == "Talker")
    assert any(sub.samples for sub in talker.submodels)
    assert prefix_walks(talker, spec.walks) == ["talker_prefill"]


TWO_CALLS = """
model m
node LLM kv(layers=2, kv_heads=2, qo_heads=4, head_dim=64, hidden=256, vocab=1024) {
    in text_inputs: tokens prompt text
    in h: hidden
    out h: hidden
    out new_token: tokens
}
walk prefill {
    LLM(text_inputs) -> h: LLM
    LLM(%s) -> new_token: client text
}
partition P = prefill
"""


def test_every_call_of_a_prefix_walk_takes_the_prompt():
    """A cache hit is found by the prompt's token ids: a walk with a call of the node that does not
    take the prompt cannot start that call after a cached prefix."""
    from compiler_helpers import spec_from
    from mstar.compiler.chunking import prefix_walks

    spec = spec_from(TWO_CALLS % "text_inputs, h")
    assert prefix_walks(spec.nodes[0], spec.walks) == ["prefill"]
    spec = spec_from(TWO_CALLS % "h")
    assert prefix_walks(spec.nodes[0], spec.walks) == []


def test_hidden_states_fed_back_into_the_node_are_its_last_position_only():
    """An edge of a hidden output into the node itself carries the last position's state (the torch
    engine's DecoderRunner), not a value per prompt position: it does not keep a prefix walk."""
    from compiler_helpers import spec_from
    from mstar.compiler.chunking import per_position_edges

    spec = spec_from(TWO_CALLS % "text_inputs, h")
    assert per_position_edges(spec.nodes[0], spec.walks[0]) == []
    sent = spec_from(TWO_CALLS.replace("    LLM(text_inputs) -> h: LLM\n    LLM(%s) -> new_token: client text\n",
                                       "    LLM(text_inputs) -> h: client latents\n"))
    assert [(e.name, e.dest) for e in per_position_edges(sent.nodes[0], sent.walks[0])] == [("h", "client")]
