"""Nodes with several sub-models (`submodel NAME(ARGS) for WALK ...`, Pi0.5's action expert): the
walk's rows on the node run a second model of other widths that shares the node's KV cache."""
from pathlib import Path

from spec_text import plan_of, run

from mstar.compiler import check_combine, resolve
from mstar.lang.diagnostics import Diagnostics
from mstar.lang.fmt import format_spec
from mstar.lang.parser import parse
from mstar.runtime.conductor.request import Request
from mstar.plan.dims import decoder_dims
from mstar.runtime.engine.submodels import submodel_dims
from mstar.runtime.engine.torch_engine import TorchEngine
from mstar.runtime.serve.driver import Driver, Workload

SPEC = """model pi
param num_flow_steps = 3
node LLM kv(layers=2, kv_heads=1, qo_heads=2, head_dim=8, hidden=16, vocab=64, latent_channels=4,
            latent_tokens=4) {
    in text_inputs: tokens prompt text
    in noisy_actions: flow_latents
    in timestep_index: flow_time
    out new_token: tokens
    out noisy_actions: flow_latents
    out timestep_index: flow_time
    SUBMODEL
}
node head stateless image_decoder {
    in noisy_actions: flow_latents
    out actions: image
}
walk prefill {
    LLM(text_inputs) -> new_token: client text persist
}
walk action_gen {
    loop max=num_flow_steps {
        LLM(noisy_actions, timestep_index)
            -> noisy_actions: LLM
            -> timestep_index: LLM
            -> noisy_actions: head
    } outputs noisy_actions
    head(noisy_actions) -> actions: client image
}
partition P = prefill -> action_gen
"""
CONFIG = "model: pi\nmax_seq_len: 64\nnode_groups:\n  - node_names: [LLM, head]\n    ranks: [0]\n"
WHISPER = (Path(__file__).resolve().parents[2] / "specs" / "whisper.mw").read_text()
EXPERT = "submodel action_expert(hidden=24, intermediate=48) for action_gen"


def outputs(tmp_path, submodel: str):
    plan = plan_of(tmp_path, SPEC.replace("SUBMODEL", submodel), CONFIG)
    driver = Driver(plan, TorchEngine(plan))
    driver.run(Workload([Request(id="r", prompt_tokens=[1, 2, 3], max_tokens=4, seed=1)]))
    record = driver.conductor.records["r"]
    assert record.finish_reason in ("done", "stop", "length"), record.finish_reason
    return plan, {e.modality: e.value for e in record.emissions}


def test_the_plan_lists_the_submodel(tmp_path):
    plan, _ = outputs(tmp_path, EXPERT)
    sub = plan.nodes[0].submodels[0]
    assert (sub.name, sub.dims, sub.walks) == ("action_expert", {"hidden": 24, "intermediate": 48}, ["action_gen"])


def test_the_walk_runs_on_the_submodel_and_the_others_on_the_node(tmp_path):
    _, with_expert = outputs(tmp_path / "a", EXPERT)
    _, without = outputs(tmp_path / "b", "")
    assert with_expert["text"] == without["text"]  # prefill: the node's own model either way
    assert not (with_expert["image"] == without["image"]).all()  # action_gen: the expert's weights


def test_submodel_round_trips_through_the_formatter():
    text = f"model m\n\nnode N kv(layers=1) {{\n    {EXPERT}\n}}\n"
    spec = parse(text, "m.mw", Diagnostics())
    assert spec is not None and format_spec(spec) == text


DECODE_SPEC = """model pi
param max_output_tokens = 4
node LLM kv(layers=2, kv_heads=1, qo_heads=2, head_dim=8, hidden=16, vocab=64) {
    in text_inputs: tokens prompt text
    out new_token: tokens
    out text_inputs: tokens
    SUBMODEL
}
walk prefill {
    LLM(text_inputs) -> new_token: client text persist
}
walk decode {
    loop decode_loop max=max_output_tokens stop {
        LLM(text_inputs)
            -> text_inputs: LLM
            -> new_token: client text
    }
}
partition P = prefill -> decode
"""
DECODE_CONFIG = "model: pi\nmax_seq_len: 64\nnode_groups:\n  - node_names: [LLM]\n    ranks: [0]\n"
CHUNKED = DECODE_CONFIG + "prefix_cache: true\n"


def decoded(tmp_path, submodel: str, config: str = DECODE_CONFIG) -> tuple[object, list[int]]:
    plan = plan_of(tmp_path, DECODE_SPEC.replace("SUBMODEL", submodel), config)
    records = run(plan, [Request(id="r", prompt_tokens=[1, 2, 3], max_tokens=5, seed=1)])
    tokens = [t for e in records["r"].emissions if e.modality == "text" for t in e.value]
    return plan, tokens


def test_tiny_dims_keep_the_submodel_widths_ratio_to_the_node(tmp_path):
    plan = plan_of(tmp_path, SPEC.replace("SUBMODEL", "submodel expert(hidden=8, intermediate=256) for action_gen"),
                   CONFIG)
    node = plan.nodes[0]
    main, expert = decoder_dims(node, "tiny"), submodel_dims(node, node.submodels[0], "tiny")
    assert (main.hidden, main.intermediate) == (64, 128)  # dims.py's tiny widths
    # hidden 8 of 16 -> 32 of 64; intermediate: the node's default, 4 x hidden = 64 -> 256 of 64 -> 512 of 128
    assert (expert.hidden, expert.intermediate) == (32, 512)
    assert (expert.num_layers, expert.num_kv_heads, expert.head_dim) == (main.num_layers, main.num_kv_heads,
                                                                        main.head_dim)


def test_a_wider_submodel_embeds_the_tokens_its_walk_feeds(tmp_path):
    # decode's rows feed tokens through the sub-model's own embedding, of its own width
    _, wide = decoded(tmp_path / "a", "submodel wide(hidden=24, qo_heads=4, vocab=32) for decode")
    _, plain = decoded(tmp_path / "b", "")
    assert len(wide) == len(plain) == 5
    assert wide[0] == plain[0]  # prefill: the node's own model
    assert wide[1:] != plain[1:] and all(t < 32 for t in wide[1:])  # decode: the sub-model's vocabulary


def test_a_submodel_walk_never_starts_after_a_cached_prefix(tmp_path):
    plan, _ = decoded(tmp_path, "submodel wide(hidden=24) for prefill", CHUNKED)
    pool = plan.deployment.kv_pools[0]
    assert pool.prefix_cache == "pages" and pool.prefix_walks == []


def check_errors(text: str) -> str:
    diags = Diagnostics()
    spec = parse(text, "w.mw", diags)
    assert spec is not None, diags.render()
    check_combine.run(spec, None, diags)
    return diags.render()


def test_a_whisper_decoder_takes_no_submodel():
    line = "    submodel small(hidden=640) for decode\n"
    text = WHISPER.replace("    kv_sequences main\n", "    kv_sequences main\n" + line)
    assert "error[MW124]: sub-model small on node decoder: a whisper decoder runs one model" in check_errors(text)


def test_a_submodel_for_an_unknown_walk_is_mw103():
    text = DECODE_SPEC.replace("SUBMODEL", "submodel decde(hidden=24) for decde")
    diags = Diagnostics()
    spec = parse(text, "w.mw", diags)
    assert spec is not None
    resolve.run(spec, diags)
    assert diags.render() == (
        "w.mw:7:35: error[MW103]: unknown walk 'decde'; did you mean 'decode'?\n"
        "    7 |     submodel decde(hidden=24) for decde\n"
        "      |                                   ^^^^^\n")
