"""The conductor's walk machine, driven one row at a time (no scheduler)."""
from mstar.plan.schema import ChunkPolicyPlan, StreamPlan
from mstar.runtime.engine.sim import SimEngine
from mstar.runtime.conductor.request import Request
from mstar.runtime.step import RowResult

from conductor_harness import Harness
from runtime_plans import call, edge, generated, hand_plan, kv_node, loop, partition, stateless_node, walk


def request(rid="r0", prompt=8, max_tokens=40, **kw):
    return Request(id=rid, prompt_tokens=list(range(prompt)), max_tokens=max_tokens, **kw)


def test_orpheus_prefill_then_decode_then_done_with_snac_windows():
    harness = Harness(generated("orpheus"))
    record = harness.submit(request(max_tokens=40))
    harness.run()
    assert record.finish_reason == "length"
    walks = [(node, walk) for rid, node, walk, _ in harness.ran]
    llm = [w for n, w in walks if n == "LLM"]
    assert llm[0] == "prefill" and set(llm[1:]) == {"decode"} and len(llm) == 40
    # The prompt feeds prefill; decode's first row gets the persisted new_token (hand-off).
    rows = [row for _, node, _, row in harness.ran if node == "LLM"]
    assert rows[0].inputs["text_inputs"] == list(range(8)) and rows[0].num_tokens == 8
    assert rows[1].inputs["text_inputs"] == record.output_tokens[:1]
    assert [r.context_len for r in rows[:3]] == [0, 8, 9]
    assert [r.loop_iter for r in rows[1:4]] == [0, 1, 2]
    # SNAC: windows of 28 sliding by 7 over the 40 tokens, then a final partial chunk.
    chunks = [row.inputs["new_token"] for _, node, _, row in harness.ran if node == "snac_decoder"]
    tokens = record.output_tokens
    assert chunks[:2] == [tokens[0:28], tokens[7:35]]
    assert chunks[2] == tokens[14:40] and len(chunks) == 3
    assert sum(1 for e in record.emissions if e.modality == "audio") == 3
    assert not harness.conductor.active


def test_max_tokens_ends_the_partition_and_counts_exactly():
    plan = generated("orpheus")
    # never stops
    harness = Harness(plan, respond=lambda node, row, result: RowResult(result.request_id, result.outputs))
    records = [harness.submit(request(f"r{i}", max_tokens=n)) for i, n in enumerate((1, 5, 29))]
    harness.run()
    assert [r.num_output_tokens for r in records] == [1, 5, 29]
    assert all(r.finish_reason == "length" for r in records)
    assert all(len(r.token_times_s) == r.num_output_tokens for r in records)


def test_stop_in_a_stop_loop_ends_it_and_outside_loops_ends_the_partition():
    def stop_everything(node, row, result):
        return RowResult(result.request_id, result.outputs, is_stop=True)

    def stop_in_decode(node, row, result):
        return RowResult(result.request_id, result.outputs, is_stop=row.walk == "decode")

    harness = Harness(generated("orpheus"), respond=stop_everything)
    record = harness.submit(request(max_tokens=100))
    harness.run()
    # prefill's stop (no loop to end) ends the partition where the decode after it would count
    # (PartitionState.stops_outside_loops); before, it was ignored and the decode ran one iteration
    assert [w for _, n, w, _ in harness.ran if n == "LLM"] == ["prefill"]
    assert record.finish_reason == "stop" and record.num_output_tokens == 1
    harness = Harness(generated("orpheus"), respond=stop_in_decode)
    record = harness.submit(request(max_tokens=100))
    harness.run()
    # decode stops after its first iteration
    assert [w for _, n, w, _ in harness.ran if n == "LLM"] == ["prefill", "decode"]
    assert record.finish_reason == "stop" and record.num_output_tokens == 2  # prefill + the one decode token


def test_a_partition_that_runs_again_may_count_more_and_a_stop_outside_loops_is_not_its_end():
    """One test of a partition that runs again (`PartitionState.can_run_again`: Whisper's repeat
    rule, SNAC's walk per chunk) answers both questions: more may be counted after any output, and
    a model's stop outside loops does not end it. Orpheus's LLM partition, at its prefill, runs
    once: a decode follows that counts, so the two questions agree there."""
    for model, runs_again in (("whisper", {"ASR"}), ("orpheus", {"SNAC"})):
        harness = Harness(generated(model))
        harness.submit(request(max_tokens=40))
        for ps in harness.conductor.active["r0"].partitions:
            assert ps.can_run_again() == (ps.name in runs_again), (model, ps.name)
            if ps.can_run_again():
                assert ps.may_count_more() and ps.may_count_more(0) and not ps.stops_outside_loops()
            else:
                assert ps.may_count_more() and ps.stops_outside_loops()


