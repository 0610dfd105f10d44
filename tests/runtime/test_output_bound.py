"""The most output tokens a plan makes for a request (`plan/output_bound.py`): from the generated
plans' loops and stages, from random walk trees of kv calls (the bound is what a run on the sim
engine counts when no loop stops early), and None where the plan states no size."""
from hypothesis import given, settings, strategies as st

from mstar.compiler.walk_tree import TreeParallel as ParallelPlan, TreeSequential as SequentialPlan
from mstar.plan.output_bound import most_counted_tokens, partition_bound
from mstar.plan.schema import SubModelPlan
from mstar.runtime.conductor.request import Request
from mstar.runtime.engine.sim import SimEngine
from mstar.runtime.serve.driver import Driver, Workload

from runtime_plans import (
    Names, call, edge, generated, hand_plan, kv_node, loop, partition, section_shapes, stateless_node, walk,
)


def test_the_generated_plans_bounds():
    # llama: the prefill's token and the decode loop's 2048; whisper: 448 a window, 1000 windows
    assert most_counted_tokens(generated("llama")) == 1 + 2048
    assert most_counted_tokens(generated("qwen3_asr")) == 1 + 1024
    whisper = generated("whisper")
    assert whisper.partitions[0].repeat is not None and whisper.partitions[0].repeat.max_rounds == 1000
    assert most_counted_tokens(whisper) == (1 + 447) * 1000
    orpheus = generated("orpheus")  # the codec's partition counts nothing
    assert [partition_bound(orpheus, p) for p in orpheus.partitions] == [2049, 0]
    assert most_counted_tokens(generated("wan22")) is None  # no partition counts tokens


def test_a_depth_model_adds_its_tokens_to_every_call_of_its_walks():
    plan = generated("llama")
    node = plan.nodes[0]
    depth = SubModelPlan(name="depth", dims={}, walks=["decode"], samples="new_token", depth=3)
    plan = plan.model_copy(update={"nodes": [node.model_copy(update={"submodels": [depth]})]})
    assert most_counted_tokens(plan) == 1 + 2048 * (1 + 3)


def test_a_counted_output_of_no_stated_size_gives_no_bound():
    body = [call("codec", ["go"], edge("out", "client", modality="text"))]
    plan = hand_plan([walk("w", "P", *body)], [partition("P", ["w"])], [stateless_node("codec", ["go"])])
    assert most_counted_tokens(plan) is None


def _build(shape, names: Names, nodes: list):
    """A section of kv calls, each a token to the client; and how many tokens one run makes."""
    if shape[0] == "call":
        node = names.name()
        nodes.append(kv_node(node, ["go"]))
        return call(node, ["go"], edge("out", "client", modality="text")), 1
    body, tokens = [], 0
    for child in shape[-1]:
        section, child_tokens = _build(child, names, nodes)
        body.append(section)
        tokens += child_tokens
    if shape[0] == "seq":
        return SequentialPlan(body=body), tokens
    if shape[0] == "par":
        return ParallelPlan(body=body), tokens
    inner = sorted({c.node for c in _calls(body)})
    return loop(f"l{names.name()}", shape[1], body, nodes=inner), tokens * shape[1]


def _calls(sections):
    for section in sections:
        if hasattr(section, "body"):
            yield from _calls(section.body)
        else:
            yield section


@settings(max_examples=40, deadline=None)
@given(st.lists(section_shapes(2), min_size=1, max_size=3))
def test_the_bound_is_what_a_run_counts_when_no_loop_stops(shapes):
    names, nodes, body, expected = Names(), [], [], 0
    for shape in shapes:
        section, tokens = _build(shape, names, nodes)
        body.append(section)
        expected += tokens
    plan = hand_plan([walk("w", "P", *body)], [partition("P", ["w"])], nodes)
    assert most_counted_tokens(plan) == expected
    driver = Driver(plan, SimEngine(plan))
    driver.run(Workload([Request(id="r", prompt_tokens=[1], max_tokens=4000)]))  # past any tree here
    record = driver.conductor.records["r"]
    assert record.finish_reason == "stop" and record.num_output_tokens == expected
