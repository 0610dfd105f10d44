"""The most output tokens a plan makes for a request (`plan/output_bound.py`): from the generated
plans' loops and stages, from random walk trees of kv calls (the bound is what a run on the sim
engine counts when no loop stops early), and None where the plan states no size."""
from hypothesis import given, settings, strategies as st

from mstar.compiler.walk_tree import TreeParallel as ParallelPlan, TreeSequential as SequentialPlan
from mstar.plan.output_bound import excess_tokens_problem, most_counted_tokens, partition_bound
from mstar.plan.schema import SubModelPlan
from mstar.runtime.conductor.request import Request
from mstar.runtime.engine.sim import SimEngine
from mstar.runtime.serve.driver import Driver, Workload

from plan_roles import with_roles
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


def _token_walk(name: str, partition_name: str, node: str, iterations: int = 0):
    """A walk of one kv call sending a token to the client, in a loop of `iterations` if any."""
    body = call(node, ["go"], edge("out", "client", modality="text"))
    return walk(name, partition_name, loop(f"{name}_loop", iterations, [body], nodes=[node]) if iterations else body)


def test_the_plan_bound_is_its_largest_partition_and_none_if_any_is_unbounded():
    """A request runs one partition's walks (its route), so the bound is the largest partition's,
    not their sum; a partition whose counted output has no stated size leaves the plan unbounded."""
    walks = [_token_walk("a", "P", "n1"), _token_walk("b", "Q", "n2", iterations=5)]
    nodes = [kv_node("n1", ["go"]), kv_node("n2", ["go"])]
    plan = hand_plan(walks, [partition("P", ["a"]), partition("Q", ["b"])], nodes)
    assert [partition_bound(plan, p) for p in plan.partitions] == [1, 5]
    assert most_counted_tokens(plan) == 5
    codec = walk("c", "R", call("codec", ["go"], edge("out", "client", modality="text")))
    plan = hand_plan(walks + [codec], [partition("P", ["a"]), partition("Q", ["b"]), partition("R", ["c"])],
                     nodes + [stateless_node("codec", ["go"])])
    assert most_counted_tokens(plan) is None


def test_a_stage_counts_its_largest_alternative_and_a_partition_none_if_a_stage_has_no_bound():
    walks = [_token_walk("a", "P", "n1"), _token_walk("b", "P", "n2", iterations=3)]
    nodes = [kv_node("n1", ["go"]), kv_node("n2", ["go"])]
    plan = hand_plan(walks, [partition("P", ["a", "b"])], nodes)  # one stage: a | b
    assert partition_bound(plan, plan.partitions[0]) == 3
    codec = walk("c", "P", call("codec", ["go"], edge("out", "client", modality="text")))
    plan = hand_plan(walks + [codec], [partition("P", ["a"], ["c"])], nodes + [stateless_node("codec", ["go"])])
    assert partition_bound(plan, plan.partitions[0]) is None


def test_a_counted_kv_output_that_is_not_a_sampled_token_gives_no_bound():
    """Only a kv node's `tokens` or `transcript` output is one token a row a call."""
    w = _token_walk("a", "P", "n1")
    for role, bound in (("tokens", 1), ("hidden", None)):
        node = with_roles(kv_node("n1", ["go"]), [w], output_roles={"out": role})
        assert most_counted_tokens(hand_plan([w], [partition("P", ["a"])], [node])) == bound


def test_asking_for_exactly_the_bound_is_not_refused():
    assert excess_tokens_problem("max_tokens", 2049, 2049) is None
    assert "at most 2049 output tokens" in excess_tokens_problem("max_tokens", 2050, 2049)


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