def test_the_loop_pass_asks_which_loop_a_stop_ends_only_on_a_stop_token(monkeypatch):
    """The loop pass's general kernel (`loop_pass._advance_row`, Orpheus's decode here) looks up
    the loop a row's model stop ends (`model_stop_loop`) only for a row that reported a stop: for
    any other it is None. The ends are as before: a stop as the max_tokens-th token ends `stop`,
    max_tokens before a stop ends `length`."""
    import mstar.runtime.conductor.loop_pass as loop_pass

    asked = []
    real = loop_pass.model_stop_loop
    monkeypatch.setattr(loop_pass, "model_stop_loop", lambda c, result: asked.append(result.is_stop) or real(c, result))

    def stop_at_fourth_decode(node, row, result):
        return RowResult(result.request_id, result.outputs, is_stop=row.walk == "decode" and row.loop_iter == 3)

    for max_tokens, reason, num_tokens in ((100, "stop", 5), (5, "stop", 5), (4, "length", 4)):
        asked.clear()
        harness = Harness(generated("orpheus"), respond=stop_at_fourth_decode)
        record = harness.submit(request(max_tokens=max_tokens))
        harness.run()
        assert (record.finish_reason, record.num_output_tokens) == (reason, num_tokens), max_tokens
        assert asked == ([True] if num_tokens == 5 else []), max_tokens


def build_loop_plan(has_stop=False):
    """A(seed) -> x loops back 3 times; y accumulated, z output -> B; B(y, z) -> out: client."""
    a, b = kv_node("A", ["seed", "x"]), stateless_node("B", ["y", "z"])
    body = [call("A", ["x"], edge("x", "node", "A", is_loop_back=True), edge("y", "node", "B"), edge("z", "node", "B"))]
    w = walk("gen", "P",
             call("A", ["seed"], edge("x", "node", "A")),
             loop("gen_loop", 3, body, has_stop=has_stop, nodes=["A"], outputs=("z",), accumulate=("y",)),
             call("B", ["y", "z"], edge("out", "client", modality="image")))
    return hand_plan([w], [partition("P", ["gen"])], [a, b])


def test_loop_outputs_deliver_the_last_value_and_accumulate_every_iteration():
    values = iter(range(100))

    def numbered(node, row, result):
        return RowResult(result.request_id, {name: next(values) for name in result.outputs})

    harness = Harness(build_loop_plan(), respond=numbered)
    record = harness.submit(request(max_tokens=1000))
    harness.run()
    ran = [(node, row.inputs) for _, node, _, row in harness.ran]
    assert [n for n, _ in ran] == ["A", "A", "A", "A", "B"]
    # iteration i reads the loop-back of iteration i-1 (the first reads the edge before the loop)
    first_x = ran[0][1]  # inputs of the call before the loop
    assert "seed" in first_x
    loop_x = [inputs["x"] for _, inputs in ran[1:4]]
    # Each A row numbers its outputs x, y, z in turn: a row reading x = n emits x = n + 3,
    # y = n + 4, z = n + 5.
    assert loop_x == [0, 3, 6]
    b_inputs = ran[4][1]
    assert b_inputs["y"] == [4, 7, 10]  # every iteration's y
    assert b_inputs["z"] == 11  # the last iteration's z
    assert record.finish_reason == "stop" and len(record.emissions) == 1


def test_a_stop_loop_out_of_iterations_ends_length_and_a_stopped_one_stop():
    """A loop with a stop condition that reaches its max before a stop cut the output: "length"
    (as max_tokens would); stopped within its max, "stop"; a loop without a stop condition that
    runs its count (above) ends "stop"."""
    def numbered(node, row, result):
        return RowResult(result.request_id, {name: 0 for name in result.outputs})

    cut = Harness(build_loop_plan(has_stop=True), respond=numbered)
    record = cut.submit(request(max_tokens=1000))
    cut.run()
    assert [n for _, n, _, _ in cut.ran] == ["A", "A", "A", "A", "B"] and record.finish_reason == "length"

    def stop_second(node, row, result):
        return RowResult(result.request_id, {name: 0 for name in result.outputs},
                         is_stop=node == "A" and row.loop_iter == 1)

    stopped = Harness(build_loop_plan(has_stop=True), respond=stop_second)
    record = stopped.submit(request(max_tokens=1000))
    stopped.run()
    assert [n for _, n, _, _ in stopped.ran] == ["A", "A", "A", "B"] and record.finish_reason == "stop"


