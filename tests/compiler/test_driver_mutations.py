"""Whole-pipeline robustness: mutated specs and configs give a plan or diagnostics, never an
exception (the passes check; lowering and the glue must cope with whatever the checks accept),
and an edited node argument that compiles gives dims the runtime's models accept."""
import shutil
from pathlib import Path

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mstar.compiler.driver import compile_spec
from mstar.lang.diagnostics import Diagnostics

ROOT = Path(__file__).resolve().parents[2]
PAIRS = [("orpheus", "orpheus_pd_disaggregated"), ("qwen3_omni", "qwen3omni_thinker_tp2"),
         ("bagel", "bagel"), ("qwen3_5", "qwen3_5")]


@st.composite
def mutations(draw):
    spec, config = draw(st.sampled_from(PAIRS))
    target = draw(st.sampled_from(["spec", "config"]))
    folder, file = ("specs", f"{spec}.mw") if target == "spec" else ("configs", f"{config}.yaml")
    path = ROOT / folder / file
    lines = path.read_text().splitlines()
    for _ in range(draw(st.integers(1, 3))):
        if not lines:
            break
        i = draw(st.integers(0, len(lines) - 1))
        j = draw(st.integers(0, len(lines) - 1))
        op = draw(st.sampled_from(["delete", "duplicate", "swap"]))
        if op == "delete":
            del lines[i]
        elif op == "duplicate":
            lines.insert(j, lines[i])
        else:
            lines[i], lines[j] = lines[j], lines[i]
    return spec, config, target, "\n".join(lines) + "\n"


@settings(max_examples=40, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(case=mutations())
def test_mutated_inputs_never_raise(case, tmp_path_factory):
    spec, config, target, text = case
    repo = tmp_path_factory.mktemp("repo")
    (repo / "specs").mkdir()
    (repo / "configs").mkdir()
    shutil.copy(ROOT / "specs" / f"{spec}.mw", repo / "specs")
    shutil.copy(ROOT / "configs" / f"{config}.yaml", repo / "configs")
    path = repo / "specs" / f"{spec}.mw" if target == "spec" else repo / "configs" / f"{config}.yaml"
    path.write_text(text)
    diags = Diagnostics()
    result = compile_spec(repo / "specs" / f"{spec}.mw", repo / "configs" / f"{config}.yaml", diags)
    assert (result is None) == diags.has_errors
    diags.render()  # rendering never raises either


ARG_VALUES = st.one_of(st.integers(-3, 300000), st.floats(-2, 2, allow_nan=False),
                       st.sampled_from(["abc", "llama", "qwen3_5", "enc_dec", "audio_codec", "decoder",
                                        '"linear,full"', '"x"']),
                       st.lists(st.integers(-1, 3), max_size=5).map(lambda v: "[" + ", ".join(map(str, v)) + "]"))


@st.composite
def argument_edits(draw):
    """A spec with one node or state argument's value replaced (or a new argument added): the kind
    of edit a user makes, which line mutations rarely reach (`layers=abc` once crashed lowering)."""
    spec, config = draw(st.sampled_from(PAIRS))
    text = (ROOT / "specs" / f"{spec}.mw").read_text()
    import re
    args = list(re.finditer(r"(\b[a-z_]+)=([^,)\s]+|\[[^\]]*\])", text))
    value = draw(ARG_VALUES)
    value = value if isinstance(value, str) else repr(value)
    if draw(st.booleans()) and args:
        m = draw(st.sampled_from(args))
        text = text[:m.start(2)] + value + text[m.end(2):]
    else:
        from mstar.plan.node_args import KV_ARGS, RECURRENT_ARGS, STATELESS_ARGS
        name = draw(st.sampled_from(sorted(set(KV_ARGS) | set(STATELESS_ARGS) | set(RECURRENT_ARGS))))
        opener = draw(st.sampled_from([m.start() for m in re.finditer(r"\b(kv|stateless|recurrent)\(", text)]))
        paren = text.index("(", opener) + 1
        text = text[:paren] + f"{name}={value}, " + text[paren:]
    return spec, config, text


@settings(max_examples=60, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(case=argument_edits())
def test_edited_arguments_never_raise(case, tmp_path_factory):
    spec, config, text = case
    repo = tmp_path_factory.mktemp("repo")
    (repo / "specs").mkdir()
    (repo / "configs").mkdir()
    (repo / "specs" / f"{spec}.mw").write_text(text)
    shutil.copy(ROOT / "configs" / f"{config}.yaml", repo / "configs")
    diags = Diagnostics()
    result = compile_spec(repo / "specs" / f"{spec}.mw", repo / "configs" / f"{config}.yaml", diags)
    assert (result is None) == diags.has_errors
    diags.render()
    if result is not None:
        # what the compiler accepts, the runtime can build: no DimsError at start
        build_every_model_dims(result.plan)


def build_every_model_dims(plan) -> None:
    from mstar.plan.dims import codec_dims, decoder_dims, encoder_dims, image_decoder_dims
    for node in plan.nodes:
        kind = node.model_kind
        for mode in ("spec", "tiny"):
            if kind == "decoder":
                decoder_dims(node, mode)
            elif kind == "audio_codec":
                codec_dims(node, mode)
            elif kind in ("vision_encoder", "audio_encoder"):
                encoder_dims(node, mode, is_audio=kind == "audio_encoder")
            else:
                image_decoder_dims(node, mode, None)
