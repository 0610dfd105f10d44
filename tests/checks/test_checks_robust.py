"""Mutated specs and deployments only ever produce diagnostics from the check passes."""
from pathlib import Path

from hypothesis import given, strategies as st

from mstar.compiler import check_combine, check_deployment, check_graph, resolve
from mstar.compiler.deployment import parse_deployment
from mstar.lang.diagnostics import Diagnostics
from mstar.lang.parser import parse

ROOT = Path(__file__).parents[2]
SPECS = sorted(p.read_text(encoding="utf-8") for p in (ROOT / "specs").glob("*.mw"))
CONFIGS = sorted(p.read_text(encoding="utf-8") for p in (ROOT / "configs").glob("*.yaml"))
WORDS = ["", "0", "-1", "x", "decode", "LLM", "[]", "{", ":", "- ", "tp_size: 2", "ranks: [0, 0]"]


@st.composite
def mutated(draw, texts):
    lines = draw(st.sampled_from(texts)).split("\n")
    for _ in range(draw(st.integers(0, 3))):
        i = draw(st.integers(0, len(lines) - 1))
        j = draw(st.integers(0, len(lines) - 1))
        op = draw(st.sampled_from(["delete", "duplicate", "swap", "word"]))
        if op == "delete" and len(lines) > 1:
            del lines[i]
        elif op == "duplicate":
            lines.insert(j, lines[i])
        elif op == "swap":
            lines[i], lines[j] = lines[j], lines[i]
        elif op == "word":
            words = lines[i].split(" ")
            words[draw(st.integers(0, len(words) - 1))] = draw(st.sampled_from(WORDS))
            lines[i] = " ".join(words)
    return "\n".join(lines)


@given(mutated(SPECS), mutated(CONFIGS))
def test_mutations_never_raise(spec_text, config_text):
    diags = Diagnostics()
    spec = parse(spec_text, "s.mw", diags)
    deployment = parse_deployment(config_text, "c.yaml", diags)
    if spec is None:
        return
    # Every pass runs even after earlier errors (the driver would stop): none may raise.
    resolve.run(spec, diags)
    check_graph.run(spec, diags)
    if deployment is not None:
        check_deployment.run(spec, deployment, diags)
    check_combine.run(spec, deployment, diags)
    diags.render()
