"""Depth models (`submodel NAME(ARGS) samples OUTPUT depth=N for WALK ...`, Qwen3-TTS's code
predictor): the walk's rows run the node's model, which samples the output's first token, then the
depth model, which samples N more from its own vocabulary over its own small KV; the frame of 1 + N
tokens is the output's value (what the codec reads)."""
import pytest
import torch
from spec_text import plan_of

from mstar.lang.diagnostics import Diagnostics
from mstar.lang.fmt import format_spec
from mstar.lang.parser import parse
from mstar.runtime.conductor.request import Request
from mstar.runtime.engine.models.depth import DepthModel
from mstar.runtime.engine.sim import SimEngine
from mstar.runtime.engine.torch_engine import TorchEngine
from mstar.runtime.serve.driver import Driver, Workload

SPEC = """model tts
param max_new_tokens = 6
node Talker kv(layers=2, kv_heads=1, qo_heads=2, head_dim=8, hidden=16, vocab=1000) {
    in text_inputs: tokens prompt text
    in talker_input_embeds: embeddings
    out talker_input_embeds: embeddings
    out codec_tokens: tokens
    SUBMODEL
}
node Codec stateless audio_codec(codebook=1000, quantizers=4, samples_per_token=4, sample_rate=24000) {
    in codec_tokens stream: tokens
    out audio_chunk: audio
}
walk prefill {
    Talker(text_inputs)
        -> talker_input_embeds: conductor persist
        -> codec_tokens: Codec stream
}
walk decode {
    loop talk max=max_new_tokens stop {
        Talker(talker_input_embeds)
            -> talker_input_embeds: Talker
            -> codec_tokens: Codec stream
    }
}
walk codec_chunk {
    Codec(codec_tokens) -> audio_chunk: client audio
}
partition T = prefill -> decode
partition C = codec_chunk <- T.codec_tokens left_context(chunk=4, context=1)
"""
CONFIG = "model: tts\nmax_seq_len: 64\nnode_groups:\n  - node_names: [Talker, Codec]\n    ranks: [0]\n"
PREDICTOR = ("submodel code_predictor(layers=1, kv_heads=1, qo_heads=2, head_dim=4, hidden=8, intermediate=16, "
             "vocab=5) samples codec_tokens depth=3 for prefill decode")


def frames(tmp_path, submodel: str, requests: list[Request]) -> tuple[object, dict[str, list[list[int]]]]:
    """The plan, and per request the codec_tokens values the Talker produced (spec dims)."""
    plan = plan_of(tmp_path, SPEC.replace("SUBMODEL", submodel), CONFIG)
    engine = TorchEngine(plan, dims="spec", seed=1)
    found: dict[str, list[list[int]]] = {}
    wait = engine.wait

    def recording(handle):
        result = wait(handle)
        for row in result.rows:
            if "codec_tokens" in row.outputs:
                found.setdefault(row.request_id, []).append([int(c) for c in row.outputs["codec_tokens"]])
        return result

    engine.wait = recording  # type: ignore[method-assign]
    driver = Driver(plan, engine)
    driver.run(Workload(requests))
    for record in driver.conductor.records.values():
        assert record.finish_reason in ("stop", "length", "done"), record.finish_reason
        assert any(e.modality == "audio" for e in record.emissions)
    return plan, found


def one(temperature=None) -> list[Request]:
    return [Request(id="a", prompt_tokens=[1, 2, 3], max_tokens=5, temperature=temperature, seed=4)]


def test_the_plan_lists_the_depth_model(tmp_path):
    plan, _ = frames(tmp_path, PREDICTOR, one())
    sub = plan.nodes[0].submodels[0]
    assert (sub.name, sub.samples, sub.depth, sub.walks) == ("code_predictor", "codec_tokens", 3, ["decode", "prefill"])
    assert sub.dims == {"layers": 1, "kv_heads": 1, "qo_heads": 2, "head_dim": 4, "hidden": 8, "intermediate": 16,
                        "vocab": 5}


def test_the_node_samples_the_first_token_and_the_depth_model_the_rest(tmp_path):
    _, with_predictor = frames(tmp_path / "a", PREDICTOR, one())
    _, without = frames(tmp_path / "b", "", one())  # the stand-in code head of the engine (docs/engine.md)
    assert len(with_predictor["a"]) == 5 and all(len(frame) == 4 for frame in with_predictor["a"])
    # codebook 0: the Talker's own token either way
    assert [f[0] for f in with_predictor["a"]] == [f[0] for f in without["a"]]
    # codebooks 1..3: from the predictor's own 5-token vocabulary, not the codec's 1000 codes
    assert all(0 <= code < 5 for frame in with_predictor["a"] for code in frame[1:])
    assert [f[1:] for f in with_predictor["a"]] != [f[1:] for f in without["a"]]


