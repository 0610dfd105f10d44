"""The deployment loader: reference YAML accepted unchanged, mstar keys, located errors."""
from pathlib import Path

import pytest
from hypothesis import given, strategies as st

from mstar.compiler.deployment import load_deployment, parse_deployment
from mstar.lang.diagnostics import Diagnostics

FIXTURES = Path(__file__).parent / "fixtures" / "deployments"
CONFIGS = sorted((Path(__file__).parents[2] / "configs").glob("*.yaml"))


def _load_text(text: str) -> tuple:
    diags = Diagnostics()
    return parse_deployment(text, "d.yaml", diags), diags


def test_reference_yaml_loads_unchanged():
    diags = Diagnostics()
    dep = load_deployment(str(FIXTURES / "reference_style.yaml"), diags)
    assert diags.items == []
    assert dep is not None
    assert dep.name == "reference_style"
    assert dep.model == "qwen3_omni"
    assert dep.kv_cache.flashinfer_backend == "fa2"
    assert dep.model_kwargs["talker_max_tokens"] == 4096
    thinker = dep.groups_for("Thinker", "thinker_decode")
    assert [g.index for g in thinker] == [1] and thinker[0].world_size == 2
    assert dep.groups_for("Thinker", "talker_decode") == []
    assert [g.index for g in dep.groups_for("Talker", "anything")] == [2]
    # With no kv_pool the pool falls back to kv_cache.
    assert dep.kv_pool_for("Thinker").num_pages == 1024
    assert dep.kv_pool_for("Thinker").page_size == 128
    assert dep.ranks() == [0, 1, 2]


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.stem)
def test_every_config_loads(path):
    diags = Diagnostics()
    dep = load_deployment(str(path), diags)
    assert diags.render() == ""
    assert dep is not None and dep.name == path.stem
    assert dep.capture_memory_budget_mb is not None


def test_mstar_keys():
    dep, diags = _load_text(
        "model: m\nmax_seq_len: 64\nnode_groups:\n  - node_names: [A]\n    ranks: [0]\n"
        "kv_pool: {page_size: 16, num_pages: 64, nodes: {A: {num_pages: 8}}}\n"
        "capture_memory_budget_mb: 512\nspeculation_mixes_walks: [A.decode, B]\n"
        "recurrent_state_slots: 9\nmax_consecutive_follower_batches: 2\n")
    assert diags.items == []
    assert dep.kv_pool_for("A").num_pages == 8 and dep.kv_pool_for("C").num_pages == 64
    assert dep.capture_memory_budget_bytes == 512 * 1024 * 1024
    assert dep.mixes_walks("A", "decode") and not dep.mixes_walks("A", "prefill")
    assert dep.mixes_walks("B", "x")
    assert dep.node_groups[0].span_of("ranks").line == 5


def test_unknown_key_located_with_suggestion():
    _, diags = _load_text(
        "model: m\nmax_seq_len: 64\nnode_groups:\n  - node_names: [A]\n    ranks: [0]\n"
        "    tp_sise: 2\n")
    assert diags.render() == (
        "d.yaml:6:5: error[MW303]: unknown key 'tp_sise' in node_groups[0]; did you mean 'tp_size'?\n"
        "    6 |     tp_sise: 2\n"
        "      |     ^^^^^^^\n")


def test_unknown_top_level_key():
    _, diags = _load_text("model: m\nmax_seq_len: 64\nnode_groups: [{node_names: [A], ranks: [0]}]\n"
                          "kv_pools: {}\n")
    assert [d.code for d in diags.items] == ["MW303"]
    assert "did you mean 'kv_pool'" in diags.items[0].message
    assert diags.items[0].span.line == 4


def test_wrong_type_located():
    _, diags = _load_text("model: m\nmax_seq_len: big\nnode_groups: [{node_names: [A], ranks: [0, x]}]\n")
    rendered = diags.render()
    assert "d.yaml:2:14: error[MW304]: max_seq_len: input should be a valid integer" in rendered
    assert "d.yaml:3:44: error[MW304]: node_groups[0].ranks[1]" in rendered


def test_malformed_yaml():
    _, diags = _load_text("model: m\n  oops: [\n")
    assert [d.code for d in diags.items] == ["MW302"]
    assert diags.items[0].span.line == 2


