"""Lowering of walks: loop-back derivation, loop names and bounds, partitions, streams."""
from compiler_helpers import TTS_SPEC, spec_from

from mstar.compiler.lower_walks import lower_partitions, lower_walks
from mstar.compiler.walk_tree import has_device_loop_back, iter_calls, iter_loops, loops_back_into


def _walks(text):
    spec = spec_from(text)
    return {w.name: w for w in lower_walks(spec, {p.name: p.value for p in spec.params})}


LOOPS_SPEC = """
model loops
param steps = 49
node A stateless { in x in y }
node B stateless { in x in z }
node C stateless { in x }
walk self_edge {
    loop max=3 { A(x, y) -> x: A device -> y: A device }
}
walk later_to_earlier {
    loop gen max=steps {
        sequential {
            parallel {
                A(x, y) -> z: B
                C(x)
            }
            B(x, z) -> x: A -> y: A -> x: C -> out: client image
        }
    }
}
walk two_unnamed {
    loop max=2 { A(x, y) -> x: A -> y: A }
    loop max=4 { C(x) -> x: C device }
}
partition P = self_edge -> later_to_earlier -> two_unnamed
"""


def test_self_edge_is_loop_back_and_on_device():
    walk = _walks(LOOPS_SPEC)["self_edge"]
    (loop,) = iter_loops(walk.body)
    assert loop.name == "self_edge.loop0"
    assert [(e.name, e.dest) for e in loop.loop_back] == [("x", "A"), ("y", "A")]
    assert loop.is_on_device and not loop.has_stop
    assert all(e.is_loop_back for call in iter_calls(walk.body) for e in call.edges)
    assert has_device_loop_back(walk, "A")


def test_later_section_to_earlier_is_loop_back_forward_edge_is_not():
    walk = _walks(LOOPS_SPEC)["later_to_earlier"]
    (loop,) = iter_loops(walk.body)
    assert loop.name == "gen" and loop.max_iters == 49  # param resolved
    assert [(e.dest, e.name) for e in loop.loop_back] == [("A", "x"), ("A", "y"), ("C", "x")]
    assert not loop.is_on_device  # the loop-backs visit the host
    edges = {(c.node, e.name, e.dest_kind): e for c in iter_calls(walk.body) for e in c.edges}
    assert not edges[("A", "z", "node")].is_loop_back  # forward inside the loop
    assert not edges[("B", "out", "client")].is_loop_back
    assert edges[("B", "out", "client")].modality == "image"
    assert loop.nodes == ["A", "C", "B"]


def test_unnamed_loops_are_numbered_per_walk():
    walk = _walks(LOOPS_SPEC)["two_unnamed"]
    loops = list(iter_loops(walk.body))
    assert [loop.name for loop in loops] == ["two_unnamed.loop0", "two_unnamed.loop1"]
    assert [loop.is_on_device for loop in loops] == [False, True]


def test_tts_walks_partitions_and_streams():
    spec = spec_from(TTS_SPEC)
    walks = _walks(TTS_SPEC)
    assert sorted(walks) == ["chunk", "decode", "prefill"]
    assert walks["prefill"].partition == "LLM" and walks["chunk"].partition == "CODEC"
    prefill_edges = list(iter_calls(walks["prefill"].body))[0].edges
    assert [(e.dest_kind, e.dest, e.stream_partition) for e in prefill_edges] == [
        ("conductor", "", None), ("stream", "codec", "CODEC"),
    ]
    assert prefill_edges[0].is_persist and prefill_edges[0].is_count_tokens
    assert [e.name for e in loops_back_into(walks["decode"], "LLM")] == ["text_inputs"]
    assert loops_back_into(walks["prefill"], "LLM") == []
    partitions = {p.name: p for p in lower_partitions(spec)}
    assert partitions["LLM"].initial_walk == "prefill"
    assert [s.walks for s in partitions["LLM"].stages] == [["prefill"], ["decode"]]
    codec = partitions["CODEC"]
    assert codec.initial_walk is None  # self-triggered from its stream buffer
    (stream,) = codec.streams
    assert (stream.producer_partition, stream.edge, stream.consumer_node) == ("LLM", "new_token", "codec")
    assert (stream.policy.kind, stream.policy.size, stream.policy.stride) == ("window", 14, 7)


NESTED_SPEC = """
model nested
node A stateless { in x in y }
node B stateless { in x in z }
node C stateless { in x }
walk nested {
    loop outer max=3 {
        loop inner max=2 { A(x, y) -> y: A }
        B(x, z) -> x: A -> out: client image
    }
}
walk no_back {
    loop max=2 { C(x) -> out: client image }
}
partition P = nested -> no_back
"""


def test_an_edge_back_to_a_node_of_an_earlier_nested_loop_loops_back_in_the_outer_loop():
    walk = _walks(NESTED_SPEC)["nested"]
    outer, inner = iter_loops(walk.body)
    assert (outer.name, inner.name) == ("outer", "inner")
    assert [(e.dest, e.name) for e in outer.loop_back] == [("A", "x")]
    assert [(e.dest, e.name) for e in inner.loop_back] == [("A", "y")]


def test_a_loop_without_loop_backs_is_not_on_the_device():
    (loop,) = iter_loops(_walks(NESTED_SPEC)["no_back"].body)
    assert loop.loop_back == [] and not loop.is_on_device