def test_a_frame_is_the_depth_model_run_on_the_nodes_hidden_state(tmp_path):
    plan = plan_of(tmp_path, SPEC.replace("SUBMODEL", PREDICTOR), CONFIG)
    engine = TorchEngine(plan, dims="spec", seed=1)
    runner = engine.runners["Talker"]
    depth = runner.depth_by_walk["prefill"]["codec_tokens"]
    assert isinstance(depth, DepthModel) and runner.depth_by_walk["decode"]["codec_tokens"] is depth
    assert (depth.dims.depth, depth.dims.vocab, depth.dims.hidden, depth.dims.outer_hidden) == (3, 5, 8, 16)
    hidden, first = torch.randn(16, generator=torch.Generator().manual_seed(0)), runner.model.embed_tokens(
        torch.tensor([7]))[0]
    greedy = depth.generate(hidden, first, lambda k, logits: int(logits.argmax()))
    # by hand: inner position k reads lm_head[k] and feeds its token through codec_embedding[k]
    inputs, expected = [hidden, first], []
    for k in range(3):
        out = depth.hidden_states(torch.stack(inputs))
        expected.append(int(depth.lm_head[k](out[-1]).argmax()))
        inputs.append(depth.model.codec_embedding[k](torch.tensor(expected[-1])))
    assert greedy == expected


def test_sampled_frames_do_not_depend_on_the_other_rows(tmp_path):
    _, alone = frames(tmp_path / "a", PREDICTOR, one(temperature=1.0))
    _, together = frames(tmp_path / "b", PREDICTOR, one(temperature=1.0) + [
        Request(id="b", prompt_tokens=[9, 8], max_tokens=4, temperature=0.7, seed=9)])
    assert alone["a"] == together["a"]
    assert len({tuple(f[1:]) for f in alone["a"]}) > 1  # sampled, not one constant frame


def test_tiny_dims_shrink_the_depth_with_the_codec(tmp_path):
    spec = SPEC.replace("SUBMODEL", PREDICTOR.replace("depth=3", "depth=7")).replace("quantizers=4", "quantizers=8")
    plan = plan_of(tmp_path, spec, CONFIG)
    depth = TorchEngine(plan).runners["Talker"].depth_by_walk["decode"]["codec_tokens"]
    assert depth.dims.depth == 3  # the tiny codec reads 4 quantizers (dims.TINY_QUANTIZERS)


def test_depth_model_round_trips_through_the_formatter():
    text = f"model m\n\nnode N kv(layers=1) {{\n    {PREDICTOR}\n}}\n"
    spec = parse(text, "m.mw", Diagnostics())
    assert spec is not None and format_spec(spec) == text
    assert spec.nodes[0].submodels[0].samples == "codec_tokens" and spec.nodes[0].submodels[0].depth == 3


def check(tmp_path, submodel: str, spec: str = SPEC) -> str:
    from mstar.compiler.driver import compile_spec

    (tmp_path / "tts.mw").write_text(spec.replace("SUBMODEL", submodel))
    (tmp_path / "tts.yaml").write_text(CONFIG)
    diags = Diagnostics()
    compile_spec(tmp_path / "tts.mw", tmp_path / "tts.yaml", diags)
    return diags.render()


def test_a_frame_that_the_codec_cannot_read_is_mw125(tmp_path):
    text = check(tmp_path, PREDICTOR.replace("depth=3", "depth=2"))
    assert "error[MW125]: depth model code_predictor makes frames of 3 codes (codec_tokens and depth=2 more) " \
           "but codec Codec reads 4 quantizers" in text


def test_a_depth_model_extends_only_a_tokens_output(tmp_path):
    text = check(tmp_path, PREDICTOR.replace("samples codec_tokens", "samples talker_input_embeds"))
    assert "error[MW125]: depth model code_predictor samples talker_input_embeds, an output of role embeddings" in text
    assert "did you mean 'codec_tokens'" in check(tmp_path, PREDICTOR.replace("samples codec_tokens",
                                                                              "samples codec_token"))


def test_geometry_belongs_to_depth_models_only(tmp_path):
    text = check(tmp_path, "submodel wide(layers=1, hidden=8) for decode")
    assert "error[MW109]: 'layers' is not an argument of sub-model wide" in text
    assert "error" not in check(tmp_path, PREDICTOR)


def counted_run(tmp_path, engine_name: str, max_tokens: int):
    """A run of the depth spec whose frames count as the request's output tokens (`count_tokens`
    on the codec edges), on the torch engine or the sim; its one record."""
    spec = SPEC.replace("SUBMODEL", PREDICTOR).replace("param max_new_tokens = 6", "param max_new_tokens = 40")
    spec = spec.replace("-> codec_tokens: Codec stream", "-> codec_tokens: Codec stream count_tokens")
    plan = plan_of(tmp_path, spec, CONFIG)
    engine = TorchEngine(plan, dims="spec", seed=1) if engine_name == "torch" else SimEngine(plan)
    driver = Driver(plan, engine)
    driver.run(Workload([Request(id="a", prompt_tokens=[1, 2, 3], max_tokens=max_tokens, seed=4)]))
    (record,) = driver.conductor.records.values()
    return record


@pytest.mark.parametrize("engine_name", ["torch", "sim"])
def test_counted_frames_count_their_codes_and_max_tokens_cuts_them(tmp_path, engine_name):
    """A frame counts 1 + depth tokens (plan/output_bound.py counts it so); max_tokens ends the
    partition at the frame that reaches it, `length`, and the output lists the frames, 4 codes each
    on either engine (the sim's frames were one placeholder token)."""
    record = counted_run(tmp_path, engine_name, max_tokens=10)
    assert record.finish_reason == "length"
    assert [len(frame) for frame in record.output_tokens] == [4, 4, 4]  # 12 >= 10 at the third frame
    assert record.num_output_tokens == 12
    assert any(e.modality == "audio" for e in record.emissions)