@pytest.mark.parametrize("text, line, col, hint", [
    # a key indented as its list item's `-` (PyYAML: "expected <block end>, but found '?'")
    ("model: m\nnode_groups:\n  - node_names: [A]\n  ranks: [0]\n", 4, 3,
     "the line's indentation does not continue the block begun at line 3"),
    ("model: m\n  max_seq_len: 3\n", 2, 14, "is this `key:` indented further than the key above it"),
    ("model: m\nnode_groups:\n\t- node_names: [A]\n", 3, 1, "YAML indents with spaces, never tabs"),
    ("model: m\nnode_groups:\n  - node_names: [A\n    ranks: [0]\n", 4, 10,
     "is the `]` of the list opened at line 3 missing?"),
])
def test_malformed_yaml_says_what_the_user_most_likely_wrote(text, line, col, hint):
    _, diags = _load_text(text)
    (diagnostic,) = diags.items
    assert (diagnostic.code, diagnostic.span.line, diagnostic.span.col) == ("MW302", line, col)
    assert diagnostic.message.startswith("not valid YAML: ") and hint in diagnostic.message


def test_missing_and_empty():
    _, diags = _load_text("")
    assert [d.code for d in diags.items] == ["MW305"]
    _, diags = _load_text("model: m\n")
    assert sorted(d.message for d in diags.items) == [
        "missing required key 'max_seq_len'", "missing required key 'node_groups'"]


def test_not_a_mapping_and_duplicate_key():
    _, diags = _load_text("- a\n- b\n")
    assert [d.code for d in diags.items] == ["MW304"]
    _, diags = _load_text("model: m\nmodel: n\n")
    assert [d.message for d in diags.items] == ["key 'model' given twice"]


def test_unreadable_file(tmp_path):
    diags = Diagnostics()
    assert load_deployment(str(tmp_path / "absent.yaml"), diags) is None
    assert [d.code for d in diags.items] == ["MW301"]
    bad = tmp_path / "bin.yaml"
    bad.write_bytes(b"\xff\xfe\x00")
    diags = Diagnostics()
    assert load_deployment(str(bad), diags) is None
    assert [d.code for d in diags.items] == ["MW301"]


@pytest.mark.parametrize("text", ["{", "a: [1, {b: }", "!!python/object:os.system x", "- [[[",
                                  "model: &a [*a]", "? [a]\n: b", "model: 1\n\t- x"])
def test_broken_input_never_raises(text):
    dep, diags = _load_text(text)
    assert dep is None and diags.has_errors

YAML_PIECES = ["model: m\n", "max_seq_len: 8\n", "node_groups:\n", "  - node_names: [A]\n",
               "    ranks: [0]\n", "    tp_size: 2\n", "kv_pool: {page_size: 0}\n", "- x\n", ": \n",
               "  bad\n", "&a [*a]\n", "'\n", "[\n", "{a: 1, a: 2}\n", "ranks: [-1]\n", "\t\n",
               "model: [1]\n", "speculation_mixes_walks: LLM\n", "!!binary x\n"]


@given(st.lists(st.sampled_from(YAML_PIECES), max_size=8), st.text(max_size=20))
def test_any_text_gives_diagnostics_never_an_exception(pieces, noise):
    dep, diags = _load_text("".join(pieces) + noise)
    assert (dep is None) == diags.has_errors
    diags.render()


@pytest.mark.parametrize("value, tag", [("!!set {x, y}", "!!set"), ("!foo [0]", "!foo"), ("!!omap [{a: 1}]", "!!omap"),
                                        ("!!python/tuple [1]", "!!python/tuple")])
def test_a_tagged_list_or_mapping_is_refused_like_a_tagged_scalar(value, tag):
    """docs/limits.md: sets and tags mstar does not read are MW304; only a scalar's tag was checked, so a
    tagged list or mapping under a free-form key (`model_kwargs`) loaded as a plain one."""
    base = "model: m\nmax_seq_len: 8\nnode_groups:\n  - node_names: [A]\n    ranks: [0]\n"
    dep, diags = _load_text(base + f"model_kwargs: {{a: {value}}}\n")
    assert dep is None and [d.code for d in diags.items] == ["MW304"]
    assert f"the tag '{tag}'" in diags.items[0].message
    dep, diags = _load_text(base + "model_kwargs: {a: !!map {b: 1}, c: !!seq [1]}\n")
    assert dep is not None and not diags.items