def test_parallel_members_are_ready_together():
    from mstar.compiler.walk_tree import TreeParallel as ParallelPlan

    a, b, c = stateless_node("A", ["p"]), stateless_node("B", ["p"]), stateless_node("C", ["a", "b"])
    w = walk("w", "P", ParallelPlan(body=[call("A", ["p"], edge("a", "node", "C")),
                                          call("B", ["p"], edge("b", "node", "C"))]),
             call("C", ["a", "b"], edge("out", "client", modality="text")))
    harness = Harness(hand_plan([w], [partition("P", ["w"])], [a, b, c]))
    harness.submit(request())
    assert [(node, walk) for _, node, walk, _ in harness.queue] == [("A", "w"), ("B", "w")]
    harness.run()
    assert [node for _, node, _, _ in harness.ran] == ["A", "B", "C"]


def test_failed_request_ends_alone():
    def fail_r1(node, row, result):
        if result.request_id == "r1" and row.walk == "decode":
            return RowResult("r1", error="boom")
        return result

    harness = Harness(generated("orpheus"), respond=fail_r1)
    records = [harness.submit(request(f"r{i}", max_tokens=30)) for i in range(3)]
    harness.run()
    assert records[1].finish_reason == "error: boom"
    assert records[0].finish_reason == records[2].finish_reason == "length"
    assert records[0].num_output_tokens == 30 and records[1].num_output_tokens == 1


def test_engine_refusal_fails_only_that_request():
    plan = generated("orpheus")
    engine = SimEngine(plan, num_pages=8, check_steps=False)  # 128 tokens at most; the harness's steps
    harness = Harness(plan, engine)
    big = harness.submit(request("big", prompt=100, max_tokens=100))
    small = harness.submit(request("small", max_tokens=10))
    harness.run()
    assert big.finish_reason.startswith("error: can never fit") and "8" in big.finish_reason
    assert small.finish_reason == "length"


def test_admission_is_fifo_under_max_concurrent():
    orpheus = generated("orpheus")
    deployment = orpheus.deployment.model_copy(update={"max_concurrent_requests": 2})
    plan = orpheus.model_copy(update={"deployment": deployment})
    harness = Harness(plan)
    records = [harness.submit(request(f"r{i}", max_tokens=5)) for i in range(5)]
    assert harness.conductor.num_active == 2 and harness.conductor.num_waiting == 3
    harness.run()
    admits = [r.admit_s for r in records]
    assert admits == sorted(admits) and all(r.finish_reason == "length" for r in records)


def test_routes_pick_alternatives_and_optional_stages():
    harness = Harness(generated("bagel"))
    text = harness.submit(request("text", max_tokens=5))
    image = harness.submit(request("image", max_tokens=5, route={"LLM": ["prefill_vit", "prefill_text", "image_gen"]}))
    bad = harness.submit(request("bad", route={"LLM": ["decode"]}))
    unknown = harness.submit(request("unknown", route={"Nope": []}))
    harness.run()
    walks = {}
    for rid, _node, w, _ in harness.ran:
        walks.setdefault(rid, [])
        if not walks[rid] or walks[rid][-1] != w:
            walks[rid].append(w)
    assert walks["text"] == ["prefill_text", "decode"]
    assert walks["image"] == ["prefill_vit", "prefill_text", "image_gen"]
    assert text.finish_reason in ("length", "stop") and image.finish_reason in ("length", "stop")
    assert bad.finish_reason.startswith("error: partition LLM")
    assert unknown.finish_reason.startswith("error: route names")
    assert any(e.modality == "image" for e in image.emissions)


def test_multi_stage_stream_consumer_runs_each_stage_once_and_ends():
    harness = Harness(generated("qwen3_omni"))
    record = harness.submit(request(max_tokens=12))
    harness.run()
    talker = [w for _, node, w, _ in harness.ran if node == "Talker"]
    assert talker[:2] == ["talker_prefill", "talker_last_prefill"] and set(talker[2:]) == {"talker_decode"}
    assert record.finish_reason in ("length", "stop") and not harness.conductor.active
    code2wav = [row.inputs["codec_tokens"] for _, node, _, row in harness.ran if node == "Code2Wav"]
    assert code2wav and all(len(chunk) <= 50 for chunk in code2wav)


