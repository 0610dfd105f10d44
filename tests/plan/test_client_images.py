"""`image_outputs`: the call outputs the client takes as images, read alike by the endpoints (which
nodes' sizes an image request is checked against) and by the simulated engine (which outputs get
an image placeholder), for a decoder after a loop and for one inside it, whose image leaves through
the loop's exit."""
from pathlib import Path

from mstar.compiler.driver import compile_spec
from mstar.lang.diagnostics import Diagnostics
from mstar.plan.client_images import image_outputs
from mstar.plan.io import load_plan
from mstar.runtime.engine.sim import SimEngine
from mstar.runtime.serve.endpoints import endpoints_of

ROOT = Path(__file__).resolve().parents[2]
DECODER_IN_LOOP = """walk image_gen {
    loop max=num_flow_steps {
        LLM(latents, time_index)
            -> latents: LLM
            -> time_index: LLM
            -> latents: vae_decoder
        vae_decoder(latents) -> image_output: client image
    } outputs image_output
}

"""


def _walk(plan, name):
    return next(w for w in plan.walks if w.name == name)


def test_a_decoder_after_the_loop():
    plan = load_plan(str(ROOT / "generated" / "bagel.plan"))
    assert image_outputs(_walk(plan, "image_gen")) == [("vae_decoder", "image_output")]
    assert image_outputs(_walk(plan, "decode")) == []


def test_a_decoder_inside_the_loop_sends_its_image_through_the_exit(tmp_path):
    text = (ROOT / "specs" / "bagel.mw").read_text()
    start, end = text.index("walk image_gen {"), text.index("partition LLM")
    (tmp_path / "bagel.mw").write_text(text[:start] + DECODER_IN_LOOP + text[end:])
    diags = Diagnostics()
    result = compile_spec(tmp_path / "bagel.mw", ROOT / "configs" / "bagel.yaml", diags, tmp_path / "bagel.plan")
    assert result is not None, diags.render()
    walk = _walk(result.plan, "image_gen")
    decoder = next(c for c in walk.calls if c.node == "vae_decoder")
    assert [e.action for e in decoder.edges] == ["loop_output"]
    assert image_outputs(walk) == [("vae_decoder", "image_output")]
    assert endpoints_of(result.plan).image_nodes == {"vae_decoder"}
    assert "vae_decoder" in SimEngine(result.plan).caps.image_sizes
