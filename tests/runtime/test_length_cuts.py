"""A request whose output a limit cut ends "length", also where the cut partition counts no
tokens: the engines say a stop was a limit (`RowResult.is_length`, `step.row_stop`: the node
sampled the request's max_tokens), and the conductor marks the run cut. Before, Qwen3-TTS's and
Qwen3-Omni's Talkers stopped at max_tokens frames and their requests reported `stop`."""
from __future__ import annotations

from pathlib import Path

import pytest

from mstar.plan.io import load_plan
from mstar.runtime.conductor.request import Request
from mstar.runtime.engine.sim import SimEngine
from mstar.runtime.engine.torch_engine import TorchEngine
from mstar.runtime.serve.driver import Driver, Workload
from mstar.runtime.step import row_stop

GENERATED = Path(__file__).resolve().parents[2] / "generated"


def test_a_stop_token_is_the_models_stop_and_max_tokens_a_cut():
    assert row_stop(7, [7], (), 5, 5) == (True, False)  # a stop token at the last allowed sample
    assert row_stop(7, [], {7}, 1, None) == (True, False)  # the node's own stop token
    assert row_stop(3, [7], (), 5, 5) == (True, True)
    assert row_stop(3, [7], (), 4, 5) == (False, False)
    assert row_stop(3, [], (), 10**6, None) == (False, False)


def run(plan_name: str, engine_name: str, requests: list[Request]):
    plan = load_plan(GENERATED / f"{plan_name}.plan")
    engine = SimEngine(plan) if engine_name == "sim" else TorchEngine(plan, seed=0)
    driver = Driver(plan, engine)
    driver.run(Workload(requests))
    return driver.conductor.records


@pytest.mark.parametrize("engine_name", ["sim", "torch"])
def test_speech_cut_at_max_tokens_frames_ends_length(engine_name):
    """Qwen3-TTS counts no output tokens; its Talker samples at most max_tokens frames."""
    records = run("qwen3_tts", engine_name, [Request(id="a", prompt_tokens=[5, 6, 7, 8], max_tokens=6)])
    assert records["a"].finish_reason == "length"
    assert records["a"].num_output_tokens == 0 and any(e.modality == "audio" for e in records["a"].emissions)


@pytest.mark.parametrize("engine_name", ["sim", "torch"])
@pytest.mark.parametrize("plan_name,sampling_walks", [("qwen3_tts", ("talker_prefill", "talker_decode")),
                                                      ("qwen3_omni", ("talker_last_prefill", "talker_decode"))])
def test_a_talker_samples_max_tokens_frames_also_when_its_prefill_makes_the_last(plan_name, sampling_walks,
                                                                                 engine_name):
    """The Talker's prefill samples a frame outside any loop and counts nothing toward max_tokens
    (its frames go to the codec's stream): at max_tokens 1 its limit there ends the partition
    (PartitionState.stop_before_later_loops). Before, the decode loop ran once more: two frames."""
    for max_tokens in (1, 2, 3):
        plan = load_plan(GENERATED / f"{plan_name}.plan")
        engine = SimEngine(plan) if engine_name == "sim" else TorchEngine(plan, seed=0)
        driver = Driver(plan, engine)
        driver.run(Workload([Request(id="a", prompt_tokens=[5, 6, 7, 8], max_tokens=max_tokens)]))
        frames = sum(rows.get(walk, 0) for rows in driver.log.walk_rows for walk in sampling_walks)
        assert frames == max_tokens
        assert driver.conductor.records["a"].finish_reason == "length"


def test_a_thinker_that_stops_with_a_talker_cut_ends_length_and_one_that_ends_stop():
    """Qwen3-Omni on the torch engine: the Thinker's third token made a stop token, so its text ends
    `stop`; the Talker's frames are cut at max_tokens, so the request ends `length`. Without
    the Talker (a text-only route) the same request ends `stop`."""
    plan = load_plan(GENERATED / "qwen3_omni.plan")
    alone = run("qwen3_omni", "torch", [Request(id="a", prompt_tokens=[5, 6, 7, 8], max_tokens=20)])["a"]
    stop = int(alone.output_tokens[2])
    both = [Request(id="speech", prompt_tokens=[5, 6, 7, 8], max_tokens=20, stop_tokens=[stop]),
            Request(id="text", prompt_tokens=[5, 6, 7, 8], max_tokens=20, stop_tokens=[stop],
                    route={p.name: [] for p in plan.partitions[1:]})]
    records = run("qwen3_omni", "torch", both)
    assert [int(t) for t in records["speech"].output_tokens] == [int(t) for t in alone.output_tokens[:3]]
    assert records["speech"].finish_reason == "length"
    assert records["text"].finish_reason == "stop" and len(records["text"].output_tokens) == 3