def test_cancel_ends_a_running_request():
    harness = Harness(generated("orpheus"))
    record = harness.submit(request(max_tokens=50))
    harness.conductor.cancel("r0")
    harness.run()
    assert record.finish_reason == "cancelled" and harness.ran == []
    assert harness.conductor.ended_out == ["r0"] and not harness.conductor.active


def test_stream_consumer_with_a_stream_that_never_comes_ends():
    # P produces nothing on the stream; Q (self-triggered) ends once P is done.
    p, q = kv_node("A", ["text_inputs"]), stateless_node("B", ["s"], stream_inputs=("s",))
    wa = walk("wa", "P", call("A", ["text_inputs"], edge("t", "conductor", is_persist=True, is_count_tokens=True)))
    wb = walk("wb", "Q", call("B", ["s"], edge("out", "client", modality="audio")))
    stream = StreamPlan(producer_partition="P", edge="s", consumer_node="B",
                        policy=ChunkPolicyPlan(kind="fixed", size=4))
    plan = hand_plan([wa, wb], [partition("P", ["wa"]), partition("Q", ["wb"], initial=None, streams=[stream])], [p, q])
    harness = Harness(plan)
    record = harness.submit(request(max_tokens=3))
    harness.run()
    assert record.finish_reason == "stop" and [n for _, n, _, _ in harness.ran] == ["A"]


def test_nested_loops_route_inner_outputs_through_the_outer_loop():
    """outer (2 iterations) { inner (2 iterations) { A(x) -> x loop-back to the inner loop, y
    accumulated by the inner loop, z held by the inner loop and then by the outer loop };
    C(y) -> w accumulated by the outer loop }; B(w, z) -> client. The edge routes of A are
    decided once per call from its loop nesting (depth 0: the inner loop, 1: the outer)."""
    a, c, b = kv_node("A", ["x"]), stateless_node("C", ["y"]), stateless_node("B", ["w", "z"])
    inner_body = [call("A", ["x"], edge("x", "node", "A", is_loop_back=True), edge("y", "node", "C"),
                       edge("z", "node", "B"))]
    inner = loop("inner", 2, inner_body, nodes=["A"], outputs=("z",), accumulate=("y",))
    outer = loop("outer", 2, [inner, call("C", ["y"], edge("w", "node", "B"))], nodes=["A", "C"],
                 outputs=("z",), accumulate=("w",))
    w = walk("gen", "P", outer, call("B", ["w", "z"], edge("out", "client", modality="text")))
    plan = hand_plan([w], [partition("P", ["gen"])], [a, c, b])
    values = iter(range(100))

    def numbered(node, row, result):
        return RowResult(result.request_id, {name: next(values) for name in result.outputs})

    harness = Harness(plan, respond=numbered)
    record = harness.submit(request(max_tokens=1000))
    harness.run()
    ran = [(node, row.inputs) for _, node, _, row in harness.ran]
    assert [n for n, _ in ran] == ["A", "A", "C", "A", "A", "C", "B"]
    # A numbers x, y, z; C numbers w. Outer iteration 1: A -> 0,1,2 then 3,4,5; C(y=[1, 4]) -> 6.
    # Outer iteration 2: A -> 7,8,9 then 10,11,12; C(y=[8, 11]) -> 13.
    assert ran[2][1]["y"] == [1, 4] and ran[5][1]["y"] == [8, 11]
    assert ran[6][1] == {"w": [6, 13], "z": 12}
    assert record.finish_reason == "stop" and len(record.emissions) == 1


def test_a_request_failed_while_the_engine_takes_it_ends_once_and_never_runs():
    """`fail` on a request being admitted (neither waiting nor active yet, e.g. a cancellation the
    engine delivers from `add_request`) ends it with that reason; it is not started after."""
    plan = generated("llama")
    engine = SimEngine(plan, check_steps=False)  # the harness's one-row steps (conductor_harness.py)
    harness = Harness(plan, engine)
    conductor = harness.conductor
    taken = engine.add_request

    def add_request(request_id, spec):
        reason = taken(request_id, spec)
        if request_id == "r1":
            conductor.fail(request_id, "cancelled")
        return reason

    engine.add_request = add_request
    conductor.submit(Request(id="r0", prompt_tokens=[1, 2, 3], max_tokens=2))
    record = conductor.submit(Request(id="r1", prompt_tokens=[1, 2, 3], max_tokens=2))
    assert record.is_finished and record.finish_reason == "cancelled"
    assert "r1" not in conductor.active and list(conductor.ended_out).count("r1") == 1
    harness._collect()
    harness.run()
    assert conductor.records["r0"].finish_reason is not None and not conductor.active
