"""Property test: random section trees (sequential, parallel, nested loops) run every call the
tree implies, exactly, through the driver and scheduler, for several requests at once."""
from hypothesis import given, strategies as st

from mstar.compiler.walk_tree import TreeParallel as ParallelPlan, TreeSequential as SequentialPlan
from mstar.runtime.serve.driver import Driver, Workload
from mstar.runtime.engine.sim import SimEngine
from mstar.runtime.conductor.request import Request

from runtime_plans import Names, call, edge, hand_plan, loop, partition, section_shapes, stateless_node, walk


def build(shape, names: Names, nodes: list):
    """Section plan for a shape, and how many calls one run of it makes per node."""
    if shape[0] == "call":
        node = names.name()
        nodes.append(stateless_node(node, ["go"]))
        return call(node, ["go"], edge("out", "client", modality="text")), {node: 1}
    body, counts = [], {}
    for child in shape[-1]:
        section, child_counts = build(child, names, nodes)
        body.append(section)
        for node, num in child_counts.items():
            counts[node] = counts.get(node, 0) + num
    if shape[0] == "seq":
        return SequentialPlan(body=body), counts
    if shape[0] == "par":
        return ParallelPlan(body=body), counts
    inner_nodes = sorted(counts)
    return loop(f"l{names.name()}", shape[1], body, nodes=inner_nodes), {n: c * shape[1] for n, c in counts.items()}


@given(st.lists(section_shapes(3), min_size=1, max_size=3), st.integers(1, 4))
def test_random_section_trees_run_every_call_exactly(shapes, num_requests):
    names, nodes, body, expected = Names(), [], [], {}
    for shape in shapes:
        section, counts = build(shape, names, nodes)
        body.append(section)
        for node, num in counts.items():
            expected[node] = expected.get(node, 0) + num
    plan = hand_plan([walk("w", "P", *body)], [partition("P", ["w"])], nodes)
    ran: dict[tuple[str, str], int] = {}

    class Counting(SimEngine):
        def run_step(self, step):
            for row in step.rows:
                ran[(row.request_id, step.node)] = ran.get((row.request_id, step.node), 0) + 1
            return super().run_step(step)

    driver = Driver(plan, Counting(plan))
    driver.run(Workload([Request(id=f"r{i}", prompt_tokens=[1], max_tokens=10_000) for i in range(num_requests)]))
    for i in range(num_requests):
        assert driver.conductor.records[f"r{i}"].finish_reason == "stop"
        assert {node: ran.get((f"r{i}", node), 0) for node in expected} == expected