def test_the_sim_counts_only_rows_that_sample_toward_max_tokens():
    """BAGEL's prefill_vae call extends the KV and samples nothing (the torch engine samples only a
    call with a tokens output): the sim gave it a sample, so a request of max_tokens 4 through it
    got 3 tokens (and now would read `length` with 3)."""
    route = {"LLM": ["prefill_vae", "prefill_vit", "prefill_text", "decode"]}
    records = run("bagel", "sim", [Request(id="a", prompt_tokens=[1, 2], max_tokens=4, route=route)])
    assert records["a"].finish_reason == "length" and records["a"].num_output_tokens == 4


@pytest.mark.parametrize("engine_name", ["sim", "torch"])
def test_max_tokens_reached_where_nothing_after_counts_goes_on(engine_name):
    """BAGEL's image route counts the prefill's one token and image_gen counts none: at max_tokens 1
    the partition goes on to the image and ends `stop` (before, it ended `length` with no image).
    With an image prompt two prefills count, so max_tokens 1 still cuts before the image; a decode
    route ends at max_tokens as before."""
    def one(max_tokens: int, walks: list[str]):
        request = Request(id="a", prompt_tokens=[1, 2], max_tokens=max_tokens, route={"LLM": walks})
        record = run("bagel", engine_name, [request])["a"]
        return record.finish_reason, record.num_output_tokens, [e.modality for e in record.emissions]

    assert one(1, ["prefill_text", "image_gen"]) == ("stop", 1, ["text", "image"])
    assert one(1, ["prefill_vit", "prefill_text", "image_gen"]) == ("length", 1, ["text"])
    assert one(2, ["prefill_vit", "prefill_text", "image_gen"]) == ("stop", 2, ["text", "text", "image"])
    assert one(1, ["prefill_text", "decode"]) == ("length", 1, ["text"])


# A decode loop whose stop is followed by a stage that counts too: a stop token as the request's
# max_tokens-th leaves the `after` walk's token uncounted, so the request was cut.
THEN_COUNTS = """model stop_then
node LLM kv(layers=1, kv_heads=2, qo_heads=2, head_dim=8, hidden=16, vocab=64) {
    in text_inputs: tokens prompt text
    out text_inputs: tokens
    out new_token: tokens
}
walk prefill {
    LLM(text_inputs) -> new_token: client text persist
}
walk decode {
    loop decode_loop max=50 stop {
        LLM(text_inputs)
            -> new_token: client text
            -> text_inputs: LLM device
    }
}
walk after {
    LLM(text_inputs) -> new_token: client text
}
partition P = prefill -> decode -> after
"""
THEN_CONFIG = "model: stop_then\nmax_seq_len: 128\nnode_groups:\n  - node_names: [LLM]\n    ranks: [0]\n"


def stop_at(plan, extra: int):
    """The torch engine's run of one request whose stop token is the first decode token its
    unstopped run made that no token before it equals, with max_tokens `extra` past that token's
    count: (finish reason, number of output tokens, the stop token's count)."""
    def one(request: Request):
        driver = Driver(plan, TorchEngine(plan, seed=0))
        driver.run(Workload([request]))
        return driver.conductor.records[request.id]
    free = [int(t) for t in one(Request(id="a", prompt_tokens=[5, 6, 7, 8], max_tokens=8)).output_tokens]
    position = next(p for p in range(1, len(free)) if free[p] not in free[:p])
    record = one(Request(id="b", prompt_tokens=[5, 6, 7, 8], max_tokens=position + 1 + extra,
                         stop_tokens=[free[position]]))
    return record.finish_reason, len(record.output_tokens), position + 1


def test_a_stop_token_as_the_last_allowed_token_ends_stop():
    """llama: the model's stop token as the request's max_tokens-th token ends `stop` (as a stop
    before it does, and as the engines' row_stop says), not `length`; a limit one short cuts it."""
    plan = load_plan(GENERATED / "llama.plan")
    reason, num, at = stop_at(plan, 0)
    assert (reason, num) == ("stop", at)
    reason, num, at = stop_at(plan, 3)
    assert (reason, num) == ("stop", at)
    reason, num, at = stop_at(plan, -1)
    assert (reason, num) == ("length", at - 1)


