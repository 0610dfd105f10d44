"""Mutated specs and deployments only ever produce diagnostics from the check passes (all of
them, check_args included), never an exception.

An example mutates a spec, a config or both; the config is either one of the spec's model (so
mutated specs meet a deployment that fits them) or any config. Examples whose spec does not parse
stop early: with both sides always mutated, that was about 60% of them.
"""
from pathlib import Path

import yaml
from hypothesis import given, strategies as st

from mstar.compiler import check_args, check_combine, check_deployment, check_graph, check_roles, resolve
from mstar.compiler.deployment import parse_deployment
from mstar.lang.diagnostics import Diagnostics
from mstar.lang.parser import parse

ROOT = Path(__file__).parents[2]
SPECS = {p.stem: p.read_text(encoding="utf-8") for p in sorted((ROOT / "specs").glob("*.mw"))}
CONFIGS = {p.stem: p.read_text(encoding="utf-8") for p in sorted((ROOT / "configs").glob("*.yaml"))}
PAIRS = sorted((yaml.safe_load(text)["model"], config) for config, text in CONFIGS.items())
WORDS = ["", "0", "-1", "x", "decode", "LLM", "[]", "{", ":", "- ", "tp_size: 2", "ranks: [0, 0]"]


def mutate(draw, text: str) -> str:
    lines = text.split("\n")
    for _ in range(draw(st.integers(1, 3))):
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


@st.composite
def mutated(draw):
    """(spec text, config text): the spec, its config or both mutated; the config is one of the
    spec's model or, half the time, any config (model mismatches, unknown nodes, placements)."""
    model, config = draw(st.sampled_from(PAIRS))
    if draw(st.booleans()):
        config = draw(st.sampled_from(sorted(CONFIGS)))
    spec_text, config_text = SPECS[model], CONFIGS[config]
    target = draw(st.sampled_from(["spec", "config", "both"]))
    if target != "config":
        spec_text = mutate(draw, spec_text)
    if target != "spec":
        config_text = mutate(draw, config_text)
    return spec_text, config_text


def test_every_spec_has_a_config_pair():
    assert {model for model, _ in PAIRS} == set(SPECS)


@given(mutated())
def test_mutations_never_raise(case):
    spec_text, config_text = case
    diags = Diagnostics()
    spec = parse(spec_text, "s.mw", diags)
    deployment = parse_deployment(config_text, "c.yaml", diags)
    if spec is None:
        return
    # Every pass runs even after earlier errors (the driver would stop): none may raise.
    resolve.run(spec, diags)
    check_args.run(spec, diags)
    check_graph.run(spec, diags)
    if deployment is not None:
        check_deployment.run(spec, deployment, diags)
    check_combine.run(spec, deployment, diags)
    check_roles.run(spec, diags)
    diags.render()


def test_a_loop_naming_an_unknown_param_gets_its_diagnostic_from_every_pass():
    """Found by the mutations above: cosmos3 with its loop count's param renamed made the capture
    replay check lower the walks and raise a KeyError."""
    spec_text = SPECS["cosmos3"].replace("param num_image_steps = 50", "param num_image_stepz = 50")
    diags = Diagnostics()
    spec = parse(spec_text, "s.mw", diags)
    deployment = parse_deployment(CONFIGS["cosmos3"], "c.yaml", diags)
    assert spec is not None and deployment is not None
    resolve.run(spec, diags)
    check_args.run(spec, diags)
    check_graph.run(spec, diags)
    check_deployment.run(spec, deployment, diags)
    check_combine.run(spec, deployment, diags)
    check_roles.run(spec, diags)
    assert "MW104" in diags.render()
