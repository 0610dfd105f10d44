"""The node-argument registry (mstar/plan/node_args.py) agrees with what the runtime reads,
and its value rules and layer-pattern rule behave as documented."""
import re
from pathlib import Path

import pytest
from hypothesis import given, strategies as st

from mstar.plan.node_args import (
    ENGINE_ARGS, INDEX, INT, NUMBER, FRACTION, PATTERN, RECURRENT_ARGS, TOKEN_IDS, choice,
    layer_is_full, value_fits,
)
from mstar.lang.diagnostics import Diagnostics

ROOT = Path(__file__).resolve().parents[2]
RUNTIME = ROOT / "mstar" / "runtime"
# How the runtime reads a node's dims: dims.py's typed readers, dict lookups, and the stop-token keys.
READ_PATTERNS = (
    r'_(?:int|float|dim_int)\(node, "([a-z_]+)"',
    r'dims\.get\("([a-z_]+)"',
    r'dims\["([a-z_]+)"\]',
)


def runtime_dim_reads() -> set[str]:
    names: set[str] = set()
    for path in [*RUNTIME.rglob("*.py"), ROOT / "mstar" / "plan" / "dims.py"]:  # dims.py: what dims mean
        text = path.read_text(encoding="utf-8")
        for pattern in READ_PATTERNS:
            names.update(re.findall(pattern, text))
    runner = (RUNTIME / "engine" / "runners" / "decoder.py").read_text(encoding="utf-8")
    keys = re.search(r'for key in \(([^)]*)\)', runner)
    names.update(re.findall(r'"([a-z_]+)"', keys.group(1)))
    cli = (ROOT / "mstar" / "cli" / "mstar.py").read_text(encoding="utf-8")
    names.update(re.findall(r'dims\.get\("([a-z_]+)"', cli))
    return names


def test_every_dim_the_runtime_reads_is_registered():
    reads = runtime_dim_reads()
    assert {"layers", "kv_heads", "codebook", "stop_token", "stop_tokens", "sample_rate"} <= reads
    registered = set(ENGINE_ARGS["kv"]) | set(ENGINE_ARGS["stateless"])
    assert reads - registered == set()


def test_every_registered_dim_is_read_by_the_runtime():
    registered = set(ENGINE_ARGS["kv"]) | set(ENGINE_ARGS["stateless"])
    assert registered - runtime_dim_reads() == set()


@pytest.mark.parametrize("kind, good, bad", [
    (INT, [1, 4096], [0, -1, 1.5, "a", True, [1]]),
    (INDEX, [0, 3], [-1, 1.0, "a", False]),
    (NUMBER, [1, 0.5, 500000], [0, -2.0, "x", True]),
    (FRACTION, [0.25, 1], [0, 1.5, "x"]),
    (choice("llama", "qwen3_5"), ["llama"], ["Llama", 1, ["llama"]]),
    (PATTERN, [[0, 0, 0, 1], [1], "linear,full"], [[], [2], "linear,sparse", 3, [True]]),
    (TOKEN_IDS, [[0], [1, 2]], [[], [-1], 3, ["a"], [True]]),
])
def test_value_kinds(kind, good, bad):
    assert all(value_fits(kind, v) for v in good)
    assert not any(value_fits(kind, v) for v in bad)


def test_layer_pattern_rule():
    assert layer_is_full(None, 3, has_recurrent=False) == (True, True, True)
    assert layer_is_full(None, 8, has_recurrent=True) == (False, False, False, True) * 2
    assert layer_is_full([0, 1], 5, has_recurrent=False) == (False, True, False, True, False)
    assert layer_is_full("linear,linear,full", 3, has_recurrent=True) == (False, False, True)
    assert layer_is_full([2], 3, has_recurrent=False) is None


