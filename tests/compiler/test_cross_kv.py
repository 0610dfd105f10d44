"""The cross-attention KV construct: `cross_kv LABEL from INPUT tokens=N` parses, formats back,
lowers into the plan's `cross_kv` and `kv_access`, and the checks around it (MW121, MW130-MW133;
their golden fixtures are in tests/checks/fixtures)."""
from pathlib import Path

from mstar.compiler import check_roles
from mstar.compiler.driver import compile_spec
from mstar.lang import ast
from mstar.lang.diagnostics import Diagnostics
from mstar.lang.fmt import format_spec
from mstar.lang.parser import parse
from mstar.plan.schema import CrossKvPlan

ROOT = Path(__file__).resolve().parents[2]
WHISPER = (ROOT / "specs" / "whisper.mw").read_text()


def test_whisper_lowers_its_pool_and_kv_access():
    diags = Diagnostics()
    result = compile_spec(ROOT / "specs" / "whisper.mw", ROOT / "configs" / "whisper.yaml", diags)
    assert result is not None, diags.render()
    decoder = next(n for n in result.plan.nodes if n.name == "decoder")
    assert decoder.cross_kv == [CrossKvPlan(label="audio", source="encoder_states", num_tokens=1500)]
    access = {a.walk: (a.reads, a.writes) for a in decoder.kv_access}
    assert access == {"prefill": ([], ["main", "audio"]), "decode": (["audio"], ["main"])}
    # 4 cross_kv; 5 chunking, prefix cache; 6 submodels; 7 action; 8 piecewise; 9 several captures a walk;
    # 10 capture guidance modes and labels; 11 partition repeat, client latents
    assert result.plan.header.schema_version == 12


def test_whisper_asked_for_a_prefix_cache_and_offload_keeps_both_off_in_the_plan(tmp_path):
    """Its decoder's KV depends on the audio (MW428) and lives outside the paged pool (MW430): the
    plan says prefix_cache cross_attention and host_pages 0, so no runtime shares or moves it."""
    deployment = tmp_path / "whisper_variant.yaml"
    text = (ROOT / "configs" / "whisper.yaml").read_text()
    assert "kv_cache:\n" in text
    deployment.write_text(text.replace("kv_cache:\n", "kv_cache:\n  cpu_offload_pages: 512\n") + "prefix_cache: true\n")
    diags = Diagnostics()
    result = compile_spec(ROOT / "specs" / "whisper.mw", deployment, diags, tmp_path)
    assert result is not None, diags.render()
    assert {d.code for d in diags.sorted()} == {"MW428", "MW430"} and not diags.has_errors
    (pool,) = result.plan.deployment.kv_pools
    assert (pool.node, pool.prefix_cache, pool.prefix_walks, pool.host_pages) == ("decoder", "cross_attention", [], 0)


def test_cross_kv_formats_back_with_its_comment():
    diags = Diagnostics()
    spec = parse(WHISPER, "whisper.mw", diags)
    assert spec is not None, diags.render()
    text = format_spec(spec)
    assert text == WHISPER  # the checked-in spec is canonical
    pool = next(n for n in spec.nodes if n.name == "decoder").cross_kv[0]
    assert (pool.label, pool.source, pool.num_tokens) == ("audio", "encoder_states", 1500)
    again = parse(text, "again.mw", Diagnostics())
    assert again is not None and ast.same_meaning(again, spec)
    pool_line = "    cross_kv audio from encoder_states tokens=1500"
    moved = WHISPER.replace(pool_line + "\n", "").replace(
        "    kv_sequences main\n", "    kv_sequences main\n    # the pool\n" + pool_line + "  # 30 s\n")
    reparsed = parse(moved, "moved.mw", Diagnostics())
    assert reparsed is not None
    assert "    # the pool\n    cross_kv audio from encoder_states tokens=1500  # 30 s\n" in format_spec(reparsed)


def roles_errors(text: str) -> str:
    diags = Diagnostics()
    spec = parse(text, "w.mw", diags)
    assert spec is not None, diags.render()
    check_roles.run(spec, diags)
    return diags.render()


def test_a_kv_line_that_leaves_the_pool_out_is_mw121():
    text = WHISPER.replace("kv decode reads audio writes main", "kv decode writes main")
    rendered = roles_errors(text)
    assert "error[MW121]: walk decode leaves cross_kv audio of node decoder out" in rendered


def test_a_missing_kv_line_on_a_node_with_a_pool_is_mw121():
    rendered = roles_errors(WHISPER.replace("    kv decode reads audio writes main\n", ""))
    assert "node decoder keeps cross_kv audio, so walk decode must say which it reads or writes" in rendered


def test_a_llama_decoder_cannot_hold_a_pool():
    rendered = roles_errors(WHISPER.replace("node decoder kv(style=whisper,", "node decoder kv(style=llama,"))
    assert ("error[MW130]: cross_kv audio of node decoder: the decoder's style (llama) has no cross-attention"
            in rendered)


def test_the_whisper_spec_passes_the_role_checks():
    assert roles_errors(WHISPER) == ""