def test_a_stop_token_as_the_last_allowed_token_with_more_to_count_after_is_a_cut(tmp_path):
    """The stop ends the decode loop, but the `after` walk would count another token: `length`.
    Without the stop at the limit (max_tokens one more) the `after` token comes and it ends `stop`."""
    from spec_text import plan_of
    plan = plan_of(tmp_path, THEN_COUNTS, THEN_CONFIG)
    reason, num, at = stop_at(plan, 0)
    assert (reason, num) == ("length", at)
    reason, num, at = stop_at(plan, 1)
    assert (reason, num) == ("stop", at + 1)


# A stop ends its loop after the iteration it came in, so a counted call after the stopping one in
# that iteration still runs (TWO_COUNTS: B after A), and an inner loop around the counting call goes
# on to its limit (NESTED: the stop is the outer loop's). Neither stop ends the run's counting.
TWO_COUNTS = """model two_counts
node A kv(layers=1, kv_heads=2, qo_heads=2, head_dim=8, hidden=16, vocab=64) {
    in text_inputs: tokens prompt text
    out text_inputs: tokens
    out new_token: tokens
    out b_in: tokens
}
node B kv(layers=1, kv_heads=2, qo_heads=2, head_dim=8, hidden=16, vocab=64) {
    in b_in: tokens
    out b_tok: tokens
}
walk prefill {
    A(text_inputs) -> new_token: client text persist
}
walk decode {
    loop decode_loop max=50 stop {
        A(text_inputs)
            -> new_token: client text
            -> text_inputs: A device
            -> b_in: B
        B(b_in) -> b_tok: client text
    }
}
partition P = prefill -> decode
"""
NESTED = """model nested_stop
node A kv(layers=1, kv_heads=2, qo_heads=2, head_dim=8, hidden=16, vocab=64) {
    in text_inputs: tokens prompt text
    out text_inputs: tokens
    out new_token: tokens
}
walk prefill {
    A(text_inputs) -> new_token: client text persist
}
walk decode {
    loop outer max=20 stop {
        loop inner max=3 {
            A(text_inputs)
                -> new_token: client text
                -> text_inputs: A device
        }
    }
}
partition P = prefill -> decode
"""


@pytest.mark.parametrize("spec", [TWO_COUNTS, NESTED], ids=["two_counting_calls", "inner_loop"])
def test_a_stop_token_as_the_last_allowed_token_where_its_loop_counts_more_is_a_cut(tmp_path, spec):
    """The stop token as the max_tokens-th token (A's first decode token, the 2nd counted) leaves
    more to count in its iteration (B's token) or its inner loop (A's next): max_tokens still ends
    the request there, `length` with max_tokens tokens (it went on past max_tokens, ending `length`
    with one more)."""
    from spec_text import plan_of
    model = spec.split()[1]
    nodes = "A, B" if "node B" in spec else "A"
    config = f"model: {model}\nmax_seq_len: 128\nnode_groups:\n  - node_names: [{nodes}]\n    ranks: [0]\n"
    plan = plan_of(tmp_path, spec, config)
    reason, num, at = stop_at(plan, 0)
    assert at == 2 and (reason, num) == ("length", at)


def test_a_stop_token_as_the_prefills_first_token_ends_the_request():
    """The prefill samples outside loops, so its stop token had no loop to end and the decode ran on
    to max_tokens (`length`, 6 tokens). Now the partition ends `stop` with that one token; BAGEL's
    image route goes on to its image, which counts nothing."""
    def first_is_stop(plan_name: str, max_tokens: int, route=None):
        route = route or {}
        request = Request(id="a", prompt_tokens=[5, 6, 7, 8], max_tokens=6, route=route)
        first = int(run(plan_name, "torch", [request])["a"].output_tokens[0])
        request = Request(id="b", prompt_tokens=[5, 6, 7, 8], max_tokens=max_tokens, route=route, stop_tokens=[first])
        record = run(plan_name, "torch", [request])["b"]
        return record.finish_reason, record.num_output_tokens, sorted({e.modality for e in record.emissions})

    assert first_is_stop("llama", 6) == ("stop", 1, ["text"])
    assert first_is_stop("llama", 1) == ("stop", 1, ["text"])
    assert first_is_stop("bagel", 6, {"LLM": ["prefill_text", "decode"]}) == ("stop", 1, ["text"])
    assert first_is_stop("bagel", 6, {"LLM": ["prefill_text", "image_gen"]}) == ("stop", 1, ["image", "text"])
