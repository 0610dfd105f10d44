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