def _args_diagnostics(node_text: str) -> str:
    """check_args' rendered diagnostics for a spec holding just this node."""
    from mstar.compiler import check_args
    from mstar.lang.parser import parse
    diags = Diagnostics()
    spec = parse(f"model m\n{node_text}\n", "m.mw", diags)
    assert spec is not None, diags.render()
    check_args.run(spec, diags)
    return diags.render()


@given(st.sampled_from(sorted(ENGINE_ARGS["kv"])), st.integers(min_value=1, max_value=64))
def test_a_registered_name_is_never_unknown(name, value):
    assert "MW109" not in _args_diagnostics(f"node LLM kv({name}={value}) {{\n    in x\n}}")


def test_recurrent_state_args_are_all_required():
    text = _args_diagnostics("node LLM kv(layers=4, layer_pattern=[0, 0, 0, 1]) {\n    in x\n"
                             "    state recurrent(layers=3)\n}")
    assert "MW111" in text and "heads, key_dim, value_dim" in text
    assert set(RECURRENT_ARGS) == {"layers", "heads", "key_dim", "value_dim"}


def test_stateless_node_with_state_and_a_kv_only_argument():
    text = _args_diagnostics("node enc stateless vision_encoder(vocab=10) {\n    in x\n"
                             "    state recurrent(layers=1, heads=1, key_dim=1, value_dim=1)\n}")
    assert "'vocab' is not an argument of a stateless node" in text
    assert "error[MW112]: state recurrent on stateless node enc" in text


@pytest.mark.parametrize("node_text, fragment", [
    ("node L kv(layers=2, layers=3) {\n    in x\n}", "error[MW107]: argument 'layers' is given twice"),
    ("node L kv(layers=4, layer_pattern=[0, 0, 0, 1]) {\n    in x\n"
     "    state recurrent(layers=3, heads=2, key_dim=4, value_dim=4)\n"
     "    state recurrent(layers=3, heads=2, key_dim=4, value_dim=4)\n}", "error[MW107]: node L declares state twice"),
    ("node L kv(layers=4, layer_pattern=[0, 1]) {\n    in x\n}",
     "the layer pattern has 2 linear-attention layers but the node declares no `state recurrent(...)`"),
    ("node L kv(layers=4, layer_pattern=[0, 0, 0, 1], linear_value_heads=3) {\n    in x\n"
     "    state recurrent(layers=3, heads=2, key_dim=4, value_dim=4)\n}",
     "linear_value_heads=3 is not a multiple of the 2 linear q/k heads"),
    ("node L kv(layers=2, stop_tokens=[1, 99], vocab=50) {\n    in x\n}",
        "stop_tokens 99 is outside the vocabulary (vocab=50)"),
    ("node E stateless vision_encoder(hidden=100, heads=16) {\n    in x\n}",
     "hidden=100 is not a multiple of heads=16"),
    ("node L kv(layers=2, latent_tokens=15) {\n    in x\n}", "latent_tokens=15 is not a square grid"),
    ("node L kv(layers=2, partial_rotary=1.5) {\n    in x\n}", "partial_rotary=1.5 must be a number in (0, 1]"),
    # RoPE rotates dims in pairs: `--dims spec` failed every step with a size mismatch
    ("node L kv(layers=2, head_dim=7) {\n    in x\n}", "error[MW112]: node L: head_dim=7 is odd"),
    ("node L kv(layers=2, head_dim=64) {\n    in x\n    out t: tokens\n"
     "    submodel p(layers=1, head_dim=9) samples t depth=2 for w\n}", "node L: depth model p: head_dim=9 is odd"),
])
def test_argument_diagnostics(node_text, fragment):
    assert fragment in _args_diagnostics(node_text)


def test_well_formed_arguments_give_nothing():
    assert _args_diagnostics("node L kv(layers=8, kv_heads=2, qo_heads=8, layer_pattern=[0, 0, 0, 1], vocab=64,"
                             " stop_tokens=[1, 2], rope_theta=1e4, style=qwen3_5) {\n    in x\n"
                             "    state recurrent(layers=6, heads=2, key_dim=4, value_dim=4)\n}") == ""
